"""Each tenant's rate limits: requests and tokens per minute, as token buckets shared by every router.

A bucket holds ``burst_s`` seconds of its rate and refills continuously. A request starts while its tenant's
request bucket holds a whole request and its token bucket holds any tokens: one request and its prompt tokens
are taken at once, its completion tokens when its answer has said how many. The token bucket may so go below
zero (a long prompt, a long answer); the tenant's next request then waits for the refill, and its 429 says how
long in ``Retry-After``. Over any stretch of time a tenant is served at most its rate plus one bucket (and,
in tokens, the one request that emptied it).

With a Redis index the buckets live there (``NS:{NS:tenant:NAME}:bucket``, one slot per tenant) and one
script takes from both in one round trip, so the limits hold across every router on it. When Redis does not
answer within ``index.timeout_s`` the router falls back to buckets of its own at the full rate (a tenant
may then get up to its rate from each router) and says so in the log, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

from .background import Background
from .config import TenantConfig
from .store import RedisError, Store

log = logging.getLogger("kvroute.budgets")

# KEYS[1] the tenant's bucket hash. ARGV: now (ms), check (1: take only while both hold something; 0: take),
# then for the request bucket and the token bucket: rate per ms (0: no limit), capacity, amount to take.
# Fields: r/rt (requests: level, ms of it), t/tt (tokens). Returns {1, 0, 0} when taken, else {0, ms until both hold
# something, 0 (the request bucket is short) or 1 (the token bucket)}.
_TAKE = """
local now, check = tonumber(ARGV[1]), ARGV[2] == '1'
local levels, wait, which = {}, 0, 0
for i = 0, 1 do
  local rate, cap = tonumber(ARGV[3 + i * 3]), tonumber(ARGV[4 + i * 3])
  if rate > 0 then
    local f = i == 0 and 'r' or 't'
    local level = tonumber(redis.call('HGET', KEYS[1], f) or cap)
    local at = tonumber(redis.call('HGET', KEYS[1], f .. 't') or now)
    level = math.min(cap, level + math.max(0, now - at) * rate)
    levels[i] = level
    -- a whole request must be left in its bucket; tokens, any (how many a request uses is known later)
    local short = i == 0 and 1 - level or -level
    if short >= 0 and (i == 1 or short > 0) and 1 + short / rate > wait then wait, which = 1 + short / rate, i end
  end
end
if check and wait > 0 then return {0, math.ceil(wait), which} end
local longest = 0
for i = 0, 1 do
  local rate, cap, take = tonumber(ARGV[3 + i * 3]), tonumber(ARGV[4 + i * 3]), tonumber(ARGV[5 + i * 3])
  if rate > 0 then
    local f = i == 0 and 'r' or 't'
    local level = levels[i] - take
    redis.call('HSET', KEYS[1], f, tostring(level), f .. 't', tostring(now))
    longest = math.max(longest, (cap - level) / rate)
  end
