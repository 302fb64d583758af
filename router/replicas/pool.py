"""The replica pool: who is there, who is ready, how loaded each one is.

Background tasks check each replica's ``/health`` (then ``/v1/models``) and scrape its
``/metrics``. A replica becomes ready at its first good answer, is ejected after
``health.fail_threshold`` consecutive failures (at once when the connection is refused), and
returns after ``health.rise_threshold`` consecutive good checks. A change of the replica's
process start time (or a counter going backwards) means it restarted with an empty KV cache:
the pool publishes :class:`~router.events.ReplicaRestarted`.

The pool is the only writer of a replica's state. After every change it rebuilds the replica's
:class:`~router.view.ReplicaView` (with no load in it), which the router completes with the load
table's figures for each decision. With several worker processes each worker checks at
``workers`` times the interval, staggered, so a replica sees the configured rate in all.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Literal, Sequence

import orjson

from . import hops, platforms
from .config import HealthConfig, IndexConfig, ProxyConfig, ReplicaConfig
from .events import (EventBus, ReplicaAdded, ReplicaModels, ReplicaReady, ReplicaRemoved, ReplicaRestarted,
                     ReplicaUnready)
from .load import LoadTable
from .memory import FreedMemory
from .metrics import Metrics
from .prefill import PrefillEstimate
from .replica_metrics import ReplicaStats, parse_metrics
from .shared_load import SharedLoad
from .upstream import ConnectFailed, Stalled, UpstreamError, UpstreamPool, UpstreamResponse
from .view import ReplicaView, with_load, with_others

log = logging.getLogger("kvroute.pool")

_DEFAULT_BLOCKS = IndexConfig().default_blocks
_CONTROL_HEADERS = b"user-agent: kvroute-health\r\naccept-encoding: identity\r\n"
_SHARE_EVERY_S = 1.0  # replicas alike share their prefill figures at most this often (see _share_prefill)...
_SHARE_AT_ONCE_UP_TO = 64  # ...on a fleet larger than this; a smaller one shares each sample at once
_MODELS_EVERY = 5  # on a fleet past the control budget, /v1/models is read with one health check in this many
MAX_MODELS = 1024  # model ids kept per replica (a base model and its LoRA adapters); ids past this are ignored
_MAX_ID_CHARS = 1024  # longer model ids are ignored (clients cannot name them either)
_CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission")
_MAX_CARD_BYTES = 4096
_CONTROL_MAX_BYTES = 32 << 20  # a /metrics page larger than this is not a replica's


class _TooLarge(UpstreamError):
    """A health-check or /metrics answer larger than :data:`_CONTROL_MAX_BYTES`."""


class _ThisRouter(UpstreamError):
    """The replica's URL reaches this very router (its answer carries this router's instance id)."""

State = Literal["starting", "ready", "unready"]


class Replica:
    """A replica's configuration and the router's live view of it."""

    def __init__(self, config: ReplicaConfig, upstream: UpstreamPool | None, metrics: Metrics,
                 default_blocks: int = _DEFAULT_BLOCKS, control: UpstreamPool | None = None) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.upstream = upstream  # requests' connections
        self.control = control  # health checks' and scrapes' own, so neither waits on the other
        self.state: State = "starting"
        self.default_blocks = default_blocks  # KV blocks assumed while neither config nor /metrics says
        self.model_cards: dict[str, dict[str, Any]] = {}
        self.models_capped = False  # it listed more than MAX_MODELS (warned once)
        self.loops_back = False  # its URL reaches the router itself (warned once)
        self.progress = -1.0  # its engine's prompt + generated tokens at the last scrape ...
        self.progress_at = time.monotonic()  # ... and when that last changed
        self.models: frozenset[str] = frozenset(config.models)
        self.stats: ReplicaStats | None = None
        self.stats_at: float | None = None
        self.external_load = 0.0
        self.prefill = PrefillEstimate()  # its prefill speed, from its own metrics
        # (rate, seconds per token in a step) averaged over the replicas alike (the same platform, parallel
        # sizes and models), this one included: what routing uses once learned
        self.alike: tuple[float | None, float | None] = (None, None)
        self.prefill_base: ReplicaStats | None = None  # the scrape the next prefill-rate sample counts from
        self.checks = 0  # health checks answered by /health with 200
        self.fails = 0
        self.successes = 0
        self.last_error: str | None = None
        self.restarts = 0
        self.added_at = time.monotonic()  # starting since then (warm-up)
        self.request_failures = 0  # proxied requests that failed in a row
        self.ejections = 0  # times taken out for that, in a row
        self.ejected_until = 0.0
        self.failed_to_start: str | None = None
        # (name, value) pairs (event-source discovery, with httpx), the same as header lines for the rest
        self.upstream_headers: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.api_key.get_secret_value()}"),) if config.api_key else ())
        self.header_lines = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                                     for k, v in self.upstream_headers)
        # metric children resolved once, not per request
        self.m_ttfb = metrics.ttfb.labels(self.name)
        self.m_latency = metrics.latency.labels(self.name)
        self.m_ready = metrics.replica_ready.labels(self.name)
        self.m_ready.set(0)
        metrics.replica_draining.labels(self.name).set(0)
        self.view = self.make_view()

    def make_view(self) -> ReplicaView:
        """This replica as routing sees it, without load (the load table adds that per decision)."""
        cfg = self.config
        return ReplicaView(
            name=self.name, ready=self.ready, models=self.models,
            max_num_seqs=cfg.max_num_seqs, capacity=cfg.capacity, block_size=self.block_size,
            kv_blocks=self.kv_blocks, prefill_rate=self.prefill_rate,
            prefill_marginal_s=min(self.alike[1] or 0.0, 1.0 / self.prefill_rate),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            kv_usage=self.stats.kv_usage if self.stats is not None else 0.0, external_load=self.external_load,
            restarts=self.restarts)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def slots(self) -> int:
        return self.config.max_num_seqs

    @property
    def capacity(self) -> float:
        return self.config.capacity

    @property
    def block_size(self) -> int:
        if self.config.block_size:
            return self.config.block_size
        if self.stats and self.stats.block_size:
            return self.stats.block_size
        return platforms.get(self.config.platform).block_size

    @property
    def kv_blocks(self) -> int:
        if self.config.num_gpu_blocks:
            return self.config.num_gpu_blocks
        if self.stats and self.stats.num_gpu_blocks:
            return self.stats.num_gpu_blocks
        return self.default_blocks

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens per second: as configured, else as its metrics show, else the platform's guess."""
        if self.config.prefill_tokens_per_s is None and self.alike[0] is not None:
            return self.alike[0]
        return self.config.prefill_rate

    @property
    def prefill_rate_source(self) -> str:
        if self.config.prefill_tokens_per_s is not None:
            return "configured"
        if self.alike[0] is None:
            return "platform guess"
        # replicas alike route by one figure; one without samples of its own yet takes theirs
        return "learned from its metrics" if self.prefill.rate is not None else "learned from replicas alike"

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "name": self.name,
            "url": self.config.shown_url,
            "state": self.state,
            "ready": self.ready,
            "models": sorted(self.models),
            "platform": self.config.platform,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "pipeline_parallel_size": self.config.pipeline_parallel_size,
            "max_num_seqs": self.slots,
            "capacity": self.capacity,
            "external_load": self.external_load,
            "block_size": self.block_size,
            "num_gpu_blocks": self.kv_blocks,
            "prefill_tokens_per_s": self.prefill_rate,
            "prefill_rate_source": self.prefill_rate_source,
            "prefill_tokens_per_s_own": self.prefill.rate,  # by its own metrics alone
            # seconds one more queued prompt token adds to a step shared with a new request (None: not told yet)
            "prefill_s_per_token_in_step": self.alike[1],
            "engine": None if s is None else {
                "running": s.running,
                "waiting": s.waiting,
                "kv_cache_usage": s.kv_usage,
                "prefix_cache_hits": s.prefix_hits,
                "prefix_cache_queries": s.prefix_queries,
                "start_time": s.start_time,
                "scraped_at": self.stats_at,
            },
            "failed_to_start": self.failed_to_start,
            "failed_requests_in_a_row": self.request_failures,
            "ejected_for_s": max(0.0, round(self.ejected_until - time.monotonic(), 1)),
            "consecutive_failures": self.fails,
            "consecutive_good_checks": self.successes,  # an unready replica returns at health.rise_threshold
            "last_error": self.last_error,
            "restarts": self.restarts,
        }


