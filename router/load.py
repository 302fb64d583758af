"""The one owner of per-replica load on this host: requests in flight, pending prefill, peaks,
and whether an operator drained the replica.

A request's ticket takes a slot here when it is routed and gives it back when it ends; its
uncached prompt tokens count as pending prefill until the replica sends the first byte. Filters
and scorers see these figures only through :class:`~router.view.ReplicaView`.

With several worker processes on one host (``kvroute serve --workers N``) the figures live in
memory shared by the workers: a table with one row per worker and one column per replica, in
which each worker writes only its own row and readers sum the rows. The table has room for
``capacity`` replicas: those of the configuration and those added at run time. A replica's column
is found by a digest of its name, written in shared memory when the first worker adds it, so every
worker uses the same column; it is given back when the replica is removed and nothing is in flight
there. Taking a slot checks the
host's total under a lock shared by the workers (held for a few microseconds; a worker that
cannot get it within 2 ms treats the replica as full for now), so N workers never put more than
``max_num_seqs`` requests on a replica between two scrapes. With one worker the table is a
plain list and takes no lock.
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import secrets
from typing import Any, Callable, Sequence

from .metrics import Metrics

_INFLIGHT, _PENDING, _PEAK = 0, 1, 2
_FIELDS = 3
_LOCK_WAIT_S = 0.002
SESSION_SLOT_BYTES = 24  # 16-byte session digest, 4-byte replica number (+1; 0 = empty), 4 spare
_DIGEST = 16  # bytes of a replica name's digest, per column
_FREE = bytes(_DIGEST)


class TableFull(Exception):
    """Every column of the load table is taken (``membership.max_replicas``)."""


def _digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=_DIGEST).digest()


class HostShare:
    """Memory and a lock shared by the worker processes of one host; made before they fork.

    ``buffer`` holds the load table; ``sessions`` (``session_slots`` entries) the session table
    that :class:`router.sessions.SharedSessions` keeps there when no Redis is configured.
    """

    def __init__(self, workers: int, replicas: int, session_slots: int = 0) -> None:
        self.workers = workers
        self.replicas = max(1, replicas)  # columns: configured replicas and room for ones added at run time
        # MAP_SHARED | MAP_ANONYMOUS: the forked workers see the same pages
        self.buffer = mmap.mmap(-1, (workers * _FIELDS + 1) * self.replicas * 8)
        self.columns = mmap.mmap(-1, self.replicas * _DIGEST)  # column -> digest of its replica's name
        self.session_slots = session_slots
        self.sessions = mmap.mmap(-1, max(1, session_slots) * SESSION_SLOT_BYTES)
        self.lock = multiprocessing.get_context("fork").Lock()
        self.host_id = secrets.token_hex(6)  # the workers' common id among router hosts (router.shared_load)


class LoadTable:
    def __init__(self, names: Sequence[str], metrics: Metrics, share: HostShare | None = None,
                 worker: int = 0, capacity: int | None = None) -> None:
        self.metrics = metrics
        self.capacity = share.replicas if share is not None else max(1, capacity or len(names))
        if len(names) > self.capacity:
            raise ValueError(f"the load table has room for {self.capacity} replicas, not {len(names)}")
        self.width = self.capacity * _FIELDS
        if share is not None:
            self._cells: Any = memoryview(share.buffer).cast("q")
            self._columns: Any = share.columns
            self._lock: Any = share.lock
            self.workers = share.workers
        else:
            self._cells = [0] * (self.width + self.capacity)
            self._columns = bytearray(self.capacity * _DIGEST)
            self._lock = None
            self.workers = 1
        self.worker = worker
        self.names: list[str] = []
        self._column: dict[str, int] = {}
        self._by_column: dict[int, str] = {}
        # per replica: offset of its cells in this worker's row, and in every row
        self._own: dict[str, int] = {}
        self._rows: dict[str, tuple[int, ...]] = {}
        self._drained: dict[str, int] = {}
        self._m_inflight: dict[str, Any] = {}
        self._touched: set[str] = set()  # replicas whose figures in this worker's row changed (shared load)
        self.taken = self.released = 0  # slots this process took and gave back, ever (an idle process: equal, still)
        self._on_change: Callable[[], None] | None = None  # told when _touched stops being empty
        for n in names:
            self.add(n)

    # -- columns -----------------------------------------------------------------------------

    def add(self, name: str) -> None:
        """Give ``name`` its column (the one other workers use for it, if they have it already)."""
        if name in self._column:
            return
        col = self._claim(_digest(name))
        self.names.append(name)
        self._column[name] = col
        self._by_column[col] = name
        self._own[name] = self.worker * self.width + col * _FIELDS
        self._rows[name] = tuple(w * self.width + col * _FIELDS for w in range(self.workers))
        self._drained[name] = self.workers * self.width + col
        self._m_inflight[name] = self.metrics.inflight.labels(name)
        self._m_inflight[name].set(self.inflight(name))

    def remove(self, name: str) -> None:
        """Forget ``name``; its column is free again once no worker has a request there."""
        col = self._column.pop(name, None)
        if col is None:
            return
        idle = self.inflight(name) == 0
        self.names.remove(name)
        del self._by_column[col], self._own[name], self._rows[name], self._drained[name], self._m_inflight[name]
        self._touch(name)
        if idle:
            self._locked(lambda: self._free(col))

    def number(self, name: str) -> int | None:
        """A number for ``name`` that every worker of this host shares (its column, from 1)."""
        col = self._column.get(name)
        return None if col is None else col + 1

    def name_of(self, number: int) -> str | None:
        return self._by_column.get(number - 1)

    def _locked(self, fn: Any) -> Any:
        if self._lock is None:
            return fn()
        with self._lock:
            return fn()

    def _claim(self, digest: bytes) -> int:
        def find(cols: Any, what: bytes) -> int:
            """The first column holding ``what`` (a search in C: a table of thousands of columns stays cheap)."""
            pos = cols.find(what)
            while pos != -1 and pos % _DIGEST:
                pos = cols.find(what, pos + 1)
            return -1 if pos == -1 else pos // _DIGEST

        def claim() -> int:
            cols = self._columns
            held = find(cols, digest)
            if held != -1:
                return held
            free = find(cols, _FREE)
            if free == -1:
                raise TableFull(f"no room for another replica: the load table holds {self.capacity} "
                                f"(membership.max_replicas)")
            self._clear(free)
            cols[free * _DIGEST:(free + 1) * _DIGEST] = digest
            return free
        return self._locked(claim)

    def _free(self, col: int) -> None:
        if all(self._cells[w * self.width + col * _FIELDS] == 0 for w in range(self.workers)):
            self._columns[col * _DIGEST:(col + 1) * _DIGEST] = _FREE

    def _clear(self, col: int) -> None:
        for w in range(self.workers):
            for f in range(_FIELDS):
                self._cells[w * self.width + col * _FIELDS + f] = 0
        self._cells[self.workers * self.width + col] = 0

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
        self._touch(name)
        self.taken += 1
        return True

    def release(self, name: str) -> None:
        i = self._own.get(name)
        self.released += 1
        if i is None:  # removed while the request ran (its drain timed out)
            return
        self._cells[i] -= 1
        self._m_inflight[name].dec()
        self._touch(name)

    # -- pending prefill ---------------------------------------------------------------------

    def add_pending(self, name: str, tokens: int) -> None:
        i = self._own.get(name)
        if i is not None:
            self._cells[i + _PENDING] += tokens
            self._touch(name)

    # -- reads -------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._column

    def own_figures(self, name: str) -> tuple[int, int]:
        """(in-flight requests, pending prefill tokens) of ``name`` in this worker's row alone."""
        i = self._own[name]
        return self._cells[i], self._cells[i + _PENDING]

    def _touch(self, name: str) -> None:
        if not self._touched and self._on_change is not None:
            self._on_change()
        self._touched.add(name)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the event loop, without blocking) when a figure of this worker's row changes
        after :meth:`take_touched` took the changes: once per batch, not per change."""
        self._on_change = callback

    def take_touched(self) -> set[str]:
        """The replicas whose figures in this worker's row changed since the last call."""
        touched, self._touched = self._touched, set()
        return touched

    def inflight(self, name: str) -> int:
        c = self._cells
        if self.workers == 1:
            return c[self._own[name]]
        return sum(c[j] for j in self._rows[name])

    def load_of(self, name: str) -> tuple[bool, int, int]:
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
        drained, inflight, pending = self.load_of(name)
        return {"drained": drained, "inflight": inflight, "pending_prefill_tokens": pending}