end
redis.call('PEXPIRE', KEYS[1], math.ceil(longest) + 1000)
return {1, 0, 0}
"""


_LIMITS = ("requests_per_minute", "tokens_per_minute")


class Refused(NamedTuple):
    limit: str  # requests_per_minute or tokens_per_minute
    retry_after_s: float


class _Bucket:
    """One bucket of this router's own (the fallback while Redis does not answer)."""

    __slots__ = ("level", "at", "rate", "cap")

    def __init__(self, per_minute: float, burst_s: float) -> None:
        self.rate = per_minute / 60.0
        self.cap = self.rate * burst_s
        self.level = self.cap
        self.at = time.monotonic()

    def refill(self, now: float) -> float:
        self.level = min(self.cap, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level


class Budgets:
    """The tenants' request and token buckets: in Redis where there is one, else (and while it fails) here."""

    def __init__(self, store: Store | None = None, timeout_s: float = 0.05) -> None:
        self.redis = store.client if store is not None else None
        self.keys = store.keys if store is not None else None
        self._script = self.redis.script(_TAKE) if self.redis is not None else b""
        self.timeout_s = max(timeout_s, 0.05)
        self._local: dict[tuple[str, str], _Bucket] = {}
        self._down = False
        self._background = Background()

    async def take(self, tenant: TenantConfig, tokens: int) -> Refused | None:
        """Start a request of ``tenant`` with ``tokens`` prompt tokens: None if it may, else which limit
        refused it and when to try again."""
        if not (tenant.requests_per_minute or tenant.tokens_per_minute):
            return None
        shared = await self._shared(tenant, True, 1, tokens)
        if shared is not None:
            return shared if shared.retry_after_s > 0 else None
        now = time.monotonic()
        wait = Refused("", 0.0)
        buckets = self._buckets(tenant)
        for limit, bucket in buckets:
            level = bucket.refill(now)
            # a whole request must be left in its bucket; tokens, any (how many a request uses is known later)
            short = 1 - level if limit == "requests_per_minute" else -level
            if short > 0 or (short == 0 and limit == "tokens_per_minute"):
                seconds = 0.001 + short / bucket.rate
                if seconds > wait.retry_after_s:
                    wait = Refused(limit, seconds)
        if wait.retry_after_s > 0:
            return wait
        for limit, bucket in buckets:
            bucket.level -= 1 if limit == "requests_per_minute" else tokens
        return None

    def spend(self, tenant: TenantConfig, tokens: int) -> None:
        """``tokens`` more used by a request of ``tenant`` that has started (its completion), in the background."""
        if not tokens or not tenant.tokens_per_minute:
            return
        if self.redis is not None and not self._down:
            self._background.spawn(self._spend_shared(tenant, tokens))
        else:
            self._spend_here(tenant, tokens)

    async def close(self) -> None:
        await self._background.close()

    async def _spend_shared(self, tenant: TenantConfig, tokens: int) -> None:
        if await self._shared(tenant, False, 0, tokens) is None:  # not counted in Redis: counted here
            self._spend_here(tenant, tokens)

    def _spend_here(self, tenant: TenantConfig, tokens: int) -> None:
        for limit, bucket in self._buckets(tenant):
            if limit == "tokens_per_minute":
                bucket.refill(time.monotonic())
                bucket.level -= tokens

    async def _shared(self, tenant: TenantConfig, check: bool, requests: int, tokens: int) -> Refused | None:
        """The shared buckets' answer (a Refused with retry_after 0 when taken), or None without Redis."""
        if self.redis is None or self.keys is None:
            return None
        args: list[object] = [int(time.time() * 1000), 1 if check else 0]
        for per_minute, amount in ((tenant.requests_per_minute, requests), (tenant.tokens_per_minute, tokens)):
            rate = (per_minute or 0) / 60_000.0
            args += [repr(rate), repr(rate * tenant.burst_s * 1000), amount]
        try:
            async with asyncio.timeout(self.timeout_s):
                taken, wait_ms, which = await self.redis.evalsha(self._script, [self.keys.tenant_bucket(tenant.name)], args)
        except (RedisError, OSError, TimeoutError, ValueError) as e:
            if not self._down:
                self._down = True
                log.warning("budgets: Redis did not answer (%s); each router now keeps the tenants' limits on its "
                            "own, at the full rate", e.__class__.__name__)
            return None
        if self._down:
            self._down = False
            log.info("budgets: Redis answers again; the tenants' limits are shared again")
        if taken:
            return Refused("", 0.0)
        return Refused(_LIMITS[which], max(0.001, wait_ms / 1000.0))

    def _buckets(self, tenant: TenantConfig) -> list[tuple[str, _Bucket]]:
        out = []
        for limit, per_minute in (("requests_per_minute", tenant.requests_per_minute),
                                  ("tokens_per_minute", tenant.tokens_per_minute)):
            if per_minute:
                key = (tenant.name, limit)
                bucket = self._local.get(key)
                if bucket is None or bucket.rate != per_minute / 60.0 or bucket.cap != bucket.rate * tenant.burst_s:
                    bucket = self._local[key] = _Bucket(per_minute, tenant.burst_s)
                out.append((limit, bucket))
        return out