def _small_card(card: dict[str, Any]) -> dict[str, Any]:
    """A model card with vLLM's fields only, and only its id, object and root where those weigh too much."""
    out = {k: card[k] for k in _CARD_FIELDS if k in card}
    try:
        weight = len(orjson.dumps(out, default=str))
    except TypeError:  # nested past what a card needs (orjson's 254 levels)
        weight = _MAX_CARD_BYTES + 1
    if weight > _MAX_CARD_BYTES:
        root = card.get("root")
        out = {"id": card["id"], "object": "model",
               "root": root if isinstance(root, str) and len(root) <= _MAX_ID_CHARS else None}
    return out


def _roots(cards: dict[str, dict[str, Any]]) -> tuple[tuple[str, str | None], ...]:
    """(served name, root folder or hub name) of each model card."""
    return tuple(sorted((m, c["root"] if isinstance(c.get("root"), str) else None) for m, c in cards.items()))


class ReplicaPool:
    def __init__(
        self,
        configs: list[ReplicaConfig],
        health: HealthConfig,
        proxy: ProxyConfig,
        metrics: Metrics,
        load: LoadTable,
        events: EventBus | None = None,
        default_blocks: int = _DEFAULT_BLOCKS,
        shared: SharedLoad | None = None,
        instance: str | None = None,
    ) -> None:
        self.instance = instance  # this router's id (router.hops): a replica answering with it is this router
        self.health = health
        self.shared = shared  # the other routers' load on each replica, with a Redis index
        self.load = load
        self.metrics = metrics
        self.events = events or EventBus()
        self.proxy = proxy
        self.default_blocks = default_blocks
        self.replicas: dict[str, Replica] = {}
        for cfg in configs:
            self.replicas[cfg.name] = self._make(cfg)
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self.freed = FreedMemory()
        self._started = False
        self._checked: set[str] = set()  # replicas whose first health check is done
        self._first_round = asyncio.Event()
        self._shared_at: dict[Kind, float] = {}  # kind of replica -> when its prefill figures were last shared
        self._unshared: set[Kind] = set()  # kinds with a sample not shared yet

    def _make(self, cfg: ReplicaConfig) -> Replica:
        upstream = UpstreamPool(cfg.url, self.proxy.connect_timeout_s, self.proxy.upstream_idle_s)
        # health checks and scrapes keep connections apart from the requests', alive between rounds for up to
        # proxy.upstream_idle_s
        control = UpstreamPool(cfg.url, min(self.health.timeout_s, self.proxy.connect_timeout_s),
                               self.proxy.upstream_idle_s)
        return Replica(cfg, upstream, self.metrics, self.default_blocks, control)

    def _spawn(self, r: Replica) -> None:
        self._tasks[r.name] = [asyncio.create_task(self._control_loop(r), name=f"checks:{r.name}")]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start checking every replica, and wait (at most a health-check timeout) for the first round: a
        router, or a new worker beside running ones, does not answer 503 to replicas it has not asked yet."""
        self._started = True
        for r in self.replicas.values():
            self._spawn(r)
        if self.replicas:
            try:
                await asyncio.wait_for(self._first_round.wait(), self.health.timeout_s)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for r in self.replicas.values():
            _close(r)
        await self.freed.close()

    # -- membership (decided by router.membership) ------------------------------------------

    def add(self, cfg: ReplicaConfig) -> Replica:
        """A replica joins: it starts as "starting" and is checked like the configured ones.

        Raises ``ValueError`` for a name in use and :class:`~router.load.TableFull` past
        ``membership.max_replicas``."""
        if cfg.name in self.replicas:
            raise ValueError(f"replica {cfg.name!r} is already in the pool")
        self.load.add(cfg.name)
        r = self.replicas[cfg.name] = self._make(cfg)
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
        self._checked.discard(name)
        _close(r)
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
        figures = self.load.figures
        replicas = self.replicas.values() if names is None else [
            r for r in map(self.replicas.get, names) if r is not None]
        if self.shared is None:
            return [with_load(r.view, *figures(r.name)) for r in replicas]
        others = self.shared.others
        out = []
        for r in replicas:
            v = with_load(r.view, *figures(r.name))
            o = others(r.name)
            out.append(v if o == (0, 0) else with_others(v, *o))
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
        return out

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

    # -- state changes (also driven by the proxy on connection errors) ---------------------

    def mark_failure(self, r: Replica, reason: str, immediate: bool = False) -> None:
        r.successes = 0
        r.fails += 1
        r.last_error = reason
        if r.state == "starting":
            # A replica that never answered is warming up (Gaudi compiles its graphs for minutes before it
            # listens): nothing to report until health.startup_timeout_s has passed.
            waited = time.monotonic() - r.added_at
            if waited >= self.health.startup_timeout_s:
                self._failed_to_start(r, reason, waited)
            return
        if r.state != "ready" or (not immediate and r.fails < self.health.fail_threshold):
            return
        log.warning("replica %s is unready: %s", r.name, reason, extra={"replica": r.name})
        self._take_out(r, reason)

    def _failed_to_start(self, r: Replica, reason: str, waited: float) -> None:
        r.failed_to_start = f"did not become ready within {self.health.startup_timeout_s:g} s (last: {reason})"
        log.warning("replica %s failed to start: not ready %.0f s after it was added (health.startup_timeout_s); "
                    "last check: %s", r.name, waited, reason, extra={"replica": r.name})
        self._take_out(r, r.failed_to_start)

    def _take_out(self, r: Replica, reason: str) -> None:
        """``r`` is unready now: routing stops choosing it, and subscribers hear why."""
        r.state = "unready"
        r.view = r.make_view()
        r.m_ready.set(0)
        self.events.publish(ReplicaUnready(r.name, reason))

    def request_outcome(self, r: Replica, failed: bool, why: str = "") -> None:
        """A proxied request's end on ``r`` (passive outlier detection): ``health.eject_after`` failures in a
        row take it out of rotation for ``health.eject_s`` (doubling if it happens again), even while its
        /health answers 200 (a replica that breaks every stream, or accepts and never answers)."""
        if not failed:
            r.request_failures = 0
            if r.ready and r.ejections and time.monotonic() > r.ejected_until + self.health.eject_s:
                r.ejections = 0  # well for a while: the next ejection starts short again
            return
        r.request_failures += 1
        if r.request_failures < self.health.eject_after or r.state != "ready":
            return
        self._eject(r, f"{self.health.eject_after} requests in a row failed (last: {why})")

    def _eject(self, r: Replica, why: str) -> None:
        """Out of rotation for ``health.eject_s``, doubled each time it goes out again soon after (at most ten
        times that), however its /health answers; ``why`` goes to ``last_error`` and the log."""
        backoff = min(self.health.eject_s * 2 ** r.ejections, 10 * self.health.eject_s)
        r.ejections += 1
        r.ejected_until = time.monotonic() + backoff
        r.request_failures = 0
        r.successes = 0
        r.last_error = f"ejected for {backoff:g} s: {why}"
        self.metrics.replica_ejections.labels(r.name).inc()
        log.warning("replica %s taken out of rotation: %s", r.name, r.last_error, extra={"replica": r.name})
        self._take_out(r, r.last_error)

    def mark_success(self, r: Replica) -> None:
        if r.state == "unready" and time.monotonic() < r.ejected_until:
            return  # ejected: /health answering does not bring it back before its time
        r.fails = 0
        r.successes += 1
        if r.state == "unready" and r.successes < self.health.rise_threshold:
            return  # on its way back: last_error still says why it went out, until it is in rotation again
        r.last_error = None
        if r.state != "ready":
            # a replica seen down and back may be a new process: its /metrics start time tells
            r.state = "ready"
            r.failed_to_start = None
            r.view = r.make_view()
            r.m_ready.set(1)
            log.info("replica %s is ready (models: %s)", r.name, ", ".join(sorted(r.models)) or "-",
                     extra={"replica": r.name})
            self.events.publish(ReplicaReady(r.name))

    def set_drained(self, r: Replica, drained: bool) -> None:
        self.load.set_drained(r.name, drained)
        self.metrics.replica_draining.labels(r.name).set(1 if drained else 0)
        log.info("replica %s %s", r.name, "drained" if drained else "undrained", extra={"replica": r.name})
        if not drained:
            self.events.publish(ReplicaReady(r.name))

    # -- background checks -----------------------------------------------------------------

    async def fetch(self, r: Replica, path: str) -> tuple[int, bytes]:
        """GET ``path`` on the replica's control connection (the one its health checks and scrapes use): status
        and body, all within the health-check timeout. Raises :class:`~router.upstream.UpstreamError` or
        ``TimeoutError``."""
        assert r.control is not None
        timeout = self.health.timeout_s
        async with asyncio.timeout(timeout):
            resp = await r.control.request(b"GET", path, _CONTROL_HEADERS + r.header_lines, b"", timeout)
            if self._is_this_router(resp):
                resp.release()
                raise _ThisRouter("this URL reaches this router itself")
            try:
                body = await resp.read(_CONTROL_MAX_BYTES, timeout)
                if not resp.complete:
                    raise _TooLarge(f"{path} answered more than {_CONTROL_MAX_BYTES} bytes")
            finally:
                resp.release()
        return resp.status, body

    def _is_this_router(self, resp: UpstreamResponse) -> bool:
        """The answer carries this router's own instance id (router.hops)."""
        return self.instance is not None and resp.header(hops.INSTANCE.encode()) == self.instance.encode()

    async def reaches_this_router(self, url: str) -> bool:
        """Whether ``url`` answers as this very router (asked once, within 2 s; unreachable: no)."""
        if self.instance is None:
            return False
        try:
            probe = UpstreamPool(url.rstrip("/"), min(1.0, self.proxy.connect_timeout_s))
        except Exception:  # not a URL it can use: the registration's own checks say why
            return False
        try:
            async with asyncio.timeout(2.0):
                resp = await probe.request(b"GET", "/health", _CONTROL_HEADERS, b"", 2.0)
                try:
                    return self._is_this_router(resp)
                finally:
                    resp.release()
        except (UpstreamError, TimeoutError, OSError):
            return False
        finally:
            probe.close()

    async def check(self, r: Replica) -> None:
        """One health check: /health, then /v1/models (on a large fleet not every time: see :meth:`_models_due`)."""
        try:
            status, _ = await self.fetch(r, "/health")
            if status != 200:
                self.mark_failure(r, f"/health answered {status}")
                return
            r.checks += 1
            if self._models_due(r):
                status, body = await self.fetch(r, "/v1/models")
                if status != 200:
                    self.mark_failure(r, f"/v1/models answered {status}")
                    return
                self._set_models(r, orjson.loads(body))  # at most 1,024 levels deep
        except ConnectFailed as e:
            self.mark_failure(r, f"connection failed: {e}", immediate=True)
            return
        except _ThisRouter as e:
            if not r.loops_back:
                r.loops_back = True
                log.warning("replica %s is this router itself (%s): it is never routed to; remove it", r.name,
                            r.config.shown_url, extra={"replica": r.name})
            self.mark_failure(r, str(e), immediate=True)
            return
        except (UpstreamError, TimeoutError, ValueError) as e:
            self.mark_failure(r, f"health check failed: {e.__class__.__name__}")
            return
        self.mark_success(r)

    def _set_models(self, r: Replica, payload: Any) -> None:
        """What the replica's /v1/models says it serves: at most :data:`MAX_MODELS` ids, each card kept small."""
        cards: dict[str, dict[str, Any]] = {}
        listed = (payload or {}).get("data", []) if isinstance(payload, dict) else []
        for card in listed if isinstance(listed, list) else []:
            if isinstance(card, dict) and isinstance(card.get("id"), str) and 0 < len(card["id"]) <= _MAX_ID_CHARS:
                if len(cards) >= MAX_MODELS:
                    if not r.models_capped:
                        r.models_capped = True
                        log.warning("replica %s lists more than %d models: the rest are ignored", r.name, MAX_MODELS,
                                    extra={"replica": r.name})
                    break
                cards[card["id"]] = _small_card(card)
        roots = _roots(cards)
        changed = roots != _roots(r.model_cards)
        before = self.served_models() if changed else set()
        r.model_cards = cards
        if not r.config.models:
            models = frozenset(cards)
            if models != r.models:
                r.models = models
                r.view = r.make_view()
        if changed:
            self.events.publish(ReplicaModels(r.name, roots))
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

    async def scrape(self, r: Replica) -> None:
        """One scrape of /metrics: engine load, KV usage and size, restarts."""
        self.load.mark_peak(r.name)
        try:
            status, body = await self.fetch(r, "/metrics")
        except (UpstreamError, TimeoutError):
            return  # health checks own the verdict on reachability
        if status != 200:
            return
        stats = parse_metrics(body.decode("utf-8", "replace"))
        prev = r.stats
        restarted = prev is not None and self._restarted(prev, stats)
        if restarted:
            assert prev is not None
            r.restarts += 1
            self.metrics.replica_restarts.labels(r.name).inc()
            log.warning("replica %s restarted (its KV cache is empty)", r.name, extra={"replica": r.name})
            self.events.publish(ReplicaRestarted(r.name, prev.start_time, stats.start_time))
        if self._learn_prefill_rate(r, stats, restarted) or _kind(r) in self._unshared:
            self._share_prefill(r)
        r.stats = stats
        r.stats_at = time.time()
        self._judge_stall(r, stats)
        # The engine's count includes this router's requests. Any of them may have started or ended
        # while the scrape was under way, so subtract the most this router had there meanwhile:
        # what is left is load from other clients (other router instances, direct traffic).
        # With a shared load picture, the other routers' requests are counted apart (live), not as this.
        others = self.shared.others(r.name)[0] if self.shared is not None else 0
        r.external_load = max(0.0, stats.running + stats.waiting - self.load.peak(r.name) - others)
        r.view = r.make_view()
        self.metrics.replica_engine_load.labels(r.name).set(stats.running + stats.waiting)
        self.metrics.replica_kv_usage.labels(r.name).set(stats.kv_usage)

    def _judge_stall(self, r: Replica, stats: ReplicaStats) -> None:
        """A replica that accepts requests and answers none: none of the requests waiting on it answered for
        ``health.stall_s``, and its engine counted no new prompt or output token meanwhile (a long generation
        keeps counting). It goes out like an ejected replica, and the requests waiting on it go elsewhere."""
        now = time.monotonic()
        moved = stats.prompt_tokens + stats.generation_tokens
        if moved != r.progress:
            r.progress, r.progress_at = moved, now
            return
        if r.state != "ready" or r.upstream is None or now - r.progress_at < self.health.stall_s:
            return
        waited = r.upstream.unanswered_for(now)
        if waited < self.health.stall_s:
            return
        self._eject(r, f"stalled: answered none of its requests for {waited:.0f} s and its engine made no progress")
        moved_on = r.upstream.abort_unanswered(Stalled(f"replica {r.name} stalled"))
        log.info("replica %s: %d waiting request(s) sent on to other replicas", r.name, moved_on,
                 extra={"replica": r.name})

    def _share_prefill(self, r: Replica) -> None:
        """Average the prefill figures of the replicas alike ``r`` and hand them to each of them.

        Replicas of one platform, parallel sizes and models prefill at one speed; their estimates differ by
        what each happened to serve (a sample taken while prompts shared steps shows a slower replica).
        Taken one by one, a replica that looked faster drew every new prompt: on the evicting cluster
        benchmark costs of idle twins parted by up to 40%, on real vLLM CPU replicas by up to 60 times."""
        # on a large fleet, a pass over it per kind at most once a second (a sample can come from every scrape of
        # every replica: on a thousand replicas, a pass for each was most of a router's background CPU); a
        # sample in between is shared at the next scrape of one of them after that
        k = _kind(r)
        now = time.monotonic()
        if (len(self.replicas) > _SHARE_AT_ONCE_UP_TO and r.alike[0] is not None
                and now - self._shared_at.get(k, -1e9) < _SHARE_EVERY_S):
            self._unshared.add(k)
            return
        self._unshared.discard(k)
        self._shared_at[k] = now
        if len(self._shared_at) > 4 * len(self.replicas) + 64:  # kinds of replicas long gone
            self._shared_at = {k: now}
            self._unshared &= {k}
        alike = [x for x in self.replicas.values() if _kind(x) == k]
        rates = [x.prefill.rate for x in alike if x.prefill.rate is not None]
        steps = [x.prefill.marginal_s for x in alike if x.prefill.marginal_s is not None]
        shared = (sum(rates) / len(rates) if rates else None, sum(steps) / len(steps) if steps else None)
        for x in alike:
            if x.alike != shared:
                x.alike = shared
                if x is not r:
                    x.view = x.make_view()

    def _learn_prefill_rate(self, r: Replica, stats: ReplicaStats, restarted: bool) -> bool:
        """Feed the replica's prefill estimate with what its counters moved by since an earlier scrape:
        requests, uncached prompt tokens (prompt tokens less prefix-cache hits) and seconds in prefill.
        A scrape with too little in it keeps counting from the same base (see ``router.prefill``). True
        when the estimate took the sample."""
        if "prefill_seconds" not in stats.seen or "prompt_tokens" not in stats.seen:
            return False
        base = r.prefill_base
        if base is None or restarted:
            r.prefill_base = stats
            return False
        requests = stats.prefill_requests - base.prefill_requests
        seconds = stats.prefill_seconds - base.prefill_seconds
        uncached = (stats.prompt_tokens - base.prompt_tokens) - (stats.prefix_hits - base.prefix_hits)
        if requests < 0 or seconds < 0:  # counters went back: a restart the start time did not show
            r.prefill_base = stats
            return False
        first, step_unknown = r.prefill.rate is None, r.prefill.marginal_s is None
        if not r.prefill.add(requests, uncached, seconds):
            return False
        r.prefill_base = stats
        if first and r.config.prefill_tokens_per_s is None:
            log.info("replica %s: prefill at %.0f prompt tokens/s by its metrics (the %s platform's guess was %.0f; "
                     "replicas[].prefill_tokens_per_s sets it)", r.name, r.prefill.rate, r.config.platform,
                     r.config.prefill_rate, extra={"replica": r.name})
        if step_unknown and r.prefill.marginal_s is not None:
            log.info("replica %s: a prompt token adds %.1f us to a scheduler step, beside a fixed %.1f ms per request, "
                     "by its metrics", r.name, r.prefill.marginal_s * 1e6, (r.prefill.fixed_s or 0.0) * 1e3,
                     extra={"replica": r.name})
        return True

    @staticmethod
    def _restarted(prev: ReplicaStats, cur: ReplicaStats) -> bool:
        if prev.start_time is not None and cur.start_time is not None and cur.start_time != prev.start_time:
            return True
        return cur.prefix_queries < prev.prefix_queries  # a counter only goes back when the process is new

    def spacing(self) -> float:
        """How many times the configured intervals apart each replica is checked and scraped now: 1, or more
        where the fleet would otherwise need more than ``health.max_requests_per_s`` control requests a second.
        A health check is two requests (/health, /v1/models) while the fleet fits in that budget; beyond it,
        /v1/models goes with every :data:`_MODELS_EVERY` th check only (see :meth:`_models_due`)."""
        h = self.health
        per_replica = (1.0 + 1.0 / _MODELS_EVERY) / h.interval_s + 1.0 / h.metrics_interval_s
        return max(1.0, len(self.replicas) * per_replica / h.max_requests_per_s)

    def _models_due(self, r: Replica) -> bool:
        """Whether this check of ``r`` also reads /v1/models: always on a fleet within the budget at the
        configured intervals, and for a replica not ready; else every :data:`_MODELS_EVERY` th check."""
        h = self.health
        full = len(self.replicas) * (2.0 / h.interval_s + 1.0 / h.metrics_interval_s)
        return full <= h.max_requests_per_s or not r.ready or r.checks % _MODELS_EVERY == 0

    def _pause(self, interval: float) -> float:
        """Seconds between one worker's checks (or scrapes) of one replica: the workers take turns."""
        return interval * self.load.workers * self.spacing()

    async def _control_loop(self, r: Replica) -> None:
        """Health checks and /metrics scrapes of one replica, one after the other on its control connection
        (one kept-alive connection for both). Every worker checks at start; the next check and scrape come at a
        random point within one pause (staggered by worker), so that a fleet checked at start is not checked in
        one burst ever after, then every pause; each pause follows the fleet's size at the time."""
        h = self.health
        loop = asyncio.get_running_loop()
        offset = lambda interval: random.uniform(0.0, self._pause(interval)) + interval * self.load.worker  # noqa: E731
        now = loop.time()
        next_check = next_scrape = now
        scraped = False
        while True:
            if now >= next_check:
                try:
                    await self.check(r)
                except Exception:  # keep checking whatever happens
                    log.exception("health check of %s crashed", r.name)
                if r.name not in self._checked:
                    self._checked.add(r.name)
                    if len(self._checked) >= len(self.replicas):
                        self._first_round.set()
                    next_check = now + offset(h.interval_s)
                else:
                    next_check = now + self._pause(h.interval_s)
            if now >= next_scrape:
                if r.state != "unready":
                    try:
                        await self.scrape(r)
                    except Exception:
                        log.exception("metrics scrape of %s crashed", r.name)
                if h.metrics_interval_s == h.interval_s:
                    # right after the check, on the connection it left open: a fleet checked less often than the
                    # replicas keep idle connections (5 s in vLLM) opens one connection per round, not two
                    next_scrape = next_check
                else:
                    next_scrape = now + (self._pause(h.metrics_interval_s) if scraped else offset(h.metrics_interval_s))
                scraped = True
            now = loop.time()
            await asyncio.sleep(max(0.0, min(next_check, next_scrape) - now))
            now = loop.time()


Kind = tuple[str, int, int, frozenset[str]]


def _kind(x: Replica) -> Kind:
    """Replicas of one kind prefill at one speed: the same platform, parallel sizes and models."""
    return x.config.platform, x.config.tensor_parallel_size, x.config.pipeline_parallel_size, x.models


def _close(r: Replica) -> None:
    for pool in (r.upstream, r.control):
        if pool is not None:
            pool.close()
