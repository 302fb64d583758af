"""Who a request is for: its tenant, that tenant's class and weight, and its requests in flight.

A request's bearer key names its tenant (the first of ``tenants[]`` listing that key); the ``tenancy.header``
may name another of the key's tenants, or one without keys. A request that names none is for the ``default``
tenant (class ``tenancy.default_class``, no limits, unless ``tenants[]`` defines it). Only tenants defined in
the configuration or through the admin API exist: a client cannot make new ones, so tenant names are bounded
(they are metric labels).

The admin API's changes go to the shared store (``NS:tenants``: name -> settings, keys as SHA-256 digests
only, or a tombstone) and every router reads them every ``membership.sync_interval_s``; they win over the
configuration's entry of the same name.

Requests in flight per tenant, and the tokens each was given slots for lately (its usage: a sum that decays
with a time constant of ``tenancy.fair_share_window_s``), are this module's: counted here, published with the
shared load picture (:mod:`router.shared_load`) so that ``max_concurrent`` and the fair share of the router
queue (:mod:`router.admission`) hold across routers, and read back from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, Awaitable, Callable

from . import errors
from .auth import digest
from .background import Background
from .budgets import Budgets
from .config import ConfigError, TenancyConfig, TenantConfig
from .config.tenants import CLASSES, DEFAULT_TENANT, tenant_from
from .metrics import Metrics
from .request import RouteRequest
from .store import RedisError, Store

log = logging.getLogger("kvroute.tenants")

MAX_TENANTS = 4096  # tenants the admin API may define (each is a metric label)
_MAX_NAME_BYTES = 64


class StoreUnavailable(Exception):
    """The shared store did not take an admin change (nothing changed)."""


class Tenant:
    """One tenant as routing uses it: its settings, class rank (0 is the most urgent) and key digests."""

    __slots__ = ("cfg", "name", "klass", "rank", "weight", "digests")

    def __init__(self, cfg: TenantConfig, digests: tuple[bytes, ...] | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.klass = cfg.klass
        self.rank = CLASSES.index(cfg.klass)
        self.weight = cfg.weight
        self.digests = digests if digests is not None else tuple(digest(k.get_secret_value()) for k in cfg.keys)


class Tenants:
    """The tenants, by name and by key digest; the requests each has in flight here and on the other routers."""

    def __init__(self, tenants: list[TenantConfig], tenancy: TenancyConfig, metrics: Metrics,
                 store: Store | None = None, sync_interval_s: float = 2.0, budgets: Budgets | None = None) -> None:
        self.tenancy = tenancy
        self.budgets = budgets or Budgets()
        self.header = tenancy.header.encode() if tenancy.header else None
        self.metrics = metrics
        self._configured = {t.name: Tenant(t) for t in tenants}
        self._shared: dict[str, Tenant | None] = {}  # from the store: None removes a configured one
        self._by_name: dict[str, Tenant] = {}
        self._by_key: dict[bytes, list[Tenant]] = {}
        # the other routers' requests in flight, usage and requests waiting, per tenant
        self._others: dict[str, tuple[int, int, int]] = {}
        self._waiting: dict[str, int] = {}  # this router's queue, per tenant
        self._usage: dict[str, tuple[float, float]] = {}  # tenant -> (its usage here, monotonic time of it)
        self._tau = tenancy.fair_share_window_s
        self.default = Tenant(TenantConfig(name=DEFAULT_TENANT, klass=tenancy.default_class))
        self._rebuild()
        self._inflight: dict[str, int] = {}
        self._touched: set[str] = set()
        self.redis = store.client if store is not None else None
        self.key = store.keys.tenants() if store is not None else ""
        self._sync_interval = sync_interval_s
        self._background = Background()

    # -- who a request is for -------------------------------------------------------------------

    def identify(self, headers: list[tuple[bytes, bytes]], token: bytes | None) -> Tenant:
        """The tenant of a request with these headers and bearer ``token``; raises 403 for a named tenant that
        does not exist or that the key may not use (the name is not echoed)."""
        named = None
        if self.header is not None:
            for k, v in headers:
                if k == self.header:
                    named = v
                    break
        mine = self._by_key.get(digest(token), ()) if token and self._by_key else ()  # no hash where no keys
        if named is None or not named:
            return mine[0] if mine else self.default
        tenant = self._by_name.get(named.decode("latin-1")) if len(named) <= _MAX_NAME_BYTES else None
        if tenant is None or (tenant.digests and tenant not in mine):
            raise errors.forbidden(f"the tenant named in {self.tenancy.header} does not exist or this key may not "
                                   "use it")
        return tenant

    def knows_key(self, token: bytes) -> bool:
        """Whether ``token`` is one of the tenants' keys (a client key, beside auth.api_keys)."""
        return bool(self._by_key) and digest(token) in self._by_key

    @property
    def has_keys(self) -> bool:
        return bool(self._by_key)

    def get(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def __iter__(self) -> Any:
        return iter(list(self._by_name.values()))

    # -- admission: its limits ----------------------------------------------------------------

    async def enter(self, tenant: Tenant, req: RouteRequest, prompt_tokens: Callable[[], Awaitable[int]]) -> int:
        """Let a request of ``tenant`` in: its place in the queue set on ``req``, its limits checked and taken
        (429 :class:`~router.errors.GatewayError` naming the limit otherwise), one more in flight. Returns the
        prompt tokens taken from its token bucket (``prompt_tokens`` is asked only where it has one)."""
        cfg = tenant.cfg
        req.tenant, req.rank, req.weight = tenant.name, tenant.rank, tenant.weight
        if cfg.max_concurrent is not None and self.inflight(tenant.name) >= cfg.max_concurrent:
            self._count(tenant, "max_concurrent")
            raise errors.over_limit(1.0, "max_concurrent", tenant.name)
        taken = 0
        if cfg.limited:
            taken = await prompt_tokens() if cfg.tokens_per_minute else 0
            refused = await self.budgets.take(cfg, taken)
            if refused is not None:
                self._count(tenant, refused.limit)
                raise errors.over_limit(refused.retry_after_s, refused.limit, tenant.name)
        self.start(tenant)
        self._count(tenant, "admitted")
        return taken

    def leave(self, tenant: Tenant, taken: int, prompt_tokens: int, completion_tokens: int) -> None:
        """A request let in by :meth:`enter` ended: one fewer in flight; the tokens it used are counted (those
        not taken at its start from its tenant's bucket now)."""
        self.end(tenant)
        if prompt_tokens:
            self.metrics.child(self.metrics.tenant_tokens, tenant.name, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.metrics.child(self.metrics.tenant_tokens, tenant.name, "completion").inc(completion_tokens)
        if tenant.cfg.tokens_per_minute:
            self.budgets.spend(tenant.cfg, prompt_tokens - taken + completion_tokens)

    def _count(self, tenant: Tenant, outcome: str) -> None:
        self.metrics.child(self.metrics.tenant_requests, tenant.name, tenant.klass, outcome).inc()

    # -- requests in flight -------------------------------------------------------------------

    def inflight(self, name: str) -> int:
        """``name``'s requests in flight, on this router and (as last read) on the others."""
        return self._inflight.get(name, 0) + self._others.get(name, (0, 0, 0))[0]

    # -- fair share (router.admission's FairShare) ----------------------------------------------

    def _own_usage(self, name: str, now: float) -> float:
        value, at = self._usage.get(name, (0.0, now))
        return value * math.exp((at - now) / self._tau)

    def usage(self, tenant: str) -> float:
        """Tokens ``tenant`` was given slots for lately (decaying), by this router and the others."""
        return self._own_usage(tenant, time.monotonic()) + self._others.get(tenant, (0, 0, 0))[1]

    def waiting(self, tenant: str, n: int) -> None:
        """``n`` requests of ``tenant`` wait in this router's queue now."""
        if n:
            self._waiting[tenant] = n
        else:
            self._waiting.pop(tenant, None)
        self._touched.add(tenant)

    def waiting_elsewhere(self) -> list[tuple[int, str, float]]:
        """(class rank, name, weight) of the tenants with requests in the other routers' queues."""
        out = []
        for name, (_, _, waiting) in self._others.items():
            tenant = self._by_name.get(name)
            if waiting and tenant is not None:
                out.append((tenant.rank, name, tenant.weight))
        return out

    def charge(self, tenant: str, tokens: float) -> None:
        if tenant not in self._by_name:
            return  # removed while it waited
        now = time.monotonic()
        self._usage[tenant] = (self._own_usage(tenant, now) + tokens, now)
        self._touched.add(tenant)

    def start(self, tenant: Tenant) -> None:
        """One more request of ``tenant`` in flight."""
        n = self._inflight[tenant.name] = self._inflight.get(tenant.name, 0) + 1
        self._touched.add(tenant.name)
        self.metrics.child(self.metrics.tenant_inflight, tenant.name).set(n)

    def end(self, tenant: Tenant) -> None:
        n = self._inflight.get(tenant.name, 0) - 1
        if n <= 0:
            self._inflight.pop(tenant.name, None)
        else:
            self._inflight[tenant.name] = n
        self._touched.add(tenant.name)
        self.metrics.child(self.metrics.tenant_inflight, tenant.name).set(max(0, n))

    # the shared load picture's side (router.shared_load): this router's figures out, the others' in
    def take_touched(self) -> set[str]:
        touched, self._touched = self._touched, set()
        return touched

    def own(self, name: str) -> tuple[int, int, int]:
        """This router's requests in flight, usage (whole tokens) and requests waiting in its queue of ``name``."""
        return (self._inflight.get(name, 0), round(self._own_usage(name, time.monotonic())),
                self._waiting.get(name, 0))

    @property
    def names(self) -> list[str]:
        return list(self._inflight.keys() | self._usage.keys() | self._waiting.keys())

    def set_others(self, others: dict[str, tuple[int, int, int]]) -> None:
        self._others = {name: n for name, n in others.items() if name in self._by_name}

    # -- changes (the admin API) ----------------------------------------------------------------

    async def put(self, data: Any, name: str) -> TenantConfig:
        """Define or replace tenant ``name`` from an admin request's body; shared through the store."""
        if not isinstance(data, dict):
            raise ConfigError("invalid tenant:\n  body: expected an object with the tenants[] fields")
        cfg = tenant_from({**data, "name": name}, f"tenant {name}")
        if cfg.name not in self._by_name and len(self._by_name) >= MAX_TENANTS:
            raise ConfigError(f"no room for another tenant: at most {MAX_TENANTS}")
        tenant = Tenant(cfg)
        if self.redis is not None:
            await self._write(name, _record(tenant))
        self._shared[name] = tenant
        self._rebuild()
        log.info("tenant %s set: class %s, weight %g", name, cfg.klass, cfg.weight)
        return cfg

    async def remove(self, name: str) -> bool:
        """Remove tenant ``name`` (its requests are the default tenant's from now on); False if there is none."""
        if name not in self._by_name:
            return False
        if self.redis is not None:
            await self._write(name, "null")
        self._shared[name] = None
        self._rebuild()
        log.info("tenant %s removed", name)
        return True

    def describe(self) -> list[dict[str, Any]]:
        return [{**t.cfg.shown(), "inflight": self.inflight(t.name)} for t in self._by_name.values()]

    # -- the shared store ---------------------------------------------------------------------

    async def start_sync(self) -> None:
        if self.redis is not None:
            await self._sync()
            self._background.spawn(self._loop())

    async def close(self) -> None:
        await self._background.close()
        await self.budgets.close()

    async def _write(self, name: str, record: str) -> None:
        assert self.redis is not None
        try:
            async with asyncio.timeout(2.0):
                await self.redis.execute("HSET", self.key, name, record)
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(f"the shared store did not take the change ({e.__class__.__name__}); every router "
                              "reads tenants from it: try again") from None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._sync_interval)
            await self._sync()

    async def _sync(self) -> None:
        assert self.redis is not None
        try:
            async with asyncio.timeout(2.0):
                flat = await self.redis.execute("HGETALL", self.key)
        except (RedisError, OSError, TimeoutError) as e:
            log.debug("tenants: Redis did not answer (%s)", e)
            return
        shared: dict[str, Tenant | None] = {}
        for i in range(0, len(flat) - 1, 2):
            name = flat[i].decode("utf-8", "replace")
            try:
                shared[name] = _from_record(name, flat[i + 1])
            except (ValueError, ConfigError) as e:
                log.warning("tenants: ignoring tenant %s in Redis: %s", errors.shown(name, 64), e)
        if len(shared) > MAX_TENANTS:
            shared = dict(list(shared.items())[:MAX_TENANTS])
        if _fingerprint(shared) != _fingerprint(self._shared):
            self._shared = shared
            self._rebuild()

    def _rebuild(self) -> None:
        by_name = dict(self._configured)
        for name, tenant in self._shared.items():
            if tenant is None:
                by_name.pop(name, None)
            else:
                by_name[name] = tenant
        if DEFAULT_TENANT in by_name:
            self.default = by_name[DEFAULT_TENANT]
        else:
            self.default = Tenant(TenantConfig(name=DEFAULT_TENANT, klass=self.tenancy.default_class))
            by_name[DEFAULT_TENANT] = self.default
        by_key: dict[bytes, list[Tenant]] = {}
        for tenant in by_name.values():
            for d in tenant.digests:
                by_key.setdefault(d, []).append(tenant)
        self._by_name, self._by_key = by_name, by_key
        for gone in [name for name in self._usage if name not in by_name]:
            del self._usage[gone]


def _record(tenant: Tenant) -> str:
    """A tenant as the store keeps it: its settings, and its keys as SHA-256 digests (never the keys)."""
    return json.dumps({**tenant.cfg.model_dump(by_alias=True, exclude={"keys"}),
                       "key_digests": [d.hex() for d in tenant.digests]}, separators=(",", ":"))


def _from_record(name: str, raw: bytes) -> Tenant | None:
    data = json.loads(raw)
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError("not an object")
    digests = tuple(bytes.fromhex(h) for h in data.pop("key_digests", []) if isinstance(h, str))
    cfg = tenant_from({**data, "name": name}, f"tenant {name}")
    return Tenant(cfg, digests)


def _fingerprint(shared: dict[str, Tenant | None]) -> dict[str, Any]:
    return {name: None if t is None else (t.cfg.model_dump(by_alias=True, exclude={"keys"}), t.digests)
            for name, t in shared.items()}
