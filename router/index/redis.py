"""The Redis prefix index, shared by router instances.

Per (model, replica) one sorted set of 8-byte block hashes scored by last use. Every key of a
model carries the hash tag ``{model}`` (:mod:`router.store.layout`), so one model's keys live in
one slot of a Redis Cluster, and its scripts run there.

The blocks held of any chain always form a prefix of it: a block's hash stands for its whole
prefix, so every recorded chain that holds block j+1 holds block j too; recording stamps the
earlier blocks as more recently used; and trimming removes the least recently used first. A
lookup therefore gallops and bisects along the chain, O(log m) probes per replica for an m-block
match, all candidate replicas in one round trip (a Lua script). A record is one round trip too:
it stamps the chain's blocks, root newest, and trims the set to the replica's capacity; a
withdrawal removes the blocks a record added that still carry its stamps. The chain travels as
one argument of 8 bytes per block.

The exact tier (replicas that publish KV-cache events) has its own sorted set per (model,
replica), ``...:x:{replica}``, whose scores carry the meaning of :mod:`router.index`: 1-3 a medium
mask, anything larger the expiry of a provisional entry. Its lookups walk the chain block by block
(a replica's own evictions need not leave a prefix), and a batch of events is one script call.

Who holds a prefix, without asking every replica (:meth:`RedisIndex.holders`): for the blocks at
positions 1, 2, 4, 8, ... of each chain recorded (or held provisionally), a set of the replicas holding
it, ``...:w:BLOCK``, kept by the same script calls that change the replicas' sets and expiring an hour
after it was last added to. A lookup gallops over those positions to the deepest one held and names its
holders, then those of ever shorter prefixes. Blocks known only from a replica's events (traffic that
did not come through a router) are not named there; the caller's least loaded and sampled replicas
cover them.
"""

from __future__ import annotations

import struct
import time
from typing import Collection, Sequence

from . import Match, Op, Probe, Receipt
from ..store import Store


# Length of the longest prefix of the chain (ARGV chain, 8 bytes per block) held in `key`. The blocks
# the index holds of any chain form a prefix of it (see the module docstring), so it is found by
# galloping, then bisecting: O(log m) probes for an m-block match.
_MATCHED = """
local function matched(key, chain)
  local blocks = #chain / 8
  local function has(j)
    return redis.call('ZSCORE', key, string.sub(chain, 8 * j - 7, 8 * j)) ~= false
  end
  local lo, hi = 0, nil  -- block lo is held (0: none checked), block hi is not
  local probe = 1
  while probe <= blocks do
    if has(probe) then lo = probe; probe = probe * 2 else hi = probe; break end
  end
  if hi == nil then hi = blocks + 1 end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if has(mid) then lo = mid else hi = mid end
  end
  return lo
end
"""

# Exact tier: leading blocks held (confirmed, or provisional and not expired at `now`), and how many
# of them only on the slower medium (mask without bit 1).
_MATCHED_EXACT = """
local function matched_exact(key, chain, now)
  local n, slow = 0, 0
  for j = 1, #chain / 8 do
    local s = redis.call('ZSCORE', key, string.sub(chain, 8 * j - 7, 8 * j))
    if not s then break end
    s = tonumber(s)
    if s >= 4 then
      if s < now then break end
    elseif s % 2 == 0 then
      slow = slow + 1
    end
    n = n + 1
  end
  return n, slow
end
"""

# Per key: the match length, the number of blocks held (ZCARD, O(1)) and the slow blocks of the match.
# ARGV[2] has one character per key: "x" for the exact tier; ARGV[3] is the time now.
_LOOKUP = _MATCHED + _MATCHED_EXACT + """
local out = {}
local now = tonumber(ARGV[3])
for i, key in ipairs(KEYS) do
  local n, slow = 0, 0
  if string.sub(ARGV[2], i, i) == "x" then
    n, slow = matched_exact(key, ARGV[1], now)
  else
    n = matched(key, ARGV[1])
  end
  out[3 * i - 2] = n
  out[3 * i - 1] = redis.call('ZCARD', key)
  out[3 * i] = slow
end
return out
"""

# Who holds which prefix: the replica joins the sets (keys: `prefix` and the block) of the chain's blocks at
# positions 1, 2, 4, ..., each kept an hour from now, those it held already too (a prefix in use stays named);
# and it leaves the sets of blocks it no longer holds.
_WHO = """
local function who_holds(prefix, replica, chain)
  local j = 1
  while j <= #chain / 8 do
    local key = prefix .. string.sub(chain, 8 * j - 7, 8 * j)
    redis.call('SADD', key, replica)
    redis.call('EXPIRE', key, 3600)
    j = j * 2
  end
end
local function who_left(prefix, replica, members)
  for _, member in ipairs(members) do redis.call('SREM', prefix .. member, replica) end
end
"""

