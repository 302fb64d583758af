"""The shared (Redis) index with the in-process index behind it: a circuit breaker.

Every record goes to both: the local index at once, Redis in the background (off the request's
path, bounded by its own timeout), so the local index always holds this router's own decisions.
A lookup asks Redis within ``index.timeout_s``; a call that fails or takes longer is answered
by the local index instead (``Probe.degraded``) and never fails a request. Once Redis looks down
(an error other than a timeout, or ``index.trip_after`` timeouts in a row) it is logged once and
left alone for ``index.retry_after_s`` (the client reconnects by itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Collection, Sequence

from ..background import Background
from ..config import IndexConfig
from ..metrics import Metrics
from . import Op, PrefixIndex, Probe, Receipt

log = logging.getLogger("kvroute.index")


class SharedIndexDown(ConnectionError):
    """An update the shared index did not take (the caller may repeat it: updates are idempotent)."""


class _Both(Receipt):
    """A record made in both indexes: the local receipt, and the background Redis record."""

    __slots__ = ("local", "shared")

    def __init__(self, local: Receipt, shared: "asyncio.Task[Receipt | None]") -> None:
        super().__init__(local.model, local.replica, local.chain, local.kept, local.stamp)
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "shared", shared)


class FallbackIndex:
    name = "redis"

    def __init__(self, shared: PrefixIndex, local: PrefixIndex, cfg: IndexConfig, metrics: Metrics) -> None:
        self.shared = shared
        self.local = local
        self.cfg = cfg
        self.metrics = metrics
        self._down_until = 0.0
        self._failures_in_a_row = 0
        self._background = Background()
        self._slow_timeout = cfg.background_timeout_s  # background calls may wait longer than lookups

    # -- health of the shared index ------------------------------------------------------------

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, e: BaseException) -> None:
        """Count a failed Redis call; stop asking Redis for a while once it looks down.

        A lone slow answer (a timeout) on a busy machine only sends that request to the local index;
        ``index.trip_after`` timeouts in a row, or any other error (refused, reset), trip the fallback.
        """
        self.metrics.index_errors.labels(op).inc()
        self._failures_in_a_row += 1
        if isinstance(e, TimeoutError) and self._failures_in_a_row < self.cfg.trip_after:
            return
        if time.monotonic() >= self._down_until:
            log.warning("Redis index %s failed (%s); using the local index for %.1f s", op,
                        e.__class__.__name__, self.cfg.retry_after_s)
        self._down_until = time.monotonic() + self.cfg.retry_after_s

    def _ok(self) -> None:
        self._failures_in_a_row = 0
        self.metrics.index_fallback.set(0)

    # -- the contract --------------------------------------------------------------------------

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str],
                    exact: Collection[str] = ()) -> Probe:
        # a prompt shorter than a block matches nothing anywhere: its sizes are not worth a round trip
        if chain:
            if self._usable():
                try:
                    async with asyncio.timeout(self.cfg.timeout_s):  # no extra task, unlike wait_for
                        found = await self.shared.probe(model, chain, replicas, exact)
                    self._ok()
                    return found
                except Exception as e:  # Redis down, slow or confused: route on local knowledge
                    self._failed("lookup", e)
            # answered here: the gauge says so until a lookup reaches Redis again, and the counter keeps
            # every such lookup (a gauge sampled every 15 s misses a lone slow answer)
            self.metrics.index_fallback.set(1)
            self.metrics.index_fallback_lookups.inc()
            return Probe((await self.local.probe(model, chain, replicas, exact)).matches, degraded=True)
        return await self.local.probe(model, chain, replicas, exact)

    async def holders(self, model: str, chain: Sequence[int], limit: int) -> list[str] | None:
        # as a lookup: Redis while it answers in time, else the local index (this router's placements)
        if chain and self._usable():
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    found = await self.shared.holders(model, chain, limit)
                self._ok()
                return found
            except Exception as e:
                self._failed("holders", e)
        return await self.local.holders(model, chain, limit)

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        local = await self.local.record(model, replica, chain, capacity)
        if local is None:
            return None
        # even while lookups use the local index: other routers need this decision as soon as Redis
        # answers again (a failed record costs one background task, bounded by its timeout)
        return _Both(local, self._background.spawn(
            self._shared("record", lambda: self.shared.record(model, replica, chain, capacity))))

    async def provisional(self, model: str, replica: str, chain: Sequence[int], expires: float) -> Receipt | None:
        local = await self.local.provisional(model, replica, chain, expires)
        if local is None:
            return None
        return _Both(local, self._background.spawn(
            self._shared("record", lambda: self.shared.provisional(model, replica, chain, expires))))

    async def apply(self, model: str, replica: str, ops: Sequence[Op]) -> None:
        """Events go to both; raises :class:`SharedIndexDown` if Redis did not take them (the event
        consumer then replays the batch once Redis answers)."""
        await self.local.apply(model, replica, ops)
        if not self._usable():
            raise SharedIndexDown("the shared index is down")
        try:
            async with asyncio.timeout(self._slow_timeout):
                await self.shared.apply(model, replica, ops)
        except Exception as e:
            self._failed("apply", e)
            raise SharedIndexDown(str(e) or e.__class__.__name__) from None

    async def _shared(self, op: str, call: "Callable[[], Awaitable[Receipt | None]]") -> Receipt | None:
        try:
            async with asyncio.timeout(self._slow_timeout):
                return await call()
        except TimeoutError:  # off the request's path: slow is not down, lookups decide that
            self.metrics.index_errors.labels(op).inc()
        except Exception as e:
            self._failed(op, e)
        return None

    async def withdraw(self, receipt: Receipt) -> None:
        if isinstance(receipt, _Both):
            await self.local.withdraw(receipt.local)
            await self._withdraw_shared(receipt.shared)
        else:
            await self.local.withdraw(receipt)

    async def _withdraw_shared(self, recorded: "asyncio.Task[Receipt | None]") -> None:
        try:
            receipt = await recorded
            if receipt is not None:
                async with asyncio.timeout(self._slow_timeout):
                    await self.shared.withdraw(receipt)
        except Exception as e:
            self._failed("withdraw", e)

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        await self.local.forget(replica, models)
        try:
            async with asyncio.timeout(self._slow_timeout):
                await self.shared.forget(replica, models)
        except Exception as e:
            self._failed("forget", e)

    async def size(self, model: str, replica: str) -> int:
        """This router's view (the local index): no Redis call for a gauge."""
        return await self.local.size(model, replica)

    async def start(self) -> None:
        self._background.spawn(self._connect())

    async def _connect(self) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: a close() that comes as the call fails is not lost
                async with asyncio.timeout(self._slow_timeout):
                    await self.shared.start()
                log.info("prefix index: Redis at %s is ready", self.cfg.backend.split("@")[-1])
                return
            except Exception as e:
                self._failed("connect", e)
                await asyncio.sleep(self.cfg.retry_after_s)

    async def close(self) -> None:
        await self._background.close()
        await self.shared.close()
        await self.local.close()
