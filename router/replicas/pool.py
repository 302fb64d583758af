"""The replica pool: who is there, who is ready, how loaded each one is.

The pool holds the replicas (:class:`~.record.Replica`) and puts together the parts that keep each one's
record: the checks and scrapes on each replica's control connection (:mod:`.control`, :mod:`.scrape`), shared
with the other routers on one Redis (:mod:`.shared_health`), the verdicts on its state (:mod:`.health`), its
prefill figures (:mod:`.prefill`, :mod:`.learning`) and what it serves (:mod:`.models`). Who joins and leaves is decided by :mod:`.membership`; the pool carries it out.

Routing reads :meth:`ReplicaPool.views`: each replica's view completed with this router's load (and the other
routers', with a shared load picture).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

from ..config import HealthConfig, PredictionConfig, ProxyConfig, ReplicaConfig
from ..replica_events import EventBus, ReplicaAdded, ReplicaModels, ReplicaReady, ReplicaRemoved
from ..load import LoadTable
from ..memory import FreedMemory
from ..metrics import Metrics
from ..shared_load import SharedLoad
from ..store import Store
from ..upstream import UpstreamPool
from ..view import ReplicaView, with_load, with_others
from . import models
from .control import Control, fetch
from .health import Health
from .corrections import Corrections
from .learning import PrefillLearning
from .record import DEFAULT_BLOCKS, Replica
from .scrape import Scraper
from .shared_health import SharedHealth

log = logging.getLogger("kvroute.pool")


class ReplicaPool:
    def __init__(
        self,
        configs: list[ReplicaConfig],
        health: HealthConfig,
        proxy: ProxyConfig,
        metrics: Metrics,
        load: LoadTable,
        events: EventBus | None = None,
        default_blocks: int = DEFAULT_BLOCKS,
        shared: SharedLoad | None = None,
        instance: str | None = None,
        store: Store | None = None,
        router_id: str | None = None,
        prediction: PredictionConfig | None = None,
    ) -> None:
        self.instance = instance  # this router's id (router.hops): a replica answering with it is this router
        self.shared = shared  # the other routers' load on each replica, with a Redis index
        self.load = load
        self.metrics = metrics
        self.events = events or EventBus()
        self.proxy = proxy
        self.default_blocks = default_blocks
        self.replicas: dict[str, Replica] = {}
        self.health = Health(health, metrics, self.events)
        self.prefill = PrefillLearning(self.replicas)
        self.corrections = Corrections(prediction or PredictionConfig(), metrics, self.replicas)  # answers' times against predicted
        self.scraper = Scraper(health.timeout_s, instance, load, shared, metrics, self.events, self.health,
                               self.prefill)
        # with a Redis store, the routers on it share the checks (each replica has one owner among them)
        self.shared_health = SharedHealth(store, router_id or instance or "router", self.replicas, self.health, health,
                                          metrics, self.events) if store is not None and health.shared else None
        self.control = Control(self.replicas, health, proxy, load, self.health, self.set_models, self.scraper.scrape,
                               instance, self.shared_health)
        for cfg in configs:
            self.replicas[cfg.name] = self._make(cfg)
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._background: list[asyncio.Task[None]] = []  # the control budget's measurements, the stall watch
        self.freed = FreedMemory()
        self._started = False

    def _make(self, cfg: ReplicaConfig) -> Replica:
        upstream = UpstreamPool(cfg.url, self.proxy.connect_timeout_s, self.proxy.upstream_idle_s)
        # health checks and scrapes keep connections apart from the requests'
        return Replica(cfg, upstream, self.metrics, self.default_blocks, self.control.connection(cfg.url))

    def _spawn(self, r: Replica) -> None:
        self._tasks[r.name] = [asyncio.create_task(self.control.loop(r), name=f"checks:{r.name}")]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start checking every replica, and wait (at most a health-check timeout) for the first round: a
        router, or a new worker beside running ones, does not answer 503 to replicas it has not asked yet."""
        self._started = True
        if self.shared_health is not None:
            await self.shared_health.start()  # which replicas are this router's to check
        self._background = [asyncio.create_task(self.control.budget.run(), name="control-budget"),
                            asyncio.create_task(self.control.watch(), name="stall-watch")]
        for r in self.replicas.values():
            self._spawn(r)
        if self.replicas:
            try:
                await asyncio.wait_for(self.control.first_round.wait(), self.health.config.timeout_s)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        if self.shared_health is not None:
            await self.shared_health.close()  # the others take this router's replicas at once
        tasks = [t for ts in self._tasks.values() for t in ts]
        tasks += self._background
        self._background = []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for r in self.replicas.values():
            r.close()
        await self.freed.close()

    # -- membership (decided by .membership) ------------------------------------------------

    def add(self, cfg: ReplicaConfig) -> Replica:
        """A replica joins: it starts as "starting" and is checked like the configured ones.

        Raises ``ValueError`` for a name in use and :class:`~router.load.TableFull` past
        ``membership.max_replicas``."""
        if cfg.name in self.replicas:
            raise ValueError(f"replica {cfg.name!r} is already in the pool")
        self.load.add(cfg.name)
        r = self.replicas[cfg.name] = self._make(cfg)
        self.corrections.joined(r)
        if self._started:
            self._spawn(r)
        log.info("replica %s added (%s)", r.name, r.config.shown_url, extra={"replica": r.name})
        self.events.publish(ReplicaAdded(r.name))
        return r

    async def remove(self, name: str) -> None:
        """The replica leaves now (its drain is the caller's): its checks stop, its index entries and
        metric series go."""
        r = self.replicas.get(name)
        if r is None:
            return
        self.events.publish(ReplicaRemoved(name))  # while listeners can still look the replica up
        before = self.served_models()
        tasks = self._tasks.pop(name, [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        del self.replicas[name]
        self.control.forget(name)
        r.close()
        self.load.remove(name)
        self.metrics.forget_replica(name)
        self._forget_models(before)
        log.info("replica %s removed", name, extra={"replica": name})

    # -- queries ---------------------------------------------------------------------------

    def __iter__(self):
        return iter(self.replicas.values())

    def get(self, name: str) -> Replica | None:
        return self.replicas.get(name)

    def views(self, names: Sequence[str] | None = None) -> list[ReplicaView]:
        """Every replica (or those of ``names`` still in the pool) as routing sees it now: its state with this
        host's load (a fresh, immutable list)."""
        load_of = self.load.load_of
        replicas = self.replicas.values() if names is None else [
            r for r in map(self.replicas.get, names) if r is not None]
        if self.shared is None:
            return [with_load(r.view, *load_of(r.name)) for r in replicas]
        others = self.shared.others
        out = []
        for r in replicas:
            v = with_load(r.view, *load_of(r.name))
            o = others(r.name)
            out.append(v if o == (0, 0) else with_others(v, *o))
        return out

    def standings(self) -> list[tuple[float, int, str, frozenset[str], int]]:
        """(load for its capacity, pending prefill tokens, name, models, KV block size) of every ready, undrained
        replica: the figures :meth:`views` gives a ranking by load, read without building a view per replica."""
        load_of = self.load.load_of
        others = self.shared.others if self.shared is not None else None
        out = []
        for r in self.replicas.values():
            v = r.view
            if not v.ready:
                continue
            drained, inflight, pending = load_of(v.name)
            if drained:
                continue
            load = inflight + v.external_load
            if others is not None:
                o_inflight, o_pending = others(v.name)
                load += o_inflight
                pending += o_pending
            out.append((load / v.capacity, pending, v.name, v.models, v.block_size))
        return out

    def view_of(self, name: str) -> ReplicaView | None:
        found = self.views((name,))
        return found[0] if found else None

    def describe(self, r: Replica) -> dict[str, Any]:
        out = r.describe()
        out.update(self.load.describe(r.name))
        others = self.shared.others(r.name) if self.shared is not None else (0, 0)
        out["other_routers_inflight"], out["other_routers_pending_prefill_tokens"] = others
        out["load"] = out["inflight"] + others[0] + r.external_load
        next_check = self.control.next_check_in(r.name)
        out["next_check_in_s"] = None if next_check is None else round(next_check, 1)
        if self.shared_health is not None:  # who checks it: with shared checks, one router at the full rate
            out["checked_by"] = self.shared_health.owner(r.name) if self.shared_health.active else None
            out["checked_here"] = self.shared_health.owns(r)
        return out

    def describe_checks(self) -> dict[str, Any]:
        """Who checks the replicas: this router alone, or the routers sharing the checks (and how many are its)."""
        shared = self.shared_health
        budget = {"budget": self.control.budget.describe(), "spacing": round(self.control.spacing(), 2)}
        if shared is None or not shared.active:
            return {"shared": False, "routers": 1, "router": None, "checked_here": len(self.replicas), **budget}
        return {"shared": True, "routers": shared.routers, "router": shared.id,
                "checked_here": shared.owned, **budget}

    def model_label(self, model: str | None) -> str:
        """``model`` as a metric label: only names a replica serves; any other as "other" (a client's
        made-up names must not grow the metrics)."""
        if not model:
            return ""
        return model if any(model in r.models for r in self.replicas.values()) else "other"

    def ready_models(self) -> dict[str, dict[str, Any]]:
        """Model id -> model card, over the ready replicas."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.replicas.values():
            if not r.ready:
                continue
            for model in sorted(r.models):
                out.setdefault(model, r.model_cards.get(model) or {
                    "id": model, "object": "model", "created": 0, "owned_by": "vllm"})
        return out

    # -- what the replicas serve, their drains --------------------------------------------

    def set_models(self, r: Replica, body: bytes) -> None:
        """What the replica's /v1/models answered (its body) says it serves (see :mod:`.models`)."""
        cards = models.cards_from(r, body)
        listing = models.listing(cards)
        changed = listing != models.listing(r.model_cards)
        before = self.served_models() if changed else set()
        r.model_cards = cards
        if not r.config.models:
            served = frozenset(cards)
            if served != r.models:
                r.models = served
                r.view = r.make_view()
        if changed:
            self.events.publish(ReplicaModels(r.name, listing))
            self._forget_models(before)

    def served_models(self) -> set[str]:
        """Every model some replica serves (ready or not)."""
        out: set[str] = set()
        for r in self.replicas.values():
            out |= r.models
        return out

    def _forget_models(self, before: set[str]) -> None:
        """Models served before and by no replica now: their metric series go (and the memory they held goes
        back to the system: see :mod:`router.memory`)."""
        for model in before - self.served_models():
            self.metrics.forget_model(model)
        self.freed.note()

    def set_drained(self, r: Replica, drained: bool) -> None:
        self.load.set_drained(r.name, drained)
        self.metrics.replica_draining.labels(r.name).set(1 if drained else 0)
        log.info("replica %s %s", r.name, "drained" if drained else "undrained", extra={"replica": r.name})
        if not drained:
            self.events.publish(ReplicaReady(r.name))

    async def fetch(self, r: Replica, path: str) -> tuple[int, bytes]:
        """GET ``path`` on the replica's control connection (the one its health checks and scrapes use)."""
        return await fetch(r, path, self.health.config.timeout_s, self.instance)
