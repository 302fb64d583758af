"""Health checks shared by the routers on one Redis: each replica has one owner among them.

Without sharing, every router checks and scrapes every replica: N routers in front of a fleet send N times
the control traffic, and each pays for all of it. With a Redis store (and ``health.shared``, the default) the
routers that take part say so every ``health.shared_interval_s``; each replica's owner is the one of them
that ranks highest for it by rendezvous hashing of (router, replica), so every router finds the same owner
without asking, and when a router leaves only its own replicas move. The owner checks and scrapes the
replica at the configured rates and publishes its verdict when it changes (``starting``, ``ready``,
``unready WHY``); the others check and scrape it as many times less often as there are routers (they still
need its models and its engine's figures, and a refused request is still their own evidence), and take it
out of rotation, and back, on the owner's word (:meth:`~.health.Health.adopt`). A replica the owner takes
out leaves every router's rotation about one round later, however long their own checks are apart.

A router that stops taking part (stopped: at once; killed or cut off from Redis: after three rounds) loses
its replicas to the others. A replica no router has published a verdict for, while this router has had it
for three rounds, is checked by this router as its owner would (a router that does not know it may own it).
When Redis does not answer, a router checks every replica itself again, at the configured rates.

Keys (one hash tag, so one slot in Redis Cluster): ``NS:{NS:health}:routers``, a sorted set of router ids
scored by when they stop counting (ms); ``...:verdicts``, a hash of replica name -> verdict; ``...:version``,
a token that changes with the verdicts, so that a round reads them only when they changed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping

import xxhash

from ..background import Background
from ..config import HealthConfig
from ..metrics import Metrics
from ..replica_events import EventBus, ReplicaReady, ReplicaUnready
from ..store import LUA_HASH_CHANGES, LUA_PRESENT, RedisError, Store
from .health import Health
from .record import Replica

log = logging.getLogger("kvroute.pool")

ROUNDS_TO_LEAVE = 3  # a router silent for this many rounds no longer counts
MAX_WHY = 200  # characters of a reason published with a verdict

# One round. KEYS: the routers' sorted set, the verdicts' hash, the version. ARGV: now (ms), how long this
# router counts (ms), its id, the version the caller last read, a new version token, n, then n (replica,
# verdict) pairs to set, then the replicas whose verdicts go. Returns {routers, version, verdicts (flat)
# where the version is not the caller's, else nothing}.
_ROUND = LUA_HASH_CHANGES + LUA_PRESENT + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
present(KEYS[1], now, ttl, ARGV[3])
local n = tonumber(ARGV[6])
if n > 0 or #ARGV > 6 + 2 * n then
  hash_changes(KEYS[2], n, 7)
  redis.call('SET', KEYS[3], ARGV[5])
end
redis.call('PEXPIRE', KEYS[2], 100 * ttl)
redis.call('PEXPIRE', KEYS[3], 100 * ttl)
local version = redis.call('GET', KEYS[3]) or ''
local verdicts = {}
if version ~= ARGV[4] then verdicts = redis.call('HGETALL', KEYS[2]) end
return {redis.call('ZRANGE', KEYS[1], 0, -1), version, verdicts}
"""


def _rank(router: str, replica: str) -> int:
    return xxhash.xxh64_intdigest(f"{router}\0{replica}".encode())


