"""One consumer per replica for every router on a shared (Redis) index.

A router consumes a replica's events only while it holds the replica's lease: a Redis key naming
it, set only if absent and expiring after ``kv_events.lease_s`` unless renewed (every third of
that). With each applied batch the holder stores, in the same Redis round trip and only while it
still holds the lease, the batch's sequence number and the changes to its map from the replica's
block hashes to the router's keys. When it stops (killed, cut off), the lease expires and another
router takes it within two and a half lease periods, loads the map and replays from the next
sequence number: no batch is lost as long as the replica's replay buffer still holds it, and
applying a batch twice changes nothing.

The leases are shared out: each router says every lease period that it takes part
(``NS:{NS:events}:routers``), takes a free lease only while it holds fewer than its fair share (the
replicas with events over the routers taking part, rounded up), or once it has been free for half a
lease period, and hands on, at their next renewal, the leases it holds beyond that share. So the
first router up does not keep every replica's events when others join.

Keys (one hash tag per replica, so one slot in Redis Cluster): ``NS:events:{REPLICA}:lease``
(holder id), ``...:seq`` (rank -> last applied sequence number), ``...:map:RANK`` (block hash ->
entry, msgpack).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from typing import Any, Iterable

import msgspec

from ..store import LUA_HASH_CHANGES, LUA_PRESENT, Store

# Renew: only the holder extends the lease. KEYS[1] lease; ARGV[1] holder id, ARGV[2] lease ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# Save one applied batch: KEYS lease, seq, map; ARGV holder, rank, seq, count of entries n, then n
# (field, value) pairs, then the fields to delete. Nothing is written by a router that lost the lease.
_SAVE = LUA_HASH_CHANGES + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
hash_changes(KEYS[3], tonumber(ARGV[4]), 5)
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Say this router takes part, forget routers that stopped saying so, count them. KEYS[1] the routers' sorted
# set; ARGV now (ms), time to live (ms), holder id.
_PRESENT = LUA_PRESENT + """
present(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3])
return redis.call('ZCARD', KEYS[1])
"""

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def router_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Lease:
    def __init__(self, store: Store, lease_s: float, holder: str | None = None) -> None:
        self.client = client = store.client
        self.keys = store.keys
        self.ms = max(1, int(lease_s * 1000))
        self.holder = holder or router_id()
        self._renew = client.script(_RENEW)
        self._save = client.script(_SAVE)
        self._release = client.script(_RELEASE)
        self._present = client.script(_PRESENT)
        self._held: set[str] = set()
        self.lease_s = lease_s
        self._routers = 1  # routers taking part in the leases, as last counted
        self._leased: set[str] = set()  # replicas whose events go through a lease (for the fair share)

    def _key(self, replica: str, what: str) -> str:
        return self.keys.lease(replica, what)

    async def acquire(self, replica: str) -> bool:
        got = await self.client.execute("SET", self._key(replica, "lease"), self.holder, "NX", "PX", self.ms)
        if got is not None:
            self._held.add(replica)
            return True
        return False

    async def renew(self, replica: str) -> bool:
        ok = await self.client.evalsha(self._renew, [self._key(replica, "lease")], [self.holder, self.ms]) == 1
        if not ok:
            self._held.discard(replica)
        return ok

    async def holder_of(self, replica: str) -> str | None:
        got = await self.client.execute("GET", self._key(replica, "lease"))
        return got.decode() if isinstance(got, bytes) else got

    async def positions(self, replica: str) -> dict[int, tuple[int, float]]:
        """Rank -> (sequence number, timestamp) of the last batch the holders applied."""
        raw = await self.client.execute("HGETALL", self._key(replica, "seq"))
        out = {}
        for i in range(0, len(raw or ()), 2):
            seq, _, ts = raw[i + 1].decode().partition(":")
            out[int(raw[i])] = (int(seq), float(ts or 0))
        return out

    async def load_map(self, replica: str, rank: int) -> list[tuple[Any, list[Any]]]:
        """The stored map of one source: (block hash, [model, key, parent, mask]) pairs."""
        raw = await self.client.execute("HGETALL", self._key(replica, f"map:{rank}"))
        return [(_decode(raw[i]), _decode(raw[i + 1])) for i in range(0, len(raw or ()), 2)]

    async def save(self, replica: str, rank: int, seq: int, ts: float, changed: Iterable[tuple[Any, list[Any]]],
                   gone: Iterable[Any]) -> bool:
        """Store an applied batch's position and map changes; False if this router no longer holds the lease."""
        pairs: list[bytes] = []
        for h, entry in changed:
            pairs += (_encode(h), _encode(entry))
        args: list[Any] = [self.holder, rank, f"{seq}:{ts!r}", len(pairs) // 2, *pairs, *(_encode(h) for h in gone)]
        keys = [self._key(replica, "lease"), self._key(replica, "seq"), self._key(replica, f"map:{rank}")]
        return await self.client.evalsha(self._save, keys, args) == 1

    async def forget(self, replica: str, ranks: Iterable[int]) -> None:
        """The replica restarted: its positions and maps mean nothing now."""
        await self.client.execute("DEL", self._key(replica, "seq"), *(self._key(replica, f"map:{r}") for r in ranks))

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    @property
    def holding(self) -> int:
        """How many leases this router holds (without copying their names)."""
        return len(self._held)

    async def routers(self) -> int:
        """Say that this router takes part (for three lease periods), and count the routers that do."""
        now = int(time.time() * 1000)
        return int(await self.client.evalsha(self._present, [self.keys.lease_routers()],
                                             [now, 3 * self.ms, self.holder]))

    async def count_routers(self) -> None:
        """Every lease period: say this router takes part in the leases, and count those that do."""
        while True:
            try:
                async with asyncio.timeout(self.lease_s):
                    self._routers = max(1, await self.routers())
            except asyncio.CancelledError:
                raise
            except Exception:
                pass  # Redis down: the leases say so in their own loops; keep the last count
            await asyncio.sleep(self.lease_s)

    def take_part(self, replica: str) -> None:
        """The replica's events go through a lease (it counts toward the fair share)."""
        self._leased.add(replica)

    def leave(self, replica: str) -> None:
        self._leased.discard(replica)

    def fair_share(self) -> int:
        """Leases this router should hold: the replicas whose events go through leases, over the routers."""
        return max(1, -(-len(self._leased) // self._routers))

    def beyond_share(self, replica: str) -> bool:
        """Whether this lease is one of those this router holds beyond its share (the last ones by name)."""
        fair = self.fair_share()
        return self.holding > fair and replica not in sorted(self._held)[:fair]

    async def release(self, replica: str) -> None:
        """Give up one lease: another router takes it within a third of a lease period."""
        self._held.discard(replica)
        await self.client.evalsha(self._release, [self._key(replica, "lease")], [self.holder])

    async def close(self) -> None:
        """Give up every lease held (another router takes over at once)."""
        await self.release_all()

    async def release_all(self) -> None:
        for replica in list(self._held):
            try:
                await self.client.evalsha(self._release, [self._key(replica, "lease")], [self.holder])
            except Exception:
                pass
        self._held.clear()
