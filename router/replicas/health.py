"""A replica's state: starting, ready, unready; the verdicts that move it.

- **starting**: added and not yet answering. A replica that never answered is warming up (Gaudi compiles
  its graphs for minutes before it listens); it fails to start only after ``health.startup_timeout_s``.
- **ready** at its first good health check; **unready** after ``health.fail_threshold`` failed checks in a
  row (at once when the connection is refused).
- **back** from unready after ``health.rise_threshold`` good checks in a row.
- **unready on another router's word**: with shared checks (:mod:`.shared_health`) a replica whose checks
  another router owns goes out when that router publishes it unready, and comes back when it publishes it ready.
- **ejected** (unready for ``health.eject_s``, doubling when it happens again soon, whatever its ``/health``
  answers): after ``health.eject_after`` proxied requests in a row failed on it, or when it accepts requests
  and answers none for ``health.stall_s`` while its engine makes no progress (a stall).

Every change rebuilds the replica's view, sets ``kvroute_replica_ready`` and publishes
:class:`~router.replica_events.ReplicaReady` or :class:`~router.replica_events.ReplicaUnready`.
"""

from __future__ import annotations

import logging
import time

from ..config import HealthConfig
from ..replica_events import EventBus, ReplicaReady, ReplicaUnready
from ..metrics import Metrics
from ..upstream import Stalled
from .record import Replica
from .stats import ReplicaStats

log = logging.getLogger("kvroute.pool")


class Health:
    """The verdicts on every replica of a pool, from its health checks, its requests and its metrics."""

    def __init__(self, config: HealthConfig, metrics: Metrics, events: EventBus) -> None:
        self.config = config
        self.metrics = metrics
        self.events = events

    def mark_failure(self, r: Replica, reason: str, immediate: bool = False) -> None:
        """A failed health check, or a request whose replica refused it (``immediate``: a failure that cannot be a
        blip, such as a refused connection)."""
        r.successes = 0
        r.fails += 1
        r.last_error = reason
        if r.state == "starting":
            waited = time.monotonic() - r.added_at
            if waited >= self.config.startup_timeout_s:
                self._failed_to_start(r, reason, waited)
            return
        if r.state != "ready" or (not immediate and r.fails < self.config.fail_threshold):
            return
        log.warning("replica %s is unready: %s", r.name, reason, extra={"replica": r.name})
        self._take_out(r, reason)

    def mark_success(self, r: Replica) -> None:
        if r.state == "unready" and time.monotonic() < r.ejected_until:
            return  # ejected: /health answering does not bring it back before its time
        r.fails = 0
        r.successes += 1
        if r.state == "unready" and r.successes < self.config.rise_threshold:
            return  # on its way back: last_error still says why it went out, until it is in rotation again
        r.last_error = None
        if r.state != "ready":
            self._bring_in(r)

    def adopt(self, r: Replica, ready: bool, why: str = "") -> None:
        """The verdict of the router that owns ``r``'s checks (:mod:`.shared_health`), taken as this router's own:
        out of rotation for ``why`` (``ready`` false), or back where it went out on that router's word only."""
        if not ready:
            if r.state == "ready":
                log.warning("replica %s is unready on the checks of the router that owns them: %s", r.name, why,
                            extra={"replica": r.name})
                r.successes = 0
                r.last_error = f"unready on the checks of another router: {why}"
                self._take_out(r, r.last_error)
                r.adopted = True
        elif r.adopted and r.state == "unready":
            r.fails = r.successes = 0
            r.last_error = None
            self._bring_in(r)

    def request_outcome(self, r: Replica, failed: bool, why: str = "") -> None:
        """A proxied request's end on ``r`` (passive outlier detection): ``health.eject_after`` failures in a
        row take it out of rotation for ``health.eject_s`` (doubling if it happens again), even while its
        /health answers 200 (a replica that breaks every stream, or accepts and never answers)."""
        if not failed:
            r.request_failures = 0
            if r.ready and r.ejections and time.monotonic() > r.ejected_until + self.config.eject_s:
                r.ejections = 0  # well for a while: the next ejection starts short again
            return
        r.request_failures += 1
        if r.request_failures < self.config.eject_after or r.state != "ready":
            return
        self._eject(r, f"{self.config.eject_after} requests in a row failed (last: {why})")

    def judge_stall(self, r: Replica, stats: ReplicaStats) -> None:
        """A replica that accepts requests and answers none: none of the requests waiting on it answered for
        ``health.stall_s``, and its engine counted no new prompt or output token meanwhile (a long generation
        keeps counting). It goes out like an ejected replica, and the requests waiting on it go elsewhere."""
        now = time.monotonic()
        moved = stats.prompt_tokens + stats.generation_tokens
        if moved != r.progress:
            r.progress, r.progress_at = moved, now
            return
        if r.state != "ready" or r.upstream is None or now - r.progress_at < self.config.stall_s:
            return
        waited = r.upstream.unanswered_for(now)
        if waited < self.config.stall_s:
            return
        self._eject(r, f"stalled: answered none of its requests for {waited:.0f} s and its engine made no progress")
        moved_on = r.upstream.abort_unanswered(Stalled(f"replica {r.name} stalled"))
        log.info("replica %s: %d waiting request(s) sent on to other replicas", r.name, moved_on,
                 extra={"replica": r.name})

    def _failed_to_start(self, r: Replica, reason: str, waited: float) -> None:
        r.failed_to_start = f"did not become ready within {self.config.startup_timeout_s:g} s (last: {reason})"
        log.warning("replica %s failed to start: not ready %.0f s after it was added (health.startup_timeout_s); "
                    "last check: %s", r.name, waited, reason, extra={"replica": r.name})
        self._take_out(r, r.failed_to_start)

    def _eject(self, r: Replica, why: str) -> None:
        """Out of rotation for ``health.eject_s``, doubled each time it goes out again soon after (at most ten
        times that), however its /health answers; ``why`` goes to ``last_error`` and the log."""
        backoff = min(self.config.eject_s * 2 ** r.ejections, 10 * self.config.eject_s)
        r.ejections += 1
        r.ejected_until = time.monotonic() + backoff
        r.request_failures = 0
        r.successes = 0
        r.last_error = f"ejected for {backoff:g} s: {why}"
        self.metrics.replica_ejections.labels(r.name).inc()
        log.warning("replica %s taken out of rotation: %s", r.name, r.last_error, extra={"replica": r.name})
        self._take_out(r, r.last_error)

    def _bring_in(self, r: Replica) -> None:
        """``r`` is ready now (a replica seen down and back may be a new process: its /metrics start time tells)."""
        r.state = "ready"
        r.adopted = False
        r.failed_to_start = None
        r.view = r.make_view()
        r.m_ready.set(1)
        log.info("replica %s is ready (models: %s)", r.name, ", ".join(sorted(r.models)) or "-",
                 extra={"replica": r.name})
        self.events.publish(ReplicaReady(r.name))

    def _take_out(self, r: Replica, reason: str) -> None:
        """``r`` is unready now (on this router's own evidence): routing stops choosing it, and subscribers hear
        why."""
        r.state = "unready"
        r.adopted = False
        r.view = r.make_view()
        r.m_ready.set(0)
        self.events.publish(ReplicaUnready(r.name, reason))
