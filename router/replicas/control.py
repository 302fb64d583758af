"""The router's own requests to each replica: health checks and scrapes, on a connection of their own.

Each replica has one background loop (:meth:`Control.loop`) that checks its ``/health`` (then its
``/v1/models``) every ``health.interval_s`` and scrapes its ``/metrics`` every ``health.metrics_interval_s``,
one after the other on one kept-alive connection apart from the requests'. On a fleet that would need more
of them a second than the control budget allows (:mod:`.control_budget`: ``health.max_requests_per_s``, or
fewer where ``health.max_idle_cpu`` of a core buys fewer), every replica is checked less often
(:meth:`Control.spacing`), and ``/v1/models`` is read with one check in :data:`MODELS_EVERY` only. With several worker processes each
worker checks at ``workers`` times the interval, staggered, so a replica sees the configured rate in all.
With routers sharing the checks (:mod:`.shared_health`) each replica's owner checks it at the configured
rate and the others ``routers`` times less often; the budget counts that share of the fleet.

An answer that carries this router's own instance id (:mod:`router.hops`) means the replica's URL reaches
this router: such a replica is never routed to.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping

from .. import hops
from ..config import HealthConfig, ProxyConfig
from ..load import LoadTable
from ..upstream import ConnectFailed, UpstreamError, UpstreamPool, UpstreamResponse
from .control_budget import ControlBudget
from .health import Health
from .record import Replica
from .shared_health import SharedHealth

log = logging.getLogger("kvroute.pool")

HEADERS = b"user-agent: kvroute-health\r\naccept-encoding: identity\r\n"
MODELS_EVERY = 5  # on a fleet past the control budget, /v1/models is read with one health check in this many
WATCH_S = 1.0  # how often the replicas are looked over for requests left unanswered (see Control.watch)
MAX_BYTES = 32 << 20  # a /metrics page larger than this is not a replica's


class TooLarge(UpstreamError):
    """A health-check or /metrics answer larger than :data:`MAX_BYTES`."""


class ThisRouter(UpstreamError):
    """The replica's URL reaches this very router (its answer carries this router's instance id)."""


async def fetch(r: Replica, path: str, timeout: float, instance: str | None) -> tuple[int, bytes]:
    """GET ``path`` on the replica's control connection: status and body, all within ``timeout``. Raises
    :class:`~router.upstream.UpstreamError` (:class:`ThisRouter` for an answer with this router's ``instance``
    id) or ``TimeoutError``."""
    assert r.control is not None
    async with asyncio.timeout(timeout):
        resp = await r.control.request(b"GET", path, HEADERS + r.header_lines, b"", timeout)
        if is_this_router(resp, instance):
            resp.release()
            raise ThisRouter("this URL reaches this router itself")
        try:
            body = await resp.read(MAX_BYTES, timeout)
            if not resp.complete:
                raise TooLarge(f"{path} answered more than {MAX_BYTES} bytes")
        finally:
            resp.release()
    return resp.status, body


def is_this_router(resp: UpstreamResponse, instance: str | None) -> bool:
    """The answer carries this router's own instance id (router.hops)."""
    return instance is not None and resp.header(hops.INSTANCE.encode()) == instance.encode()


