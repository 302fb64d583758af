"""Sessions: which replica served a client's ``x-session-id`` last.

The API hands in a fixed-size digest of the header, never the raw value, so a session costs the
same whatever the client sends. With the memory index, sessions live in this process (the last
``sessions.max_local`` of them), or, with several workers, in a table in the memory the workers
share (``sessions.max_local`` slots, a session per slot by its digest: a newer session that lands
on a taken slot replaces the older one); with a Redis index, in Redis too
(``{namespace}:s:{digest}``, expiring after ``sessions.ttl_s``), so the turns of one session stick
to one replica across router instances and workers. A Redis call that fails or is slow falls back
to the local map and never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Protocol

import xxhash

from .background import Background
from .config import IndexConfig, SessionConfig
from .store import Store
from .load import SESSION_SLOT_BYTES, HostShare, LoadTable
from .metrics import Metrics

log = logging.getLogger("kvroute.sessions")

_LOCK_WAIT_S = 0.002


def session_digest(raw: bytes) -> str:
    """The key a session is stored under: 32 hex digits, whatever the header's length."""
    return xxhash.xxh3_128_hexdigest(raw)


class Sessions(Protocol):
    async def get(self, session: str) -> str | None:
        """The replica that served ``session`` last, if known."""
        ...

    def remember(self, session: str, replica: str) -> None:
        """``replica`` served ``session`` (never waits)."""
        ...

    async def close(self) -> None:
        ...


class LocalSessions:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self._map: OrderedDict[str, str] = OrderedDict()
        self._max = max_sessions

    async def get(self, session: str) -> str | None:
        return self._map.get(session)

    def remember(self, session: str, replica: str) -> None:
        self._map[session] = replica
        self._map.move_to_end(session)
        if len(self._map) > self._max:
            self._map.popitem(last=False)

    async def close(self) -> None:
        self._map.clear()


class SharedSessions:
    """Sessions in the memory the workers of one host share (no Redis configured)."""

    def __init__(self, share: HostShare, load: LoadTable) -> None:
        self._buf = share.sessions
        self._slots = share.session_slots
        self._lock = share.lock
        self._load = load  # replica <-> number, the same in every worker

    def _slot(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "little") % self._slots * SESSION_SLOT_BYTES

    async def get(self, session: str) -> str | None:
        digest = bytes.fromhex(session)
        at = self._slot(digest)
        if not self._lock.acquire(True, _LOCK_WAIT_S):
            return None  # another worker holds the lock (descheduled): route without the session this once
        try:
            if self._buf[at:at + 16] != digest:
                return None
            number = int.from_bytes(self._buf[at + 16:at + 20], "little")
        finally:
            self._lock.release()
        return self._load.name_of(number) if number > 0 else None

    def remember(self, session: str, replica: str) -> None:
        number = self._load.number(replica)
        if number is None:
            return
        digest = bytes.fromhex(session)
        at = self._slot(digest)
        if not self._lock.acquire(True, _LOCK_WAIT_S):
            return
        try:
            self._buf[at:at + 20] = digest + number.to_bytes(4, "little")
        finally:
            self._lock.release()

    async def close(self) -> None:
        pass


class RedisSessions:
    def __init__(self, store: Store, index: IndexConfig, cfg: SessionConfig, metrics: Metrics) -> None:
        self.local = LocalSessions(cfg.max_local)
        self.keys = store.keys
        self.ttl_ms = max(1, int(cfg.ttl_s * 1000))
        self.timeout_s = index.timeout_s
        self.metrics = metrics
        self.client = store.client
        self._store_timeout_s = index.background_timeout_s
        self._background = Background()

    async def get(self, session: str) -> str | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                value = await self.client.execute("GET", self.keys.session(session))
            return value.decode() if value is not None else None
        except Exception as e:  # slow or down: this router's own memory answers
            self.metrics.index_errors.labels("session").inc()
            log.debug("session lookup in Redis failed (%s)", e.__class__.__name__)
            return await self.local.get(session)

    def remember(self, session: str, replica: str) -> None:
        self.local.remember(session, replica)
        self._background.spawn(self._store(session, replica))

    async def _store(self, session: str, replica: str) -> None:
        try:
            async with asyncio.timeout(self._store_timeout_s):
                await self.client.execute("SET", self.keys.session(session), replica, "PX", self.ttl_ms)
        except Exception as e:
            self.metrics.index_errors.labels("session").inc()
            log.debug("session store in Redis failed (%s)", e.__class__.__name__)

    async def close(self) -> None:
        await self._background.close()
        await self.local.close()


def build_sessions(index: IndexConfig, cfg: SessionConfig, metrics: Metrics, share: HostShare | None = None,
                   load: LoadTable | None = None, store: Store | None = None) -> Sessions:
    if store is not None:
        return RedisSessions(store, index, cfg, metrics)
    if share is not None and share.workers > 1 and share.session_slots and load is not None:
        return SharedSessions(share, load)
    return LocalSessions(cfg.max_local)
