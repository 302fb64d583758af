"""What a replica's ``/metrics`` tells: its engine's load, its KV cache's size and usage, its restarts, its
prefill speed and whether it still makes progress.

A change of the replica's process start time (or a counter going backwards) means it restarted with an
empty KV cache: :class:`~router.replica_events.ReplicaRestarted` is published. The engine's running and waiting
requests less this router's own (and, with a shared load picture, the other routers') are load from
elsewhere: ``external_load``, which routing counts like its own.
"""

from __future__ import annotations

import logging
import time

from ..replica_events import EventBus, ReplicaRestarted
from ..load import LoadTable
from ..metrics import Metrics
from ..shared_load import SharedLoad
from ..upstream import UpstreamError
from .control import fetch
from .health import Health
from .learning import PrefillLearning
from .record import Replica
from .stats import ReplicaStats, parse_metrics

log = logging.getLogger("kvroute.pool")


class Scraper:
    def __init__(self, timeout_s: float, instance: str | None, load: LoadTable, shared: SharedLoad | None,
                 metrics: Metrics, events: EventBus, health: Health, prefill: PrefillLearning) -> None:
        self.timeout_s = timeout_s
        self.instance = instance
        self.load = load
        self.shared = shared
        self.metrics = metrics
        self.events = events
        self.health = health
        self.prefill = prefill

    async def scrape(self, r: Replica) -> None:
        """One scrape of /metrics: engine load, KV usage and size, restarts, prefill figures, stalls."""
        self.load.mark_peak(r.name)
        shared = self.shared
        if shared is not None:
            shared.mark_peak(r.name)
        try:
            try:
                status, body = await fetch(r, "/metrics", self.timeout_s, self.instance)
            except (UpstreamError, TimeoutError):
                return  # health checks own the verdict on reachability
            if status != 200:
                return
            # The engine's count includes this router's requests and the other routers'. Any of them may have
            # started or ended while the scrape was under way, and the others' are known a round late: what is
            # left after the most there were meanwhile is load from other clients (direct traffic).
            others = await shared.peak(r.name) if shared is not None else 0
        finally:
            if shared is not None:
                shared.end_peak(r.name)
        stats = parse_metrics(body.decode("utf-8", "replace"))
        prev = r.stats
        restarted = prev is not None and restarted_between(prev, stats)
        if restarted:
            assert prev is not None
            r.restarts += 1
            self.metrics.replica_restarts.labels(r.name).inc()
            log.warning("replica %s restarted (its KV cache is empty)", r.name, extra={"replica": r.name})
            self.events.publish(ReplicaRestarted(r.name, prev.start_time, stats.start_time))
        self.prefill.scraped(r, stats, restarted)
        r.stats = stats
        r.stats_at = time.time()
        self.health.judge_stall(r, stats)
        r.external_load = max(0.0, stats.running + stats.waiting - self.load.peak(r.name) - others)
        r.view = r.make_view()
        self.metrics.replica_engine_load.labels(r.name).set(stats.running + stats.waiting)
        self.metrics.replica_kv_usage.labels(r.name).set(stats.kv_usage)


def restarted_between(prev: ReplicaStats, cur: ReplicaStats) -> bool:
    """Whether the replica's process is a new one since ``prev`` (its KV cache is empty)."""
    if prev.start_time is not None and cur.start_time is not None and cur.start_time != prev.start_time:
        return True
    return cur.prefix_queries < prev.prefix_queries  # a counter only goes back when the process is new
