"""The one owner of per-replica load on this host: requests in flight, pending prefill, peaks,
and whether an operator drained the replica.

A request's ticket takes a slot here when it is routed and gives it back when it ends; its
uncached prompt tokens count as pending prefill until the replica sends the first byte. Filters
and scorers see these figures only through :class:`~router.view.ReplicaView`.

With several worker processes on one host (``kvroute serve --workers N``) the figures live in
memory shared by the workers: a table with one row per worker and one column per replica, in
which each worker writes only its own row and readers sum the rows. Taking a slot checks the
host's total under a lock shared by the workers (held for a few microseconds; a worker that
cannot get it within 2 ms treats the replica as full for now), so N workers never put more than
``max_num_seqs`` requests on a replica between two scrapes. With one worker the table is a
plain list and takes no lock.
"""

from __future__ import annotations

import mmap
import multiprocessing
from typing import Any, Sequence

from .metrics import Metrics

_INFLIGHT, _PENDING, _PEAK = 0, 1, 2
_FIELDS = 3
_LOCK_WAIT_S = 0.002
SESSION_SLOT_BYTES = 24  # 16-byte session digest, 4-byte replica number (+1; 0 = empty), 4 spare


class HostShare:
    """Memory and a lock shared by the worker processes of one host; made before they fork.

    ``buffer`` holds the load table; ``sessions`` (``session_slots`` entries) the session table
    that :class:`router.sessions.SharedSessions` keeps there when no Redis is configured.
    """

    def __init__(self, workers: int, replicas: int, session_slots: int = 0) -> None:
        self.workers = workers
        self.replicas = max(1, replicas)
        # MAP_SHARED | MAP_ANONYMOUS: the forked workers see the same pages
        self.buffer = mmap.mmap(-1, (workers * _FIELDS + 1) * self.replicas * 8)
        self.session_slots = session_slots
        self.sessions = mmap.mmap(-1, max(1, session_slots) * SESSION_SLOT_BYTES)
        self.lock = multiprocessing.get_context("fork").Lock()


class LoadTable:
    def __init__(self, names: Sequence[str], metrics: Metrics, share: HostShare | None = None,
                 worker: int = 0) -> None:
        self.names = list(names)
        width = len(self.names) * _FIELDS
        if share is not None:
            if len(self.names) > share.replicas:
                raise ValueError(f"the shared load table has room for {share.replicas} replicas, not {len(names)}")
            width = share.replicas * _FIELDS
            self._cells: Any = memoryview(share.buffer).cast("q")
            self._lock: Any = share.lock
            self.workers = share.workers
        else:
            self._cells = [0] * (width + len(self.names))
            self._lock = None
            self.workers = 1
        self.worker = worker
        # per replica: offset of its cells in this worker's row, and in every row
        self._own = {n: worker * width + i * _FIELDS for i, n in enumerate(self.names)}
        self._rows = {n: tuple(w * width + i * _FIELDS for w in range(self.workers)) for i, n in enumerate(self.names)}
        self._drained = {n: self.workers * width + i for i, n in enumerate(self.names)}
        self._m_inflight = {n: metrics.inflight.labels(n) for n in self.names}
        for n in self.names:
            self._m_inflight[n].set(0)

    # -- slots -------------------------------------------------------------------------------

    def take(self, name: str, limit: int) -> bool:
        """Take a slot on ``name`` unless this host already has ``limit`` requests there."""
        c = self._cells
        i = self._own[name]
        if self._lock is None:
            n = c[i] + 1
            if n > limit:
                return False
            c[i] = n
            if n > c[i + _PEAK]:
                c[i + _PEAK] = n
        else:
            if not self._lock.acquire(True, _LOCK_WAIT_S):
                return False
            try:
                n = sum(c[j] for j in self._rows[name]) + 1
                if n > limit:
                    return False
                c[i] += 1
                if n > c[i + _PEAK]:
                    c[i + _PEAK] = n
            finally:
                self._lock.release()
        self._m_inflight[name].inc()
        return True

    def release(self, name: str) -> None:
        self._cells[self._own[name]] -= 1
        self._m_inflight[name].dec()

    # -- pending prefill ---------------------------------------------------------------------

    def add_pending(self, name: str, tokens: int) -> None:
        self._cells[self._own[name] + _PENDING] += tokens

    # -- reads -------------------------------------------------------------------------------

    def inflight(self, name: str) -> int:
        c = self._cells
        if self.workers == 1:
            return c[self._own[name]]
        return sum(c[j] for j in self._rows[name])

    def figures(self, name: str) -> tuple[bool, int, int]:
        """(drained, in-flight requests, pending prefill tokens) of ``name``, over this host's workers."""
        c = self._cells
        drained = c[self._drained[name]] != 0
        if self.workers == 1:
            i = self._own[name]
            return drained, c[i], c[i + _PENDING]
        rows = self._rows[name]
        return drained, sum(c[j] for j in rows), sum(c[j + _PENDING] for j in rows)

    # -- drained flags -----------------------------------------------------------------------

    def set_drained(self, name: str, drained: bool) -> None:
        self._cells[self._drained[name]] = 1 if drained else 0

    # -- peaks, for telling this host's load from other clients' in a scrape ------------------

    def mark_peak(self, name: str) -> None:
        """Start a new peak window for ``name`` (when a scrape is sent)."""
        i = self._own[name]
        self._cells[i + _PEAK] = self.inflight(name)

    def peak(self, name: str) -> int:
        """The most requests this host had on ``name`` since the window began (an upper bound with
        several workers: each resets only its own row's window)."""
        c = self._cells
        return max(max(c[j + _PEAK] for j in self._rows[name]), self.inflight(name))

    def describe(self, name: str) -> dict[str, Any]:
        drained, inflight, pending = self.figures(name)
        return {"drained": drained, "inflight": inflight, "pending_prefill_tokens": pending}
