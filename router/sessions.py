"""Sessions: which replica served a client's ``x-session-id`` last.

The API hands in a fixed-size digest of the header, never the raw value, so a session costs the
same whatever the client sends. With the memory index, sessions live in this process (the last
``sessions.max_local`` of them); with a Redis index, in Redis too (``{namespace}:s:{digest}``,
expiring after ``sessions.ttl_s``), so the turns of one session stick to one replica across
router instances and workers. A Redis call that fails or is slow falls back to the local map and
never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Protocol

import xxhash

from .background import Background
from .config import IndexConfig, SessionConfig
from .metrics import Metrics

log = logging.getLogger("kvroute.sessions")


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


class RedisSessions:
    def __init__(self, index: IndexConfig, cfg: SessionConfig, metrics: Metrics) -> None:
        import redis.asyncio as aioredis

        self.local = LocalSessions(cfg.max_local)
        self.prefix = f"{index.namespace}:s:"
        self.ttl_ms = max(1, int(cfg.ttl_s * 1000))
        self.timeout_s = index.timeout_s
        self.metrics = metrics
        self.client = aioredis.Redis.from_url(
            index.backend, socket_timeout=max(1.0, index.timeout_s), socket_connect_timeout=max(1.0, index.timeout_s),
            retry_on_timeout=False, health_check_interval=0, max_connections=16)
        self._background = Background()

    async def get(self, session: str) -> str | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                value = await self.client.get(self.prefix + session)
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
            await self.client.set(self.prefix + session, replica, px=self.ttl_ms)
        except Exception as e:
            self.metrics.index_errors.labels("session").inc()
            log.debug("session store in Redis failed (%s)", e.__class__.__name__)

    async def close(self) -> None:
        await self._background.close()
        await self.client.aclose()
        await self.local.close()


def build_sessions(index: IndexConfig, cfg: SessionConfig, metrics: Metrics) -> Sessions:
    if index.backend == "memory":
        return LocalSessions(cfg.max_local)
    return RedisSessions(index, cfg, metrics)