class SharedHealth:
    """Which router owns each replica's checks (``replicas``: the pool's mapping, read only), and the owners'
    verdicts taken into this router's ``health``."""

    def __init__(self, store: Store, router_id: str, replicas: Mapping[str, Replica], health: Health,
                 config: HealthConfig, metrics: Metrics, events: EventBus) -> None:
        self.client = store.client
        self.keys = (store.keys.health_routers(), store.keys.health_verdicts(), store.keys.health_version())
        self.id = router_id
        self.replicas = replicas
        self.health = health
        self.config = config
        self.metrics = metrics
        self._script = self.client.script(_ROUND)
        self._ttl_ms = max(1, int(ROUNDS_TO_LEAVE * config.shared_interval_s * 1000))
        self.active = False  # Redis answered the last round: the checks are shared
        self._routers: tuple[str, ...] = (router_id,)
        self._owners: dict[str, str] = {}  # replica -> its owner among self._routers (a cache)
        self._owned = 0  # replicas of the pool this router owns, as last counted
        self._verdicts: dict[str, str] = {}  # as last read
        self._version = ""
        self._wake = asyncio.Event()  # a replica this router owns changed state: publish it now
        self._background = Background()
        self._down_logged = False
        events.subscribe(self._on_event)

    # -- ownership (read by the checks' loops) ------------------------------------------------

    @property
    def routers(self) -> int:
        """Routers sharing the checks (1 while the sharing is off)."""
        return len(self._routers) if self.active else 1

    def owner(self, replica: str) -> str:
        """The router that owns ``replica``'s checks: the one that ranks highest for it."""
        found = self._owners.get(replica)
        if found is None:
            found = self._owners[replica] = max(self._routers, key=lambda router: _rank(router, replica))
        return found

    def owns(self, r: Replica) -> bool:
        """Whether this router checks ``r`` at the configured rates (and its word counts for the others): it is
        its owner, the sharing is off, or no router has published a verdict on it for three rounds."""
        if not self.active or self.owner(r.name) == self.id:
            return True
        return r.name not in self._verdicts and time.monotonic() - r.added_at > self._ttl_ms / 1000

    @property
    def owned(self) -> int:
        """Replicas of the pool this router checks at the configured rates, as counted at the last round."""
        return self._owned if self.active else len(self.replicas)

    def defers(self, r: Replica) -> bool:
        """Whether this router leaves ``r`` unchecked for now: it is out on its owner's word, and only that
        owner's word brings it back."""
        return r.adopted and not self.owns(r)

    def share(self) -> float:
        """How many replicas' worth of checks this router makes: those it owns at the full rate, the others at
        one in ``routers``."""
        n = len(self.replicas)
        if not self.active:
            return float(n)
        return self._owned + (n - self._owned) / self.routers

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """A first round (at most one shared interval: without it every replica is this router's), then the
        rounds in the background."""
        try:
            async with asyncio.timeout(max(1.0, self.config.shared_interval_s)):
                await self.round()
        except Exception as e:
            self._went_down(e)
        self._background.spawn(self._loop())

    async def close(self) -> None:
        """Stop taking part: the others take this router's replicas at their next round."""
        await self._background.close()
        try:
            async with asyncio.timeout(1.0):
                await self.client.execute("ZREM", self.keys[0], self.id)
        except Exception:
            pass

    def _on_event(self, event: object) -> None:
        if isinstance(event, (ReplicaReady, ReplicaUnready)) and self.active:
            r = self.replicas.get(event.replica)
            if r is not None and self.owns(r):
                self._wake.set()

    async def _loop(self) -> None:
        interval = self.config.shared_interval_s
        while True:
            try:
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                async with asyncio.timeout(max(1.0, interval)):
                    await self.round()
            except asyncio.CancelledError:
                raise
            except (RedisError, TimeoutError, OSError) as e:
                self._went_down(e)
            except Exception as e:  # a bug: checking every replica here is still right
                log.exception("shared health checks: a round failed")
                self._went_down(e)

    def _went_down(self, e: BaseException) -> None:
        if self.active or not self._down_logged:
            log.warning("shared health checks: Redis did not answer (%s); this router checks every replica "
                        "itself until it does", e.__class__.__name__)
            self._down_logged = True
        self.active = False
        self._version = ""  # read every verdict again once Redis answers
        self._set_gauges()

    # -- one round ------------------------------------------------------------------------------

    async def round(self) -> None:
        """Say this router takes part, publish its changed verdicts, read the routers and any changed verdict,
        and take the owners' verdicts on the replicas this router does not own."""
        sets, gone = self._changes() if self.active else ([], [])
        token = secrets.token_hex(8)
        routers, version, flat = await self.client.evalsha(
            self._script, list(self.keys),
            [int(time.time() * 1000), self._ttl_ms, self.id, self._version, token, len(sets) // 2, *sets, *gone])
        names = tuple(sorted(x.decode() if isinstance(x, bytes) else str(x) for x in routers))
        if self.id not in names:
            names = tuple(sorted((*names, self.id)))
        if names != self._routers:
            if self.active or len(names) > 1:
                log.info("shared health checks: %d router(s) take part", len(names))
            self._routers = names
            self._owners.clear()
        elif len(self._owners) > 2 * (len(self.replicas) + len(self._verdicts)) + 64:
            self._owners.clear()  # names of replicas gone since
        version = version.decode() if isinstance(version, bytes) else str(version or "")
        if version != self._version:
            verdicts: dict[str, str] = {}
            for i in range(0, len(flat) - 1, 2):
                try:
                    verdicts[flat[i].decode()] = flat[i + 1].decode()
                except UnicodeDecodeError:
                    continue  # not a router's entry
            self._verdicts = verdicts
            self._version = version
        else:
            for i in range(0, len(sets), 2):
                self._verdicts[sets[i]] = sets[i + 1]
            for name in gone:
                self._verdicts.pop(name, None)
        if not self.active:
            self.active = True
            if self._down_logged:
                log.info("shared health checks: Redis answers again; the checks are shared again")
                self._down_logged = False
        self._owned = sum(1 for r in self.replicas.values() if self.owns(r))
        self._adopt()
        self._set_gauges()

    def _changes(self) -> tuple[list[str], list[str]]:
        """The verdicts on replicas this router owns (by rank) that differ from those published (a reason alone does not
        count), and the published verdicts on replicas it owns and no longer has."""
        sets: list[str] = []
        published = self._verdicts
        for r in self.replicas.values():
            if r.adopted or self.owner(r.name) != self.id:
                continue  # a replica this router checks only for want of a verdict is not its to publish
            before = published.get(r.name)
            if before is not None and before.partition(" ")[0] == r.state:
                continue
            sets += [r.name, f"unready {(r.last_error or '')[:MAX_WHY]}" if r.state == "unready" else r.state]
        gone = [name for name in published if name not in self.replicas and self.owner(name) == self.id]
        return sets, gone

    def _adopt(self) -> None:
        """Take the owners' word on the replicas this router does not own."""
        for name, verdict in self._verdicts.items():
            r = self.replicas.get(name)
            if r is None or self.owns(r):
                continue
            state, _, why = verdict.partition(" ")
            if state == "unready":
                self.health.adopt(r, False, why or "no reason given")
            elif state == "ready":
                self.health.adopt(r, True)

    def _set_gauges(self) -> None:
        self.metrics.health_routers.set(self.routers)
        self.metrics.health_owned.set(self.owned)