# Exact tier: provisional entries for the chain's blocks not held, expiring at ARGV[2]; the expired
# ones go first. Returns the leading blocks held before, and how many entries it added.
_PROVISIONAL = _MATCHED_EXACT + _WHO + """
local now, expires, chain = tonumber(ARGV[1]), ARGV[2], ARGV[3]
redis.call('ZREMRANGEBYSCORE', KEYS[1], 4, now)
local kept = matched_exact(KEYS[1], chain, now)
local added = 0
for j = kept + 1, #chain / 8 do
  local member = string.sub(chain, 8 * j - 7, 8 * j)
  local s = redis.call('ZSCORE', KEYS[1], member)
  if not s or tonumber(s) >= 4 then
    redis.call('ZADD', KEYS[1], expires, member)
    added = added + 1
  end
end
who_holds(ARGV[4], ARGV[5], chain)
return {kept, added}
"""

# Exact tier: a replica's events in order, 10 bytes each: op (1 store, 2 remove, 3 clear), medium bit,
# the block's 8-byte key.
_APPLY = _WHO + """
local ops, key = ARGV[1], KEYS[1]
local prefix, replica = ARGV[2], ARGV[3]
for i = 1, #ops, 10 do
  local op, b = string.byte(ops, i, i + 1)
  local member = string.sub(ops, i + 2, i + 9)
  if op == 1 then
    local s = redis.call('ZSCORE', key, member)
    s = s and tonumber(s)
    if s and s < 4 then b = bit.bor(s, b) end
    redis.call('ZADD', key, b, member)
  elseif op == 2 then
    local s = redis.call('ZSCORE', key, member)
    if s then
      s = tonumber(s)
      local left = 0
      if s < 4 then left = bit.band(s, bit.bnot(b)) end
      if left > 0 then
        redis.call('ZADD', key, left, member)
      else
        redis.call('ZREM', key, member)
        who_left(prefix, replica, {member})
      end
    end
  elseif op == 3 then
    who_left(prefix, replica, redis.call('ZRANGEBYSCORE', key, '-inf', '(4'))
    redis.call('ZREMRANGEBYSCORE', key, '-inf', '(4')
  end
end
return #ops / 10
"""

# Stamps the chain's blocks (root newest) from the model's clock, trims to the capacity, and
# returns the blocks held before and the stamp of the root, for a withdrawal.
_RECORD = _MATCHED + _WHO + """
local chain = ARGV[2]
local n = #chain / 8
local kept = matched(KEYS[1], chain)
local top = redis.call('INCRBY', KEYS[2], n)
local batch = {}
for j = 1, n do
  batch[#batch + 1] = top - (j - 1)
  batch[#batch + 1] = string.sub(chain, 8 * j - 7, 8 * j)
  if #batch >= 1000 then
    redis.call('ZADD', KEYS[1], unpack(batch))
    batch = {}
  end
end
if #batch > 0 then redis.call('ZADD', KEYS[1], unpack(batch)) end
who_holds(ARGV[3], ARGV[4], chain)
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], over)
  local members = {}
  for i = 1, #popped, 2 do members[#members + 1] = popped[i] end
  who_left(ARGV[3], ARGV[4], members)
end
return {kept, top}
"""

# Removes the blocks a record added (past the `kept` it returned) that still carry its stamps; for the
# exact tier (ARGV[4] = "x") the stamp is the provisional entries' expiry, the same for every block.
_WITHDRAW = _WHO + """
local kept, top, chain = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local removed = 0
for j = kept + 1, #chain / 8 do
  local member = string.sub(chain, 8 * j - 7, 8 * j)
  local score = redis.call('ZSCORE', KEYS[1], member)
  local stamp = top - (j - 1)
  if ARGV[4] == "x" then stamp = top end
  if score and tonumber(score) == stamp then
    redis.call('ZREM', KEYS[1], member)
    who_left(ARGV[5], ARGV[6], {member})
    removed = removed + 1
  end
end
return removed
"""


# Up to ARGV[3] replicas holding a prefix of the chain (ARGV[2]), from the sets at positions 1, 2, 4, ...
# (ARGV[1] their key prefix): the deepest position held first, then ever shorter prefixes.
_HOLDERS = """
local prefix, chain, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local n = #chain / 8
local function key(j) return prefix .. string.sub(chain, 8 * j - 7, 8 * j) end
local deepest = 0
local j = 1
while j <= n and redis.call('EXISTS', key(j)) == 1 do
  deepest = j
  j = j * 2
end
local out, seen = {}, {}
j = deepest
while j >= 1 and #out < limit do
  for _, r in ipairs(redis.call('SRANDMEMBER', key(j), limit)) do
    if not seen[r] and #out < limit then
      seen[r] = true
      out[#out + 1] = r
    end
  end
  j = math.floor(j / 2)
end
return out
"""


# Everything one replica holds of one model (KEYS: its two sets) goes, and it leaves the who-holds sets.
_FORGET = _WHO + """
for _, key in ipairs(KEYS) do
  who_left(ARGV[1], ARGV[2], redis.call('ZRANGE', key, 0, -1))
  redis.call('DEL', key)
end
return 1
"""


