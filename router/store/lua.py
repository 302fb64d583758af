"""Lua pieces shared by several scripts."""


# A Lua function for scripts that change a hash: from ARGV[i] on, n (field, value) pairs to set, then every
# remaining argument a field to delete (in batches, within Lua's limit on unpack).
LUA_HASH_CHANGES = """
local function hash_changes(key, n, i)
  while n > 0 do
    local upto = math.min(n, 500)
    local batch = {}
    for j = 1, upto do
      batch[#batch + 1] = ARGV[i]; batch[#batch + 1] = ARGV[i + 1]; i = i + 2
    end
    redis.call('HSET', key, unpack(batch))
    n = n - upto
  end
  local gone = {}
  while i <= #ARGV do
    gone[#gone + 1] = ARGV[i]; i = i + 1
    if #gone >= 500 then redis.call('HDEL', key, unpack(gone)); gone = {} end
  end
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
end
"""


# A Lua function for a router saying it is present: it counts in the sorted set ``key`` (member ``id``, scored by
# when it stops counting) until ``now + ttl`` (milliseconds); members past their time leave, and the set itself
# goes once no router has said so for ``ttl``.
LUA_PRESENT = """
local function present(key, now, ttl, id)
  redis.call('ZADD', key, now + ttl, id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('PEXPIRE', key, ttl)
end
"""
