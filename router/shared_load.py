"""One load picture across router instances: the requests in flight and the prefill pending that the other
routers on the same Redis have on each replica.

Without it, each of N routers in front of one fleet sees its own requests at once and the others' only
through the replicas' ``/metrics``, a scrape interval late (a second, or more on a large fleet): N routers
that each see about 1/N of the load pile placements onto the same replicas. With a Redis index (and
``shared_load.enabled``, the default) every router publishes its own figures as they change (a request
placed or finished, at most every ``shared_load.min_interval_s``, 10 ms) and every ``shared_load.interval_s``
(100 ms) else, and reads the others' in the same round trip. A decision whose picture is older than
``shared_load.max_age_s`` (20 ms) has it read again first, beside its prefix lookup.

Two routers deciding within the same few milliseconds still both see a replica free: each decides before the
other's publication. So a decision that puts a long prefill on a replica (at least
``shared_load.claim_min_tokens`` uncached tokens, 512) while other hosts' routers are in the picture *claims*
it before its request is sent: one round trip publishes this router's figures there and reads the others'
there (:meth:`SharedLoad.claim`). Redis runs the two claims one after the other, so the second learns of the
first, and its decision chooses again with that figure (:meth:`router.admission.Admission.move`).

Keys (one hash tag, so one slot in Redis Cluster): ``NS:{NS:load}:routers``, a sorted set of router ids
scored by the time (ms) their figures expire, and ``NS:{NS:load}:r:ID``, a hash of replica name ->
``"INFLIGHT PENDING"`` holding only the replicas where that router has something, expiring with it. The same
hash holds ``~TENANT`` -> ``"INFLIGHT USAGE WAITING"``: each tenant's requests in flight there, the tokens it
was given slots for lately and its requests in that router's queue (:mod:`router.tenants`), which every router,
this host's other workers included, adds up for the tenants' ``max_concurrent`` and fair share. A
router that stops (killed, cut off from Redis) stops renewing: its figures leave every other router's
picture within ``shared_load.ttl_s``, so nothing counts as phantom load for longer. Ids are
``HOST.WORKER``: the workers of one host share their load in memory already and skip each other's here.

The figures are advice, as the index is: when Redis does not answer, routing goes on with the figures
last read for at most ``ttl_s``, then without them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Callable

from .background import Background
from .config import SharedLoadConfig
from .store import LUA_HASH_CHANGES, LUA_PRESENT, Store
from .load import LoadTable
from .tenants import Tenants

log = logging.getLogger("kvroute.shared_load")

# Publish this router's changed figures and read the others'. KEYS[1] the routers' sorted set, KEYS[2] this
# router's hash. ARGV: now (ms), ttl (ms), own id, own host prefix ("HOST."), the others' hash key prefix,
# n, then n (replica, "INFLIGHT PENDING") pairs to set, then the replicas to delete. Returns the number of other
# hosts' routers, then their (replica, figures) pairs, flat.
_TICK = LUA_HASH_CHANGES + LUA_PRESENT + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local id, host, prefix = ARGV[3], ARGV[4], ARGV[5]
hash_changes(KEYS[2], tonumber(ARGV[6]), 7)
redis.call('PEXPIRE', KEYS[2], ttl)
present(KEYS[1], now, ttl, id)
local out = {0}
for _, other in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if other ~= id then
    local flat = redis.call('HGETALL', prefix .. other)
    if string.sub(other, 1, #host) ~= host then
      out[1] = out[1] + 1
      for k = 1, #flat do out[#out + 1] = flat[k] end
    else  -- this host's other workers: their replica figures are shared in memory, their tenants' are not
      for k = 1, #flat - 1, 2 do
        if string.sub(flat[k], 1, 1) == '~' then out[#out + 1] = flat[k]; out[#out + 1] = flat[k + 1] end
      end
    end
  end
end
return out
"""

