"""Capacity and the router queue.

A replica holds at most ``max_num_seqs`` of this router's requests. When every candidate for a
request is full, the request waits here, first in first out, for at most ``queue.timeout_s``;
a freed slot is handed straight to the oldest waiter that replica can serve, so a newcomer can
never take it first. A full queue or a wait that times out answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from . import errors
from .config import QueueConfig
from .events import Event, ReplicaReady
from .metrics import Metrics
from .policy import Decision, NoCandidate, Policy, RouteRequest
from .pool import Replica, ReplicaPool


@dataclass
class _Waiter:
    req: RouteRequest
    future: asyncio.Future[Decision]


class Admission:
    def __init__(self, pool: ReplicaPool, policy: Policy, queue: QueueConfig, metrics: Metrics) -> None:
        self.pool = pool
        self.policy = policy
        self.cfg = queue
        self.metrics = metrics
        self._waiters: deque[_Waiter] = deque()
        self._release_interval = 0.1  # EWMA of seconds between freed slots, for Retry-After
        self._last_release = time.monotonic()
        pool.events.subscribe(self._on_event)

    @property
    def queue_length(self) -> int:
        return len(self._waiters)

    async def admit(self, req: RouteRequest) -> Decision:
        """Choose a replica and take one of its slots, waiting in the queue if all are full.

        Raises :class:`NoCandidate` when no replica could ever serve the request now, and a
        429 :class:`~router.errors.GatewayError` when the wait is refused or too long.
        """
        if not self._waiters:
            try:
                decision = self.policy.choose(req, list(self.pool))
            except NoCandidate as e:
                if e.why != "at_capacity":
                    raise
            else:
                self._take(decision.replica)
                return decision
        else:
            # others are already waiting: only join them if some replica could ever serve this
            try:
                self.policy.candidates(req, list(self.pool))
            except NoCandidate as e:
                if e.why != "at_capacity":
                    raise
        return await self._wait(req)

    def release(self, replica: Replica) -> None:
        """Give a slot back; the oldest waiter this replica can serve takes it over."""
        now = time.monotonic()
        self._release_interval = 0.9 * self._release_interval + 0.1 * (now - self._last_release)
        self._last_release = now
        replica.inflight -= 1
        replica.m_inflight.dec()
        if self._waiters:
            self._hand_off(replica)

    # -- internals -------------------------------------------------------------------------

    def _take(self, replica: Replica) -> None:
        replica.inflight += 1
        if replica.inflight > replica.inflight_peak:
            replica.inflight_peak = replica.inflight
        replica.m_inflight.inc()

    def _fits(self, req: RouteRequest, replica: Replica) -> bool:
        try:
            self.policy.candidates(req, [replica])
        except NoCandidate:
            return False
        return True

    def _hand_off(self, replica: Replica) -> None:
        for w in list(self._waiters):
            if replica.inflight >= replica.slots:
                return
            if w.future.done():
                self._waiters.remove(w)
                continue
            if self._fits(w.req, replica):
                self._waiters.remove(w)
                self._take(replica)
                w.future.set_result(Decision(replica, "queued", 0.0))
        self.metrics.queue_length.set(len(self._waiters))

    def _retry_after(self) -> float:
        return min(60.0, max(1.0, (len(self._waiters) + 1) * self._release_interval))

    async def _wait(self, req: RouteRequest) -> Decision:
        if len(self._waiters) >= self.cfg.max_size:
            self.metrics.queue_rejected.labels("full").inc()
            raise errors.queue_full(self._retry_after(), "full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(req, loop.create_future())
        self._waiters.append(waiter)
        self.metrics.queue_length.set(len(self._waiters))
        started = time.monotonic()
        try:
            return await asyncio.wait_for(waiter.future, self.cfg.timeout_s)
        except asyncio.TimeoutError:
            self.metrics.queue_rejected.labels("timeout").inc()
            raise errors.queue_full(self._retry_after(), "timeout") from None
        except asyncio.CancelledError:
            # the client left; a slot handed over in the meantime goes back
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result().replica)
            raise
        finally:
            self.metrics.queue_wait.observe(time.monotonic() - started)
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self.metrics.queue_length.set(len(self._waiters))

    def _on_event(self, event: Event) -> None:
        # a replica that became ready or was undrained may take queued requests at once
        if isinstance(event, ReplicaReady) and self._waiters:
            replica = self.pool.get(event.replica)
            if replica is not None:
                self._hand_off(replica)