class Control:
    """Health checks and scrapes of the replicas of a pool (``replicas``: the pool's mapping, read only)."""

    def __init__(self, replicas: Mapping[str, Replica], config: HealthConfig, proxy: ProxyConfig, load: LoadTable,
                 health: Health, on_models: Callable[[Replica, bytes], None],
                 scrape: Callable[[Replica], Awaitable[None]], instance: str | None,
                 shared: SharedHealth | None = None) -> None:
        self.replicas = replicas
        self.shared = shared  # the checks shared with the other routers on one Redis
        self.config = config
        self.proxy = proxy
        self.load = load
        self.health = health
        self.on_models = on_models  # what a replica's /v1/models answered (its body: ValueError if not JSON)
        self.scrape = scrape
        self.instance = instance  # this router's id (router.hops): a replica answering with it is this router
        self._checked: set[str] = set()  # replicas whose first health check is done
        self.first_round = asyncio.Event()  # every replica checked once
        self.budget = ControlBudget(config, lambda: (load.taken, load.released), on_change=self._respace,
                                    workers=load.workers)
        self._plans: dict[str, list[float]] = {}  # replica -> when its next check and scrape are planned
        self._scraped: dict[str, float] = {}  # replica -> when its last scrape began
        self._sleeping: dict[str, asyncio.Future[None]] = {}  # replica -> what its loop sleeps on until its plan

    def connection(self, url: str) -> UpstreamPool:
        """A replica's control connection: kept alive between rounds for up to ``proxy.upstream_idle_s``."""
        return UpstreamPool(url, min(self.config.timeout_s, self.proxy.connect_timeout_s), self.proxy.upstream_idle_s)

    def forget(self, name: str) -> None:
        self._checked.discard(name)

    async def reaches_this_router(self, url: str) -> bool:
        """Whether ``url`` answers as this very router (asked once, within 2 s; unreachable: no)."""
        if self.instance is None:
            return False
        try:
            probe = UpstreamPool(url.rstrip("/"), min(1.0, self.proxy.connect_timeout_s))
        except Exception:  # not a URL it can use: the registration's own checks say why
            return False
        try:
            async with asyncio.timeout(2.0):
                resp = await probe.request(b"GET", "/health", HEADERS, b"", 2.0)
                try:
                    return is_this_router(resp, self.instance)
                finally:
                    resp.release()
        except (UpstreamError, TimeoutError, OSError):
            return False
        finally:
            probe.close()

    async def check(self, r: Replica) -> None:
        """One health check: /health, then /v1/models (on a large fleet not every time: see :meth:`_models_due`)."""
        try:
            self.budget.count()
            status, _ = await fetch(r, "/health", self.config.timeout_s, self.instance)
            if status != 200:
                self.health.mark_failure(r, f"/health answered {status}")
                return
            r.checks += 1
            if self._models_due(r):
                self.budget.count()
                status, body = await fetch(r, "/v1/models", self.config.timeout_s, self.instance)
                if status != 200:
                    self.health.mark_failure(r, f"/v1/models answered {status}")
                    return
                self.on_models(r, body)
        except ConnectFailed as e:
            self.health.mark_failure(r, f"connection failed: {e}", immediate=True)
            return
        except ThisRouter as e:
            if not r.loops_back:
                r.loops_back = True
                log.warning("replica %s is this router itself (%s): it is never routed to; remove it", r.name,
                            r.config.shown_url, extra={"replica": r.name})
            self.health.mark_failure(r, str(e), immediate=True)
            return
        except (UpstreamError, TimeoutError, ValueError) as e:
            self.health.mark_failure(r, f"health check failed: {e.__class__.__name__}")
            return
        self.health.mark_success(r)

    def spacing(self) -> float:
        """How many times the configured intervals apart each replica is checked and scraped now: 1, or more
        where the fleet would otherwise need more control requests a second than the budget (:attr:`budget`).
        A health check is two requests (/health, /v1/models) while the fleet fits in that budget; beyond it,
        /v1/models goes with every :data:`MODELS_EVERY` th check only (see :meth:`_models_due`)."""
        return max(1.0, self._checked_share() * self._per_replica() / self.budget.rate())

    def _per_replica(self) -> float:
        """Control requests a second a replica takes at the configured intervals, past the budget."""
        h = self.config
        return (1.0 + 1.0 / MODELS_EVERY) / h.interval_s + 1.0 / h.metrics_interval_s

    def _checked_share(self) -> float:
        """How many replicas' worth of checks this router makes at the configured rates: the fleet, or with
        shared checks the replicas it owns and a ``1/routers`` share of the others."""
        return self.shared.share() if self.shared is not None else float(len(self.replicas))

    def _models_due(self, r: Replica) -> bool:
        """Whether this check of ``r`` also reads /v1/models: always on a fleet within the budget at the
        configured intervals, and for a replica not ready; else every :data:`MODELS_EVERY` th check."""
        h = self.config
        full = self._checked_share() * (2.0 / h.interval_s + 1.0 / h.metrics_interval_s)
        return full <= self.budget.rate() or not r.ready or r.checks % MODELS_EVERY == 0

    def _pause(self, interval: float, r: Replica) -> float:
        """Seconds between this process's checks (or scrapes) of ``r``: the workers of a host take turns; with
        shared checks, its owner checks it at the full rate and every other router ``routers`` times less
        often."""
        shared = self.shared
        if shared is not None and shared.active:
            return interval * self.spacing() * (1 if shared.owns(r) else shared.routers)
        return interval * self.load.workers * self.spacing()

    def next_check_in(self, name: str) -> float | None:
        """Seconds until the replica's next health check is planned (None: its checks are not running)."""
        plan = self._plans.get(name)
        return None if plan is None else max(0.0, plan[0] - asyncio.get_running_loop().time())

    def _respace(self, old_rate: float, new_rate: float) -> None:
        """The control budget moved from ``old_rate`` to ``new_rate`` requests a second: the checks and scrapes
        already planned come as many times later (or sooner) from now, so that the fleet meets the new rate at
        once, spread as before, rather than after one more old pause with a gap and a burst."""
        need = self._checked_share() * self._per_replica()
        ratio = max(1.0, need / new_rate) / max(1.0, need / old_rate)
        if ratio == 1.0:
            return
        now = asyncio.get_running_loop().time()
        for plan in self._plans.values():
            for kind, at in enumerate(plan):
                if at > now:
                    plan[kind] = now + (at - now) * ratio

    async def loop(self, r: Replica) -> None:
        """Health checks and /metrics scrapes of one replica, one after the other on its control connection
        (one kept-alive connection for both). Every worker checks at start; the next check and scrape come at a
        random point within one pause (staggered by worker), so that a fleet checked at start is not checked in
        one burst ever after, then every pause; each pause follows the fleet's size at the time, and a change
        of the control budget moves the checks already planned (:meth:`_respace`)."""
        h = self.config
        loop = asyncio.get_running_loop()
        together = h.metrics_interval_s == h.interval_s  # each scrape right after its check
        intervals = (h.interval_s, h.metrics_interval_s)
        start = loop.time()
        # per kind (check, scrape): when the next one is planned (read and moved by _respace), when the last
        # one began, and whether the first after start (at a random point within a pause) is still to come
        plan = self._plans[r.name] = [start, start]
        last = [start, start]
        first = [True, True]

        def following(kind: int) -> float:
            pause = self._pause(intervals[kind], r)
            if first[kind]:
                first[kind] = False
                return last[kind] + random.uniform(0.0, pause) + intervals[kind] * self.load.worker
            return last[kind] + pause

        try:
            while True:
                now = loop.time()
                checked = now >= plan[0]
                if checked:
                    if self.shared is None or not self.shared.defers(r):
                        try:
                            await self.check(r)
                        except Exception:  # keep checking whatever happens
                            log.exception("health check of %s crashed", r.name)
                    if r.name not in self._checked:
                        self._checked.add(r.name)
                        if len(self._checked) >= len(self.replicas):
                            self.first_round.set()
                    last[0] = now
                    plan[0] = following(0)
                # together: right after the check, on the connection it left open (a fleet checked less often than
                # the replicas keep idle connections, 5 s in vLLM, opens one connection per round, not two)
                if checked if together else now >= plan[1]:
                    if r.state != "unready":
                        try:
                            self.budget.count()
                            await self.scrape(r)
                        except Exception:
                            log.exception("metrics scrape of %s crashed", r.name)
                    last[1] = self._scraped[r.name] = now
                    plan[1] = plan[0] if together else following(1)
                await self._sleep_until(r.name, min(plan))
        finally:
            if self._plans.get(r.name) is plan:
                del self._plans[r.name]
                self._scraped.pop(r.name, None)

    async def _sleep_until(self, name: str, when: float) -> None:
        """Sleep until ``when`` (the loop's clock), or until :meth:`watch` wakes the replica's loop sooner."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        handle = loop.call_at(when, _settle, woken)
        self._sleeping[name] = woken
        try:
            await woken
        finally:
            handle.cancel()
            if self._sleeping.get(name) is woken:
                del self._sleeping[name]

    async def watch(self) -> None:
        """Keep a suspect replica scraped at the configured interval, however far apart the budget spaces the
        fleet's scrapes: a replica whose requests have waited half of ``health.stall_s`` for an answer gets its
        next scrape (with its check, where they go together) within ``health.metrics_interval_s`` of its last,
        so that one that accepts requests and answers none leaves rotation within about ``stall_s`` and a
        scrape or two on a fleet of any size, as on a small one. Looks every :data:`WATCH_S`; a look over 1,024
        replicas costs about a tenth of a millisecond."""
        h = self.config
        together = h.metrics_interval_s == h.interval_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WATCH_S)
            now, mono = loop.time(), time.monotonic()
            for name, plan in self._plans.items():
                r = self.replicas.get(name)
                if r is None or r.state != "ready" or r.upstream is None \
                        or r.upstream.unanswered_for(mono) < h.stall_s / 2:
                    continue
                soon = max(now, self._scraped.get(name, now) + h.metrics_interval_s)
                if plan[1] <= soon + WATCH_S:
                    continue  # scraped soon enough anyway
                plan[1] = soon
                if together:
                    plan[0] = min(plan[0], soon)
                woken = self._sleeping.get(name)
                if woken is not None:
                    _settle(woken)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
