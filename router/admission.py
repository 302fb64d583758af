"""Capacity and the router queue.

A replica holds at most ``max_num_seqs`` of this host's requests (the load table checks it when a
slot is taken). When every candidate for a request is full, the request waits here, first in
first out, for at most ``queue.timeout_s``; a freed slot is handed straight to the oldest waiter
that replica can serve, so a newcomer can never take it first. With several worker processes,
slots freed by another worker are noticed by polling every few milliseconds while anyone waits.
A full queue or a wait that times out answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from . import errors
from .config import QueueConfig
from .replica_events import Event, EventBus, ReplicaReady
from .load import LoadTable
from .metrics import Metrics
from .policy import NoCandidate, Policy, Scored
from .request import RouteRequest
from .view import ReplicaView

_POLL_S = 0.005  # with several workers: how often waiters look for slots freed by the others


class Admitted(NamedTuple):
    view: ReplicaView
    score: float
    waited_s: float  # seconds in the queue (0 when a slot was free at once)


@dataclass
class _Waiter:
    req: RouteRequest
    future: asyncio.Future[Scored]


class Admission:
    def __init__(self, policy: Policy, load: LoadTable, views: Callable[[Sequence[str] | None], list[ReplicaView]],
                 view_of: Callable[[str], ReplicaView | None], queue: QueueConfig, metrics: Metrics,
                 events: EventBus) -> None:
        self.policy = policy
        self.load = load
        self.views = views
        self.view_of = view_of
        self.cfg = queue
        self.metrics = metrics
        self._waiters: deque[_Waiter] = deque()
        self._release_interval = 0.1  # EWMA of seconds between freed slots, for Retry-After
        self._last_release = time.monotonic()
        self._poller: asyncio.Task[None] | None = None
        events.subscribe(self._on_event)

    @property
    def queue_length(self) -> int:
        return len(self._waiters)

    async def admit(self, req: RouteRequest) -> Admitted:
        """Choose a replica and take one of its slots, waiting in the queue if all are full.

        Raises :class:`NoCandidate` when no replica could ever serve the request now, and a
        429 :class:`~router.errors.GatewayError` when the wait is refused or too long.
        """
        if not self._waiters:
            chosen = self._choose_and_take(req)
            if chosen is not None:
                return Admitted(chosen[0], chosen[1], 0.0)
        else:
            # others are already waiting: only join them if some replica could ever serve this
            try:
                self.policy.candidates(req, self.views(None))
            except NoCandidate as e:
                if e.why != "at_capacity":
                    raise
        started = time.perf_counter()
        view, score = await self._wait(req)
        return Admitted(view, score, time.perf_counter() - started)

    def release(self, name: str) -> None:
        """Give a slot back; the oldest waiter this replica can serve takes it over."""
        now = time.monotonic()
        self._release_interval = 0.9 * self._release_interval + 0.1 * (now - self._last_release)
        self._last_release = now
        self.load.release(name)
        if self._waiters:
            self._hand_off(name)

    # -- internals -------------------------------------------------------------------------

    def _choose_and_take(self, req: RouteRequest) -> Scored | None:
        """The policy's pick with its slot taken, or None if every candidate is full."""
        few = req.candidates is not None  # the few replicas a decision on a large fleet weighs
        views = self.views(req.candidates)
        raced = False
        while True:
            try:
                view, score = self.policy.choose(req, views)
            except NoCandidate as e:
                if few:  # none of the few can take it: weigh them all
                    few, raced = False, False
                    views = self.views(None)
                    continue
                if e.why != "at_capacity" and not raced:
                    raise
                return None  # all full (or the one that was not is full now): wait for a slot
            if self.load.take(view.name, view.max_num_seqs):
                return view, score
            # another worker took the last slot since the view was made: try the others
            raced = True
            views = [v for v in views if v.name != view.name]
            if not views:
                return None

    def _fits(self, req: RouteRequest, view: ReplicaView) -> bool:
        try:
            self.policy.candidates(req, [view])
        except NoCandidate:
            return False
        return True

    def _hand_off(self, name: str) -> None:
        for w in list(self._waiters):
            view = self.view_of(name)
            if view is None or view.inflight >= view.max_num_seqs:
                break
            if w.future.done():
                self._waiters.remove(w)
                continue
            if self._fits(w.req, view):
                if not self.load.take(name, view.max_num_seqs):
                    break
                self._waiters.remove(w)
                w.future.set_result((view, 0.0))
        self.metrics.queue_length.set(len(self._waiters))

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(_POLL_S)
            for view in self.views(None):
                if self._waiters:
                    self._hand_off(view.name)
        self._poller = None

    def _retry_after(self) -> float:
        return min(60.0, max(1.0, (len(self._waiters) + 1) * self._release_interval))

    async def _wait(self, req: RouteRequest) -> Scored:
        if len(self._waiters) >= self.cfg.max_size:
            self.metrics.queue_rejected.labels("full").inc()
            raise errors.queue_full(self._retry_after(), "full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(req, loop.create_future())
        self._waiters.append(waiter)
        self.metrics.queue_length.set(len(self._waiters))
        if self.load.workers > 1 and self._poller is None:
            self._poller = loop.create_task(self._poll())
        started = time.monotonic()
        try:
            return await asyncio.wait_for(waiter.future, self.cfg.timeout_s)
        except asyncio.TimeoutError:
            self.metrics.queue_rejected.labels("timeout").inc()
            raise errors.queue_full(self._retry_after(), "timeout") from None
        except asyncio.CancelledError:
            # the client left; a slot handed over in the meantime goes back
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result()[0].name)
            raise
        finally:
            self.metrics.queue_wait.observe(time.monotonic() - started)
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self.metrics.queue_length.set(len(self._waiters))

    def _on_event(self, event: Event) -> None:
        # a replica that became ready or was undrained may take queued requests at once
        if isinstance(event, ReplicaReady) and self._waiters:
            self._hand_off(event.replica)
