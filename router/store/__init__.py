"""The shared state's home: one client (a Redis, or a Redis Cluster) and the name of every key.

The prefix index, sessions, membership, KV-event leases and the shared load picture all keep
their state through one :class:`Store` per router process; none of them opens a connection or
spells a key of its own. Whoever makes the store closes it, after the components that use it.
"""

from __future__ import annotations

from .client import Redis
from .layout import Layout
from .lua import LUA_HASH_CHANGES, LUA_PRESENT
from .resp import ConnectionLost, RedisError, ReplyError

__all__ = ["Store", "Redis", "Layout", "LUA_HASH_CHANGES", "LUA_PRESENT", "ConnectionLost", "RedisError", "ReplyError"]


class Store:
    def __init__(self, url: str, namespace: str = "kvroute", connect_timeout: float = 1.0) -> None:
        self.client = Redis(url, connect_timeout=connect_timeout)
        self.keys = Layout(namespace)

    async def close(self) -> None:
        await self.client.close()