# A placement checked before its request is sent: this router's figures for one replica set (ARGV[6], ARGV[7]; ""
# deletes), and the other hosts' figures there summed, in the same round trip. KEYS and ARGV[1..5] as in _TICK.
# Returns {requests in flight, pending prefill tokens}.
_CLAIM = LUA_PRESENT + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local id, host, prefix, replica = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if ARGV[7] == '' then redis.call('HDEL', KEYS[2], replica) else redis.call('HSET', KEYS[2], replica, ARGV[7]) end
redis.call('PEXPIRE', KEYS[2], ttl)
present(KEYS[1], now, ttl, id)
local inflight, pending = 0, 0
for _, other in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if other ~= id and string.sub(other, 1, #host) ~= host then
    local v = redis.call('HGET', prefix .. other, replica)
    local a, b = string.match(v or '', '^(-?%d+) (-?%d+)')
    if a then
      inflight = inflight + math.max(0, tonumber(a))
      pending = pending + math.max(0, tonumber(b))
    end
  end
end
return {inflight, pending}
"""

Figures = tuple[int, int]  # requests in flight, pending prefill tokens
_NONE: Figures = (0, 0)


def new_host_id() -> str:
    """An id for one router host (its workers share it): random, so a restarted router is a new one."""
    return secrets.token_hex(6)


class SharedLoad:
    """This router's share of the load picture: it publishes its figures and holds the others' sums."""

    def __init__(self, store: Store, load: LoadTable, cfg: SharedLoadConfig, host_id: str, worker: int = 0,
                 read_timeout_s: float = 0.05, tenants: Tenants | None = None) -> None:
        self.redis = redis = store.client
        self.load = load
        self.tenants = tenants
        self.cfg = cfg
        self.host = host_id + "."
        self.id = f"{host_id}.{worker}"
        self._routers = store.keys.load_routers()
        self._prefix = store.keys.load_prefix()
        self._mine = self._prefix + self.id
        self._script = redis.script(_TICK)
        self._claim = redis.script(_CLAIM)
        self._peers = 0  # other hosts' routers in the picture at the last read
        self._again: set[str] = set()  # replicas a claim set in Redis: the next round sends their figures again
        self._others: dict[str, Figures] = {}
        self._others_at = 0.0  # monotonic time of the last good read
        self._published: dict[str, Figures] = {}
        self._resend = True  # after a failed tick (or at start): publish every figure, not just changes
        self._down = False
        self._background = Background()
        self._changed = asyncio.Event()  # this router's figures changed since the last publication
        self._round: asyncio.Future[None] | None = None  # the round trip under way (one at a time)
        self._read_timeout = read_timeout_s  # the longest a decision waits for a fresher picture
        self._sent_at = 0.0  # monotonic time the round that read the current picture was sent
        self._read = asyncio.Event()  # set (and replaced) when a round has read a new picture
        self._peaks: dict[str, int] = {}  # replica -> most of the others' requests there since a scrape was sent
        self._freed: list[Callable[[list[str]], None]] = []
        self._eager: Callable[[], bool] = lambda: False  # while true, a round every min_interval_s
        load.on_change(self._changed.set)

    def on_freed(self, callback: Callable[[list[str]], None], waiting: Callable[[], bool]) -> None:
        """Call ``callback`` with the replicas where the other routers hold fewer requests than last read (slots
        they freed: a request waiting here may take them); while ``waiting()``, read every ``min_interval_s``."""
        self._freed.append(callback)
        self._eager = waiting

    def others(self, replica: str) -> Figures:
        """The other routers' requests in flight and pending prefill tokens on ``replica``."""
        return self._others.get(replica, _NONE)

    def contended(self) -> bool:
        """Whether other hosts' routers were in the picture at the last read (and Redis answered it)."""
        return self._peers > 0 and not self._down

    async def claim(self, replica: str) -> Figures | None:
        """Publish this router's figures for ``replica`` now and read the other routers' there, in one round trip:
        of two routers that place onto one replica within the same few milliseconds (each before the other's
        publication), the second learns of the first here, before its request is sent. The others' figures there
        join the picture. None where Redis did not answer within a prefix lookup's wait."""
        inflight, pending = self.load.own_figures(replica) if replica in self.load else _NONE
        figures = f"{inflight} {pending}" if inflight or pending else ""
        self._again.add(replica)  # Redis may apply this after a round sent earlier: the next round sets it again
        try:
            async with asyncio.timeout(self._read_timeout):
                reply = await self.redis.evalsha(self._claim, [self._routers, self._mine], [
                    int(time.time() * 1000), int(self.cfg.ttl_s * 1000), self.id, self.host, self._prefix, replica,
                    figures])
            fresh: Figures = (max(0, int(reply[0])), max(0, int(reply[1])))
        except Exception:
            return None  # the loop logs Redis failures
        finally:
            self._changed.set()
        if fresh == _NONE:
            self._others.pop(replica, None)
        else:
            self._others[replica] = fresh
        return fresh

    def mark_peak(self, replica: str) -> None:
        """Start counting the most requests the other routers have on ``replica`` (a scrape of it is sent)."""
        self._peaks[replica] = self.others(replica)[0]

    async def peak(self, replica: str) -> int:
        """The most requests the other routers had on ``replica`` since :meth:`mark_peak`, read up to a round sent
        after this call (a scrape's answer may count requests they placed after the picture held then was read;
        an interval_s later, at most, they are in it). Without an answering Redis, what it has."""
        since = time.monotonic()
        try:
            async with asyncio.timeout(min(1.0, 2 * self.cfg.interval_s + 0.05)):
                while not self._down and self._sent_at < since:
                    await self._read.wait()
        except TimeoutError:
            pass
        return max(self._peaks.get(replica, 0), self.others(replica)[0])

    def end_peak(self, replica: str) -> None:
        self._peaks.pop(replica, None)

    def stale(self) -> bool:
        """Whether the others' figures are older than ``max_age_s`` (and Redis answered the last round)."""
        return not self._down and time.monotonic() - self._others_at > self.cfg.max_age_s

    async def refresh(self) -> None:
        """Publish and read now where the picture is older than ``max_age_s``, waiting for it at most as long as a
        prefix lookup may: a decision then sees what the others placed since (their placements are published at
        once). Never raises: on a slow or failing Redis the decision goes on with the figures it has."""
        if not self.stale():
            return
        try:
            async with asyncio.timeout(self._read_timeout):
                await self._one_round()
        except Exception:
            pass  # the loop logs Redis failures

    async def _one_round(self) -> None:
        """A round trip, shared with whoever asks while it is under way."""
        if self._round is None:
            self._round = asyncio.ensure_future(self.tick())
            self._round.add_done_callback(self._round_done)
        await asyncio.shield(self._round)

    def _round_done(self, fut: "asyncio.Future[None]") -> None:
        self._round = None
        if not fut.cancelled():
            fut.exception()  # retrieved here; the caller that awaited it has seen it

    async def start(self) -> None:
        self._background.spawn(self._loop())

    async def close(self) -> None:
        await self._background.close()
        if self._round is not None:
            self._round.cancel()
        try:  # leave the picture at once rather than at expiry
            async with asyncio.timeout(1.0):
                await self.redis.execute("ZREM", self._routers, self.id)
                await self.redis.execute("DEL", self._mine)
        except Exception:
            pass

    async def _loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(max(1.0, self.cfg.interval_s * 5)):
                    await self._one_round()
                if self._down:
                    self._down = False
                    log.info("shared load: Redis answers again; the other routers' load is read again")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._resend = True
                if not self._down:
                    self._down = True
                    log.warning("shared load: Redis did not answer (%s); routing on the other routers' load as "
                                "last read, for at most %g s", e.__class__.__name__, self.cfg.ttl_s)
                if self._others_at and time.monotonic() - self._others_at > self.cfg.ttl_s:
                    self._others = {}
                    if self.tenants is not None:
                        self.tenants.set_others({})
            await self._pause()

    async def _pause(self) -> None:
        """Until the next round: ``interval_s``, or ``min_interval_s`` where this router's figures changed (a
        request placed or finished is published at once, so the others do not place onto it unawares)."""
        cfg = self.cfg
        await asyncio.sleep(cfg.min_interval_s)
        if not self._changed.is_set() and not self._eager():
            try:
                async with asyncio.timeout(max(0.0, cfg.interval_s - cfg.min_interval_s)):
                    await self._changed.wait()
            except TimeoutError:
                pass
        self._changed.clear()

    async def tick(self) -> None:
        """One round trip: this router's changed figures out, the others' in."""
        sent_at = time.monotonic()
        load = self.load
        again, self._again = self._again, set()
        if self._resend:
            names = set(load.names) | {n for n in self._published if not n.startswith("~")} | load.take_touched()
        else:
            names = load.take_touched() | again
        sets: list[Any] = []
        gone: list[str] = []
        published = self._published
        for name in names:
            now = load.own_figures(name) if name in load else _NONE
            if now == published.get(name, _NONE) and not self._resend and name not in again:
                continue
            if now == _NONE:
                gone.append(name)
            else:
                sets += [name, f"{now[0]} {now[1]}"]
        tenants = self.tenants
        if tenants is not None:
            # every round: a tenant's usage decays as time passes, without a request to say so
            touched = tenants.take_touched() | set(tenants.names) | {n[1:] for n in published if n.startswith("~")}
            for tenant in touched:
                field, figures = "~" + tenant, tenants.own(tenant)
                if figures == published.get(field) and not self._resend:
                    continue
                if not any(figures):
                    gone.append(field)
                else:
                    sets += [field, " ".join(map(str, figures))]
        ttl_ms = int(self.cfg.ttl_s * 1000)
        flat = await self.redis.evalsha(self._script, [self._routers, self._mine],
                                        [int(time.time() * 1000), ttl_ms, self.id, self.host, self._prefix,
                                         len(sets) // 2, *sets, *gone])
        for i in range(0, len(sets), 2):
            published[sets[i]] = tuple(int(x) for x in sets[i + 1].split())
        for name in gone:
            published.pop(name, None)
        self._resend = False
        others: dict[str, Figures] = {}
        tenant_others: dict[str, tuple[int, int, int]] = {}
        self._peers = int(flat[0])
        for i in range(1, len(flat) - 1, 2):
            try:
                name = flat[i].decode()
                if name.startswith("~"):  # a tenant's requests in flight, usage and requests waiting there
                    t = tuple(max(0, int(x)) for x in flat[i + 1].split()[:3])
                    if len(t) == 3:
                        a, b, c = tenant_others.get(name[1:], (0, 0, 0))
                        tenant_others[name[1:]] = (a + t[0], b + t[1], c + t[2])
                    continue
                inflight, pending = (int(x) for x in flat[i + 1].split())
            except (ValueError, UnicodeDecodeError):
                continue  # not a router's entry: ignored
            if name not in load:
                continue  # a replica this router does not know: nothing to weigh it with
            a, b = others.get(name, _NONE)
            others[name] = (a + max(0, inflight), b + max(0, pending))
        freed = [name for name, (n, _) in self._others.items() if others.get(name, _NONE)[0] < n]
        self._others = others
        if freed:
            for callback in self._freed:
                callback(freed)
        if tenants is not None:
            tenants.set_others(tenant_others)
        self._others_at = time.monotonic()
        self._sent_at = sent_at
        peaks = self._peaks
        for name in peaks:
            peaks[name] = max(peaks[name], others.get(name, _NONE)[0])
        read, self._read = self._read, asyncio.Event()
        read.set()
