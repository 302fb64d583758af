"""One router process assembled: the components, wired together once (:class:`Gateway`).

The pool, load table, index, prompt keys, policy, admission, router, forwarder, membership and the shared
state of several routers; the HTTP modules (:mod:`router.api`, :mod:`router.admin`, :mod:`router.app`)
and the benchmarks use it as they find it.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from . import hops
from .admission import Admission
from .auth import Auth
from .budgets import Budgets
from .candidates import Candidates
from .config import RouterConfig
from .conversations import Conversations
from .disaggregation import Splitter
from .errors import GatewayError
from .replica_events import EventBus
from .index import PrefixIndex
from .index.fallback import FallbackIndex
from .index.memory import MemoryIndex
from .index.tiered import TieredIndex
from .index.redis import RedisIndex
from .prompt_keys import PromptKeys
from .kv_events.feed import EventFeed
from .kv_events.lease import Lease
from .load import HostShare, LoadTable
from .replicas.membership import Membership
from .metrics import Metrics
from .policy import build_policy
from .replicas import ReplicaPool
from .errors import send_error
from .proxy import Forwarder
from .responses import ResponseHomes, unavailable, unknown
from .routing import Decider
from .sessions import build_sessions
from .shared_conversations import SharedConversations
from .shared_load import SharedLoad, new_host_id
from .store import Store
from .tenants import Tenant, Tenants
from .tracing import Trace, Tracer

log = logging.getLogger("kvroute.api")


class Gateway:
    """The components of one router process: pool, load, index, policy, admission, decider, forwarder."""

    def __init__(self, config: RouterConfig, share: HostShare | None = None, worker: int = 0) -> None:
        self.config = config
        self.metrics = Metrics()
        self.events = EventBus()
        self.policy = build_policy(config.policy, config.cache_aware)
        # several workers share load (router.workers.check vetted the set-up)
        self.load = LoadTable([r.name for r in config.replicas], self.metrics, share, worker,
                              capacity=config.membership.max_replicas)
        # with a Redis index, every piece of shared state lives in one store (router.store)
        self.store = Store(config.index.backend, config.index.namespace, config.index.background_timeout_s) \
            if config.index.backend != "memory" else None
        # who each request is for, and its tenant's limits, shared by the routers on it (router.tenants)
        self.tenants = Tenants(config.tenants, config.tenancy, self.metrics, self.store,
                               config.membership.sync_interval_s, Budgets(self.store, config.index.timeout_s))
        # the routers on it share one load picture (router.shared_load)
        host_id = share.host_id if share is not None else new_host_id()
        self.shared_load: SharedLoad | None = None
        if self.store is not None and config.shared_load.enabled:
            self.shared_load = SharedLoad(self.store, self.load, config.shared_load, host_id, worker,
                                          read_timeout_s=config.index.timeout_s, tenants=self.tenants)
        self.instance = hops.instance_id()
        # ... and the health checks of the replicas (router.replicas.shared_health)
        self.pool = ReplicaPool(config.replicas, config.health, config.proxy, self.metrics, self.load, self.events,
                                default_blocks=config.index.default_blocks, shared=self.shared_load,
                                instance=self.instance, store=self.store, router_id=f"{host_id}.{worker}",
                                prediction=config.prediction)
        index: TieredIndex | None = None
        keys: PromptKeys | None = None
        self.feed: EventFeed | None = None
        if self.policy.uses_prefix:
            keys = PromptKeys(config.prefix, self.events, self.metrics)
            base: PrefixIndex = MemoryIndex() if self.store is None else FallbackIndex(
                RedisIndex(self.store, config.index.timeout_s), MemoryIndex(), config.index, self.metrics)
            index = TieredIndex(base, config.kv_events.provisional_ttl_s, config.kv_events.slow_medium_weight)
            if config.kv_events.enabled:
                lease = None
                if self.store is not None:  # one consumer per replica for every router on this Redis
                    lease = Lease(self.store, config.kv_events.lease_s)
                self.feed = EventFeed(self.pool, index, keys, config.kv_events, self.metrics, self.events, lease)
        conversations = Conversations(config.conversations.window_s, config.conversations.max_tracked,
                                      journal=self.shared_load is not None) if keys else None
        self.admission = Admission(self.policy, self.load, self.pool.views, self.pool.view_of, config.queue,
                                   self.metrics, self.events, share=self.tenants)
        if self.shared_load is not None:
            self.shared_load.on_freed(self.admission.slots_freed, lambda: self.admission.queue_length > 0)
        self.decider = Decider(self.pool, self.load, self.policy, self.admission,
                               build_sessions(config.index, config.sessions, self.metrics, share, self.load,
                                              self.store),
                               self.metrics, self.events,
                               index=index, keys=keys,
                               conversations=conversations,
                               candidates=Candidates(self.pool, config.candidates, index) if index else None,
                               responses=ResponseHomes(build_sessions(config.index, config.sessions, self.metrics,
                                                                      share, self.load, self.store)),
                               shared_load=self.shared_load, slo=config.slo,
                               kv_read_cost=config.cache_aware.kv_read_cost)
        # the other routers hear what this one answered and continued (router.shared_conversations)
        self.shared_conversations: SharedConversations | None = None
        if conversations is not None and self.shared_load is not None:
            assert self.store is not None
            self.shared_conversations = SharedConversations(self.store, conversations, self.load,
                                                            config.shared_load, self.shared_load.id)
        self.tracer = Tracer(config.tracing)  # spans per request, when an OTLP endpoint is configured
        self.forwarder = Forwarder(self.decider, self.pool, config.proxy, self.metrics, config.client.send_timeout_s,
                                   Splitter(self.pool, config.disaggregation, self.events), self.tracer)
        self.membership = Membership(config, self.pool, self.store)
        self.auth = Auth(config.auth, self.tenants.knows_key)
        self.started = time.time()
        self.stopping = False  # SIGTERM came: /ready answers 503 while the listener is still open
        self._ready_polls: collections.deque[float] = collections.deque(maxlen=8)

    def ready_polled(self) -> None:
        self._ready_polls.append(time.monotonic())

    def unready_period(self) -> float:
        """Seconds /ready should answer 503 before the listener closes, so that whoever polls it (a load
        balancer) stops sending requests first: two of its polling intervals, or 0 if nothing polls."""
        if self.config.shutdown_unready_s is not None:
            return self.config.shutdown_unready_s
        polls = list(self._ready_polls)
        if len(polls) < 3 or time.monotonic() - polls[-1] > 60:
            return 0.0
        gaps = sorted(b - a for a, b in zip(polls, polls[1:]))
        return min(30.0, 2 * gaps[len(gaps) // 2])

    def admit(self, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, Tenant]:
        """A client request's checks before its body is read: its key, its tenant, and that it has not been here
        before. Returns the ``x-kvroute-via`` line to send on and the tenant; raises :class:`GatewayError`."""
        token = self.auth.check_client(headers)
        tenant = self.tenants.identify(headers, token)
        return hops.via_line(headers, self.instance), tenant

    async def reject(self, send: Any, e: GatewayError, path: str, request_id: str, trace: Trace | None = None,
                     started: float = 0.0) -> None:
        """Answer a request refused before any replica saw it: counted, logged, traced, and the error sent."""
        self.metrics.requests.labels("", "none", str(e.status)).inc()
        if trace is not None:
            self.tracer.export(trace, started, time.perf_counter(), e.status,
                               {"url.path": path, "kvroute.request_id": request_id, "kvroute.outcome": e.code})
        log.info("%s rejected: %d %s", path, e.status, e.code,
                 extra={"request_id": request_id, "status": e.status, "outcome": e.code})
        await send_error(send, e, request_id)

    async def response_home(self, response_id: str) -> str:
        """The ready replica holding stored response ``response_id``; raises a 404 that says why there is none."""
        home = await self.decider.responses.home(response_id) if self.decider.responses is not None else None
        if home is None:
            raise unknown(response_id)
        replica = self.pool.get(home)
        if replica is None or not replica.view.ready:
            raise unavailable(response_id, home)
        return home

    def single_model(self) -> str | None:
        models: set[str] = set()
        for r in self.pool:
            models |= r.models
        return next(iter(models)) if len(models) == 1 else None
