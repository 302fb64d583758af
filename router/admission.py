"""Capacity and the router queue.

A replica holds at most ``max_num_seqs`` requests of this host's and the other routers' on the shared load
picture (the load table checks this host's share when a slot is taken). When every candidate for a request is full, the request waits here for at most
``queue.timeout_s``; a freed slot is handed straight to the first waiter in line that replica can
serve, so a newcomer can never take it first. With several worker processes, slots freed by another
worker are noticed by polling every few milliseconds while anyone waits.

The line is ordered by priority class (:data:`router.config.tenants.CLASSES`: every interactive request
before any standard one, every standard before any batch), then, among the tenants of a class, by the tokens
each was served lately over its weight (fleet-wide where routers share a load picture: router.tenants), then
by arrival. A freed slot goes to the tenant furthest below its share: tenants that keep the queue full are so
served tokens in the ratio of their weights, whichever routers their requests come through, and a tenant of
long prompts cannot crowd out one of short ones.

Slots are kept for the more urgent classes: where a class has had requests in flight in the last
``queue.reserve_window_s``, a less urgent request takes a slot only while more stay free than that class may
still need (its most in flight in that window, less what it has in flight now) plus ``queue.reserve_margin``
of that peak, and never more than ``queue.reserve_max_share`` of the slots. A flood of batch requests so leaves room for the interactive requests that come while it lasts,
instead of making each wait for a slot to free; with no urgent traffic, nothing is kept.

A full queue makes room for a request that ranks before its last one by refusing that one instead (so batch
traffic is shed before interactive); otherwise, and for a wait that times out, it answers 429 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

from . import errors
from .config import QueueConfig
from .config.tenants import CLASSES
from .replica_events import Event, EventBus, ReplicaReady
from .load import LoadTable
from .metrics import Metrics
from .policy import NoCandidate, Policy, Scored, predict
from .request import RouteRequest
from .view import ReplicaView

_POLL_S = 0.005  # with several workers: how often waiters look for slots freed by the others
_DEFER_S = 0.05  # a slot left to another router's waiter is taken back after this long if none took it


class Admitted(NamedTuple):
    view: ReplicaView
    score: float
    waited_s: float  # seconds in the queue (0 when a slot was free at once)


class FairShare(Protocol):
    """What the tenants were served lately (router.tenants owns it)."""

    def usage(self, tenant: str) -> float:
        """Tokens ``tenant`` was served lately, fleet-wide."""

    def charge(self, tenant: str, tokens: float) -> None:
        """``tenant`` was given a slot for a request of ``tokens``."""

    def waiting(self, tenant: str, n: int) -> None:
        """``n`` requests of ``tenant`` wait in this router's queue now."""

    def waiting_elsewhere(self) -> list[tuple[int, str, float]]:
        """(class rank, tenant, weight) of the tenants waiting in other routers' queues."""


@dataclass
class _Waiter:
    req: RouteRequest
    future: asyncio.Future[Scored]
    arrival: int


def _cost(req: RouteRequest) -> int:
    """What a request costs in its tenant's share: its prompt and the completion tokens it may use."""
    return req.prompt_estimate() + req.output_tokens


