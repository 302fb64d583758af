"""The Redis prefix index, shared by router instances.

Per (model, replica) one sorted set of 8-byte block hashes scored by last use. Every key of a
model carries the hash tag ``{model}``, so one model's keys live in one slot (Redis Cluster).

The blocks held of any chain always form a prefix of it: a block's hash stands for its whole
prefix, so every recorded chain that holds block j+1 holds block j too; recording stamps the
earlier blocks as more recently used; and trimming removes the least recently used first. A
lookup therefore gallops and bisects along the chain, O(log m) probes per replica for an m-block
match, all candidate replicas in one round trip (a Lua script). A record is one round trip too:
it stamps the chain's blocks, root newest, and trims the set to the replica's capacity; a
withdrawal removes the blocks a record added that still carry its stamps. The chain travels as
one argument of 8 bytes per block.
"""

from __future__ import annotations

import struct
from typing import Sequence

from . import Match, Probe, Receipt
from .resp import Redis


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

# Per key: the match length and the number of blocks held (ZCARD, O(1)).
_LOOKUP = _MATCHED + """
local out = {}
for i, key in ipairs(KEYS) do
  out[2 * i - 1] = matched(key, ARGV[1])
  out[2 * i] = redis.call('ZCARD', key)
end
return out
"""

# Stamps the chain's blocks (root newest) from the model's clock, trims to the capacity, and
# returns the blocks held before and the stamp of the root, for a withdrawal.
_RECORD = _MATCHED + """
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
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if over > 0 then redis.call('ZPOPMIN', KEYS[1], over) end
return {kept, top}
"""

# Removes the blocks a record added (past the `kept` it returned) that still carry its stamps.
_WITHDRAW = """
local kept, top, chain = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local removed = 0
for j = kept + 1, #chain / 8 do
  local member = string.sub(chain, 8 * j - 7, 8 * j)
  local score = redis.call('ZSCORE', KEYS[1], member)
  if score and tonumber(score) == top - (j - 1) then
    redis.call('ZREM', KEYS[1], member)
    removed = removed + 1
  end
end
return removed
"""


def _tag(model: str) -> str:
    return model.replace("{", "(").replace("}", ")")


class RedisIndex:
    name = "redis"

    def __init__(self, url: str, namespace: str = "kvroute", timeout_s: float = 0.05) -> None:
        self.url = url
        self.ns = namespace
        # Lookups are bounded by the caller (index.timeout_s, on the request's path); connecting may
        # take a little longer on a busy host.
        self.client = Redis(url, connect_timeout=max(1.0, timeout_s))
        self._lookup = self.client.script(_LOOKUP)
        self._record = self.client.script(_RECORD)
        self._withdraw = self.client.script(_WITHDRAW)

    def key(self, model: str, replica: str) -> str:
        return f"{self.ns}:{{{_tag(model)}}}:r:{replica}"

    def _clock(self, model: str) -> str:
        return f"{self.ns}:{{{_tag(model)}}}:clock"

    @staticmethod
    def _packed(chain: Sequence[int]) -> bytes:
        """The chain as one argument: 8 big-endian bytes per block (far cheaper than one argument each)."""
        return struct.pack(f">{len(chain)}Q", *chain)

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> Probe:
        if not replicas:
            return Probe({})
        # an empty chain still asks for the sizes: the script then matches nothing
        out = await self.client.evalsha(self._lookup, [self.key(model, r) for r in replicas], [self._packed(chain)])
        return Probe({r: Match(out[2 * i], out[2 * i + 1]) for i, r in enumerate(replicas)})

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        if not chain:
            return None
        kept, top = await self.client.evalsha(self._record, [self.key(model, replica), self._clock(model)],
                                              [max(1, capacity), self._packed(chain)])
        return Receipt(model, replica, chain, kept, top)

    async def withdraw(self, receipt: Receipt) -> None:
        if receipt.kept < len(receipt.chain):
            await self.client.evalsha(self._withdraw, [self.key(receipt.model, receipt.replica)],
                                      [receipt.kept, receipt.stamp, self._packed(receipt.chain)])

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        if models:
            await self.client.execute("DEL", *(self.key(m, replica) for m in models))

    async def size(self, model: str, replica: str) -> int:
        return int(await self.client.execute("ZCARD", self.key(model, replica)))

    async def start(self) -> None:
        """Connect and load the scripts, so that the first lookups pay no set-up (raises if Redis is down)."""
        await self.client.execute("PING")
        await self.client.load_scripts()

    async def close(self) -> None:
        await self.client.close()