class RedisIndex:
    name = "redis"

    def __init__(self, store: Store, timeout_s: float = 0.05) -> None:
        self.store = store
        self.client = store.client
        self.keys = store.keys
        self._owns_store = False
        self._lookup = self.client.script(_LOOKUP)
        self._record = self.client.script(_RECORD)
        self._withdraw = self.client.script(_WITHDRAW)
        self._provisional = self.client.script(_PROVISIONAL)
        self._apply = self.client.script(_APPLY)
        self._holders = self.client.script(_HOLDERS)
        self._forget = self.client.script(_FORGET)

    @classmethod
    def from_url(cls, url: str, namespace: str = "kvroute", timeout_s: float = 0.05) -> "RedisIndex":
        """An index with a store of its own, closed with it."""
        # Lookups are bounded by the caller (index.timeout_s, on the request's path); connecting may
        # take a little longer on a busy host.
        index = cls(Store(url, namespace, connect_timeout=max(1.0, timeout_s)), timeout_s)
        index._owns_store = True
        return index

    def key(self, model: str, replica: str) -> str:
        return self.keys.replica_blocks(model, replica)

    def exact_key(self, model: str, replica: str) -> str:
        return self.keys.replica_exact(model, replica)

    def _who(self, model: str) -> str:
        return self.keys.holders_prefix(model)

    def _clock(self, model: str) -> str:
        return self.keys.clock(model)

    @staticmethod
    def _packed(chain: Sequence[int]) -> bytes:
        """The chain as one argument: 8 big-endian bytes per block (far cheaper than one argument each)."""
        return struct.pack(f">{len(chain)}Q", *chain)

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str],
                    exact: Collection[str] = ()) -> Probe:
        if not replicas:
            return Probe({})
        keys = [self.exact_key(model, r) if r in exact else self.key(model, r) for r in replicas]
        tiers = "".join("x" if r in exact else "r" for r in replicas)
        # an empty chain still asks for the sizes: the script then matches nothing
        out = await self.client.evalsha(self._lookup, keys, [self._packed(chain), tiers, repr(time.time())])
        return Probe({r: Match(out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i, r in enumerate(replicas)})

    async def holders(self, model: str, chain: Sequence[int], limit: int) -> list[str] | None:
        if not chain or limit <= 0:
            return []
        # the clock names the model's slot (the sets read are under the same hash tag)
        out = await self.client.evalsha(self._holders, [self._clock(model)],
                                        [self._who(model), self._packed(chain), limit])
        return [r.decode() for r in out]

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        if not chain:
            return None
        kept, top = await self.client.evalsha(self._record, [self.key(model, replica), self._clock(model)],
                                              [max(1, capacity), self._packed(chain), self._who(model), replica])
        return Receipt(model, replica, chain, kept, top)

    async def withdraw(self, receipt: Receipt) -> None:
        if receipt.kept < len(receipt.chain):
            if receipt.exact:
                await self.client.evalsha(self._withdraw, [self.exact_key(receipt.model, receipt.replica)],
                                          [receipt.kept, repr(receipt.stamp), self._packed(receipt.chain), "x",
                                           self._who(receipt.model), receipt.replica])
            else:
                await self.client.evalsha(self._withdraw, [self.key(receipt.model, receipt.replica)],
                                          [receipt.kept, receipt.stamp, self._packed(receipt.chain), "r",
                                           self._who(receipt.model), receipt.replica])

    async def provisional(self, model: str, replica: str, chain: Sequence[int], expires: float) -> Receipt | None:
        if not chain:
            return None
        kept, added = await self.client.evalsha(self._provisional, [self.exact_key(model, replica)],
                                                [repr(time.time()), repr(expires), self._packed(chain),
                                                 self._who(model), replica])
        return Receipt(model, replica, chain, kept, expires, exact=True) if added else None

    async def apply(self, model: str, replica: str, ops: Sequence[Op]) -> None:
        if ops:
            packed = b"".join([struct.pack(">BBQ", op, bit, h) for op, h, bit in ops])
            await self.client.evalsha(self._apply, [self.exact_key(model, replica)],
                                      [packed, self._who(model), replica])

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        for m in models:
            await self.client.evalsha(self._forget, [self.key(m, replica), self.exact_key(m, replica)],
                                      [self._who(m), replica])

    async def size(self, model: str, replica: str) -> int:
        return (int(await self.client.execute("ZCARD", self.key(model, replica)))
                + int(await self.client.execute("ZCARD", self.exact_key(model, replica))))

    async def start(self) -> None:
        """Connect and load the scripts, so that the first lookups pay no set-up (raises if Redis is down)."""
        await self.client.execute("PING")
        await self.client.load_scripts()

    async def close(self) -> None:
        if self._owns_store:
            await self.store.close()