class Admission:
    def __init__(self, policy: Policy, load: LoadTable, views: Callable[[Sequence[str] | None], list[ReplicaView]],
                 view_of: Callable[[str], ReplicaView | None], queue: QueueConfig, metrics: Metrics,
                 events: EventBus, share: FairShare | None = None) -> None:
        self.policy = policy
        self.load = load
        self.views = views
        self.view_of = view_of
        self.cfg = queue
        self.metrics = metrics
        self.share = share
        # the waiters: per (class rank, tenant), in arrival order
        self._groups: dict[tuple[int, str], deque[_Waiter]] = {}
        self._size = 0
        self._arrivals = itertools.count()
        # this router's requests in flight per class, and the most in the last reserve_window_s (about)
        self._running = [0] * len(CLASSES)
        self._peak = [0] * len(CLASSES)
        self._peak_at = [0.0] * len(CLASSES)
        self._release_interval = 0.1  # EWMA of seconds between freed slots, for Retry-After
        self._last_release = time.monotonic()
        self._poller: asyncio.Task[None] | None = None
        events.subscribe(self._on_event)

    @property
    def queue_length(self) -> int:
        return self._size

    async def admit(self, req: RouteRequest) -> Admitted:
        """Choose a replica and take one of its slots, waiting in the queue if all are full.

        Raises :class:`NoCandidate` when no replica could ever serve the request now, and a
        429 :class:`~router.errors.GatewayError` when the wait is refused or too long.
        """
        if not self._size or self._ahead_of_all(req):  # nobody waits ahead of it
            chosen = self._choose_and_take(req)
            if chosen is not None:
                return Admitted(chosen[0], chosen[1], 0.0)
        if self._size:
            # others are already waiting: only join them if some replica could ever serve this
            try:
                self.policy.candidates(req, self.views(None))
            except NoCandidate as e:
                if e.why != "at_capacity":
                    raise
        started = time.perf_counter()
        view, score = await self._wait(req)
        return Admitted(view, score, time.perf_counter() - started)

    def release(self, name: str, rank: int) -> None:
        """Give back a slot a request of class ``rank`` held; the first waiter in line this replica can serve
        takes it over."""
        self._running[rank] = max(0, self._running[rank] - 1)
        now = time.monotonic()
        self._release_interval = 0.9 * self._release_interval + 0.1 * (now - self._last_release)
        self._last_release = now
        self._give_back(name)

    def move(self, req: RouteRequest, name: str) -> ReplicaView | None:
        """Choose again for ``req``, which holds a slot on ``name`` (the other routers' figures there changed since
        it was chosen): the replica the policy prefers now, its slot taken and the one on ``name`` given back; None
        where that is ``name`` still (or its slot is gone since)."""
        try:
            view, _ = self.policy.choose(req, self.views(req.candidates))
        except NoCandidate:
            return None
        if view.name == name or not self.load.take(view.name, view.max_num_seqs - view.routers_inflight):
            return None
        self._give_back(name)
        return view

    def _give_back(self, name: str) -> None:
        """A slot on ``name`` is free: the first waiter in line this replica can serve takes it over."""
        self.load.release(name)
        if self._size:
            if self._elsewhere_first():
                # a tenant further below its share waits at another router: it sees the slot free on its next
                # round (router.shared_load) and takes it; if it does not, the slot is handed off here
                asyncio.get_running_loop().call_later(_DEFER_S, self._hand_off, name)
            else:
                self._hand_off(name)

    def slots_freed(self, names: list[str]) -> None:
        """The other routers freed slots on ``names`` (router.shared_load): the first waiters in line take them."""
        for name in names:
            if not self._size:
                break
            self._hand_off(name)

    # -- internals -------------------------------------------------------------------------

    def _choose_and_take(self, req: RouteRequest) -> Scored | None:
        """The policy's pick with its slot taken, or None if every candidate is full (or the free slots are kept
        for more urgent classes)."""
        if req.rank and not self._room(req):
            return None
        chosen = self._pick_and_take(req)
        if chosen is not None:
            self._started(req)
        return chosen

    def _started(self, req: RouteRequest) -> None:
        rank = req.rank
        n = self._running[rank] = self._running[rank] + 1
        if n >= self._peak[rank]:
            self._peak[rank], self._peak_at[rank] = n, time.monotonic()
        if self.share is not None and req.phase != "decode":  # a split request is charged once, for its prefill
            self.share.charge(req.tenant, _cost(req))

    def _reserve(self, rank: int) -> int:
        """Free slots a request of class ``rank`` must leave for the more urgent classes."""
        now = time.monotonic()
        peak = running = 0
        for r in range(rank):
            if now - self._peak_at[r] > self.cfg.reserve_window_s:  # its peak is old: start from what runs now
                self._peak[r], self._peak_at[r] = self._running[r], now
            peak += self._peak[r]
            running += self._running[r]
        if not peak:
            return 0
        return max(0, peak - running) + math.ceil(peak * self.cfg.reserve_margin)

    def _room(self, req: RouteRequest) -> bool:
        """Whether a request of its class may take a free slot: more stay free than are kept for the more
        urgent classes (counted only where some are kept: it weighs every candidate)."""
        reserve = self._reserve(req.rank)
        if not reserve:
            return True
        try:
            views = self.policy.candidates(req, self.views(None))
        except NoCandidate:
            return True  # none free: the slot-taking path says so
        # never more than reserve_max_share of the slots: on a small fleet a peak of urgent requests would keep
        # every slot from the other classes for a whole reserve_window_s
        reserve = min(reserve, int(self.cfg.reserve_max_share * sum(v.max_num_seqs for v in views)))
        return sum(v.free_slots for v in views) > reserve

    def _pick_and_take(self, req: RouteRequest) -> Scored | None:
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
            if self.load.take(view.name, view.max_num_seqs - view.routers_inflight):
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
        """Free slots on ``name`` to the first waiters in line it can serve."""
        while self._size:
            view = self.view_of(name)
            if view is None or view.free_slots <= 0:
                break
            handed = False
            for rank, tenant in self._line():
                group = self._groups[(rank, tenant)]
                if rank and not self._room(group[0].req):
                    self.metrics.queue_length.set(self._size)
                    return  # this class, and every one after it, leave the free slots to more urgent classes
                for w in group:
                    if w.future.done() or not self._fits(w.req, view):
                        continue
                    if not self.load.take(name, view.max_num_seqs - view.routers_inflight):
                        self.metrics.queue_length.set(self._size)
                        return
                    self._started(w.req)
                    self._remove(w)
                    w.future.set_result((view, 0.0))
                    handed = True
                    break
                if handed:
                    break
            if not handed:
                break
        self.metrics.queue_length.set(self._size)

    def _key(self, rank: int, tenant: str, weight: float) -> tuple[int, float]:
        """A tenant's place among the waiting tenants: its class, then what it was served for its weight."""
        return rank, (self.share.usage(tenant) / weight if self.share is not None else 0.0)

    def _line(self) -> list[tuple[int, str]]:
        """The waiting (class rank, tenant) groups in line order."""
        keyed = []
        for (rank, tenant), group in self._groups.items():
            head = group[0]
            keyed.append((self._key(rank, tenant, head.req.weight), head.arrival, rank, tenant))
        keyed.sort()
        return [(rank, tenant) for _, _, rank, tenant in keyed]

    def _elsewhere_first(self) -> bool:
        """Whether a tenant waiting only at other routers is ahead of every waiter here."""
        if self.share is None:
            return False
        elsewhere = [self._key(rank, tenant, weight) for rank, tenant, weight in self.share.waiting_elsewhere()
                     if (rank, tenant) not in self._groups]
        if not elsewhere:
            return False
        best = min(elsewhere)
        return all(best < self._key(rank, tenant, group[0].req.weight)
                   for (rank, tenant), group in self._groups.items())

    def _ahead_of_all(self, req: RouteRequest) -> bool:
        """Whether ``req`` would be first in line (its class or its tenant's share ahead of every waiter's)."""
        mine = self._key(req.rank, req.tenant, req.weight)
        if (req.rank, req.tenant) in self._groups:
            return False
        return all(mine < self._key(rank, tenant, group[0].req.weight)
                   for (rank, tenant), group in self._groups.items())

    def _remove(self, waiter: _Waiter) -> None:
        key = (waiter.req.rank, waiter.req.tenant)
        group = self._groups.get(key)
        if group is None:
            return
        try:
            group.remove(waiter)
        except ValueError:
            return
        self._size -= 1
        if not group:
            del self._groups[key]
        if self.share is not None:
            self.share.waiting(key[1], len(group))

    def _count(self, req: RouteRequest, outcome: str) -> None:
        self.metrics.child(self.metrics.tenant_requests, req.tenant, CLASSES[req.rank], outcome).inc()

    async def _poll(self) -> None:
        while self._size:
            await asyncio.sleep(_POLL_S)
            for view in self.views(None):
                if self._size:
                    self._hand_off(view.name)
        self._poller = None

    def _retry_after(self) -> float:
        return min(60.0, max(1.0, (self._size + 1) * self._release_interval))

    async def _wait(self, req: RouteRequest) -> Scored:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(req, loop.create_future(), next(self._arrivals))
        if self._size >= self.cfg.max_size:
            line = self._line()
            last = self._groups[line[-1]][-1] if line else None
            if last is None or (last.req.rank, last.req.tenant) == (req.rank, req.tenant) or \
                    self._key(last.req.rank, last.req.tenant, last.req.weight) <= self._key(req.rank, req.tenant,
                                                                                           req.weight):
                self.metrics.queue_rejected.labels("full").inc()
                self._count(req, "queue_full")
                raise errors.queue_full(self._retry_after(), "full")
            # it ranks before the last in line (its class, or its tenant's share): that one makes room
            self._remove(last)
            self.metrics.queue_rejected.labels("shed").inc()
            self._count(last.req, "shed")
            if not last.future.done():
                last.future.set_exception(errors.queue_full(self._retry_after(), "shed"))
        group = self._groups.setdefault((req.rank, req.tenant), deque())
        group.append(waiter)
        self._size += 1
        if self.share is not None:
            self.share.waiting(req.tenant, len(group))
        self.metrics.queue_length.set(self._size)
        if self.load.workers > 1 and self._poller is None:
            self._poller = loop.create_task(self._poll())
        started = time.monotonic()
        limit = self.cfg.timeout_s
        target_left = self._target_left(req)
        try:
            return await asyncio.wait_for(waiter.future, limit if target_left is None else min(limit, target_left))
        except asyncio.TimeoutError:
            if target_left is not None and target_left < limit:  # it could no longer meet its latency target
                raise NoCandidate("slo_unmet") from None
            self.metrics.queue_rejected.labels("timeout").inc()
            self._count(req, "queue_timeout")
            raise errors.queue_full(self._retry_after(), "timeout") from None
        except asyncio.CancelledError:
            # the client left; a slot handed over in the meantime goes back
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result()[0].name, req.rank)
            raise
        finally:
            waited = time.monotonic() - started
            self.metrics.queue_wait.observe(waited)
            self.metrics.child(self.metrics.class_queue_wait, CLASSES[req.rank]).observe(waited)
            self._remove(waiter)
            self.metrics.queue_length.set(self._size)

    def _target_left(self, req: RouteRequest) -> float | None:
        """Seconds ``req`` may wait and still meet its time-to-first-token target on the replica predicted to give
        it soonest (where it has one): past that, waiting is in vain."""
        if req.slo_ttft_s is None or req.phase == "decode":
            return None
        best = predict.soonest(req, self.views(req.candidates)) or 0.0
        return max(0.0, req.arrived + req.slo_ttft_s - time.perf_counter() - best)

    def _on_event(self, event: Event) -> None:
        # a replica that became ready or was undrained may take queued requests at once
        if isinstance(event, ReplicaReady) and self._size:
            self._hand_off(event.replica)
