"""The routing stage: filters narrow the replicas, scorers rate the rest, a picker chooses.

Every filter, scorer and picker is a small class registered by name; a policy is an ordered list
of filters, weighted scorers and a picker, built from the configuration (``policy:`` a preset
name, or ``{filters, scorers, picker}``). The score of a replica is ``sum(weight x scorer)``
with every scorer in [0, 1]. They all read a request (:class:`~router.request.RouteRequest`) and
immutable replica views (:class:`~router.view.ReplicaView`), never live objects.

Adding a scorer is one class and one registration::

    @register_scorer("fewest-waiting")
    class FewestWaiting(Scorer):
        def __call__(self, req, view):
            return 1.0 / (1.0 + view.external_load)

A plug-in outside this package is named ``module:Class`` in the configuration. A stage with
parameters declares them as a pydantic model ``Params``; the configuration entry's other keys
are validated against it and the stage is built as ``Class(params)``.
"""

from __future__ import annotations

import importlib
import itertools
import random
from typing import Any, Callable, ClassVar, Literal, NamedTuple, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import POLICIES, CacheAwareConfig, ConfigError, PolicyConfig, StageConfig
from .request import RouteRequest
from .view import ReplicaView

# Why a filter left no replica: each maps to a different answer to the client.
Empty = Literal["no_ready", "unknown_model", "drained", "tried", "at_capacity"]

Scored = tuple[ReplicaView, float]


class NoCandidate(Exception):
    def __init__(self, why: Empty) -> None:
        super().__init__(why)
        self.why = why


class Stage:
    """Base of filters, scorers and pickers: a name, and optional parameters (a pydantic model)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel] | None] = None

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params


class Filter(Stage):
    when_empty: ClassVar[Empty] = "no_ready"  # what the client is told when this filter leaves nobody

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        raise NotImplementedError

    def __call__(self, req: RouteRequest, views: Sequence[ReplicaView]) -> list[ReplicaView]:
        keep = self.keep
        return [v for v in views if keep(req, v)]


class Scorer(Stage):
    uses_prefix: ClassVar[bool] = False  # reads req.cached / req.occupancy: the router must look the prompt up

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        """A rating in [0, 1]; higher is better."""
        raise NotImplementedError

    def explain(self, req: RouteRequest, view: ReplicaView) -> dict[str, float] | None:
        """What the rating is made of, for an operator asking why (``POST /admin/explain/...``); None: nothing
        beyond the rating."""
        return None


class Picker(Stage):
    def __call__(self, req: RouteRequest, scored: list[Scored]) -> Scored:
        raise NotImplementedError

    def tied(self, scored: list[Scored]) -> list[Scored]:
        """The candidates this picker counts as best (it takes one of them)."""
        return _best(scored)


FILTERS: dict[str, type[Filter]] = {}
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}

S = TypeVar("S", bound=type[Stage])


def _registrar(table: dict[str, Any], name: str) -> Callable[[S], S]:
    def register(cls: S) -> S:
        cls.name = name
        table[name] = cls
        return cls
    return register


def register_filter(name: str) -> Callable[[S], S]:
    return _registrar(FILTERS, name)


def register_scorer(name: str) -> Callable[[S], S]:
    return _registrar(SCORERS, name)


def register_picker(name: str) -> Callable[[S], S]:
    return _registrar(PICKERS, name)


# -- filters -------------------------------------------------------------------------------


@register_filter("ready")
class Ready(Filter):
    when_empty = "no_ready"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return view.ready


@register_filter("serves-model")
class ServesModel(Filter):
    when_empty = "unknown_model"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return req.model is None or req.model in view.models


@register_filter("not-drained")
class NotDrained(Filter):
    when_empty = "drained"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return not view.drained


@register_filter("not-tried")
class NotTried(Filter):
    """Retries never go back to a replica that failed this request, unless it restarted since."""

    when_empty = "tried"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        tried = req.exclude.get(view.name)
        return tried is None or view.restarts > tried  # a replica that restarted since is a new process


@register_filter("below-capacity")
class BelowCapacity(Filter):
    """Fewer of this host's requests in flight than ``max_num_seqs``."""

    when_empty = "at_capacity"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return view.inflight < view.max_num_seqs


DEFAULT_FILTERS = ("ready", "serves-model", "not-drained", "not-tried", "below-capacity")


# -- scorers -------------------------------------------------------------------------------


@register_scorer("load")
class LoadScorer(Scorer):
    """Prefers the replica with the lowest load relative to its capacity.

    Load is this host's in-flight requests plus the other traffic the replica reported at the
    last scrape; capacity grows with ``max_num_seqs`` and the speed of the parallel group.
    """

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return 1.0 / (1.0 + view.load / view.capacity)


@register_scorer("session")
class SessionScorer(Scorer):
    """1 for the replica that served the request's ``x-session-id`` last, else 0."""

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return 1.0 if req.session_replica is not None and req.session_replica == view.name else 0.0


@register_scorer("kv-usage")
class KVUsageScorer(Scorer):
    """Prefers the replica with the most free KV cache at the last scrape."""

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return max(0.0, 1.0 - view.kv_usage)


@register_scorer("prefix")
class PrefixScorer(Scorer):
    """The share of the prompt predicted to be in the replica's prefix cache."""

    uses_prefix = True

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return req.cached.get(view.name, 0) / req.prompt_tokens if req.prompt_tokens else 0.0


def _seconds(fixed_s: float | None, tokens: float, view: ReplicaView) -> float:
    """A weight set in fixed seconds, else the time ``view`` takes to prefill ``tokens`` prompt tokens."""
    return fixed_s if fixed_s is not None else tokens / view.prefill_rate


class CostTerms(NamedTuple):
    """The parts of a replica's predicted-TTFT cost, in seconds (see :class:`PredictedTTFTScorer`)."""

    prefill_s: float  # its uncached prompt tokens, and queued prefill that waits for earlier steps
    shared_step_s: float  # queued prefill that shares this request's step
    evict_s: float
    load_s: float
    kv_s: float
    occupancy_s: float
    session_s: float  # 0, or minus the bonus for the session's last replica
    returning_s: float  # conversations between turns, expected back


@register_scorer("predicted-ttft")
class PredictedTTFTScorer(Scorer):
    """Prefers the replica expected to produce the first token soonest.

    cost (seconds) = (uncached prompt tokens + queued prefill that will not fit in its step) / prefill rate
                   + queued prefill that fits in its step x seconds a token adds to a step
                   + evict_weight x (uncached whole blocks beyond the free part of its cache) / prefill rate
                   + load_weight_tokens / prefill rate (or load_weight_s) x load / max_num_seqs
                   + the same x returning_weight x requests its waiting conversations are expected to send
                   + kv_weight_s x (KV cache usage above kv_threshold, scaled to 0..1)
                   + occupancy_weight_tokens / prefill rate (or occupancy_weight_s)
                     x share of its KV blocks the index holds (if the prompt adds a block)
                   - session_bonus_s if it served this session last
    score = 1 / (1 + cost), each term one field of :class:`CostTerms`. Uncached tokens come from the prefix
    index (``req.cached``). Its
    parameters default to the ``cache_aware`` section of the configuration.
    """

    Params = CacheAwareConfig
    uses_prefix = True

    def __init__(self, params: CacheAwareConfig | None = None) -> None:
        super().__init__(params)
        self.cfg = params or CacheAwareConfig()

    def cost(self, req: RouteRequest, view: ReplicaView) -> float:
        return max(0.0, sum(self._terms(req, view)))

    def terms(self, req: RouteRequest, view: ReplicaView) -> CostTerms:
        return CostTerms(*self._terms(req, view))

    def _terms(self, req: RouteRequest, view: ReplicaView) -> tuple[float, ...]:
        """The terms in :class:`CostTerms` order, as a plain tuple (the hot path sums them)."""
        cfg = self.cfg
        uncached = req.uncached(view.name)
        # vLLM prefills several requests in one scheduler step (chunked prefill): queued prefill that
        # does not fit in a step beside this request's own waits for earlier steps; what fits lengthens
        # the shared step by the time its tokens add to a step (nothing while that is not known)
        pending = view.pending_prefill
        queued = min(pending, max(0, pending + uncached - view.max_num_batched_tokens))
        prefill = (uncached + queued) / view.prefill_rate
        shared_step = (pending - queued) * view.prefill_marginal_s
        # the index holds a prompt's blocks once they are computed: blocks taken by prompts still in prefill
        # there are in use too, not room (without them a busy replica looks like the emptiest)
        cache_tokens = view.kv_blocks * view.block_size
        occupancy = min(1.0, req.occupancy.get(view.name, 0.0) + pending / cache_tokens)
        stored = uncached - uncached % view.block_size  # the whole blocks it adds to the cache (about)
        evict = 0.0
        if cfg.evict_weight and stored:
            # what does not fit in the free part of its cache pushes out cached prefixes, which their
            # owners will have to prefill again: a small shared prefix should not pull new prompts onto
            # a full replica while others have room
            free = (1.0 - occupancy) * cache_tokens
            evict = cfg.evict_weight * max(0.0, stored - free) / view.prefill_rate
        # a queue weighs against cache hits in one unit: seconds of this replica's prefill. In fixed
        # seconds it was too light where prefill is slow (a 70B model on Gaudi 2: a 1,024-token system prompt
        # is worth 0.13 s, and conversations piled on the replica that held it) or too heavy where it is fast
        per_seq = _seconds(cfg.load_weight_s, cfg.load_weight_tokens, view) / view.max_num_seqs
        load = per_seq * view.load
        # conversations between turns will be back, with histories that need its cache: placing new ones
        # by the requests in flight alone piles a burst of them on whichever replica is quickest that moment
        returning = per_seq * cfg.returning_weight * req.returning.get(view.name, 0.0)
        kv = 0.0
        if view.kv_usage > cfg.kv_threshold:
            # only a nearly full cache delays a new request (vLLM queues or preempts then); below
            # that, a scrape up to an interval old would only steer prefixes away from their cache
            over = (view.kv_usage - cfg.kv_threshold) / (1.0 - cfg.kv_threshold)
            kv = cfg.kv_weight_s * min(1.0, over)
        occupied = 0.0
        if stored:  # a prompt that adds no block to the cache evicts nothing
            # in the same unit as the hits too: as a fixed 0.1 s it was 3,000 tokens' prefill on replicas that
            # prefill 30,000 tokens/s, and moved conversations off their cache as it filled
            occupied = _seconds(cfg.occupancy_weight_s, cfg.occupancy_weight_tokens, view) * occupancy
        session = 0.0
        if req.session_replica is not None and req.session_replica == view.name:
            session = -cfg.session_bonus_s
        return prefill, shared_step, evict, load, kv, occupied, session, returning

    def explain(self, req: RouteRequest, view: ReplicaView) -> dict[str, float]:
        terms = self.terms(req, view)
        return {"cost_s": max(0.0, sum(terms)), **terms._asdict()}

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return 1.0 / (1.0 + self.cost(req, view))


# -- pickers -------------------------------------------------------------------------------


def _best(scored: list[Scored]) -> list[Scored]:
    best = max(s for _, s in scored)
    return [pair for pair in scored if best - pair[1] <= 1e-12]


class MaxScoreParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tie_tolerance: float = Field(0.0, ge=0, lt=1, description="scores within this share of the best count as tied")


@register_picker("max-score")
class MaxScorePicker(Picker):
    """The best score wins. Tied scores (within ``tie_tolerance`` of the best, as a share of it) go to
    the one this picker chose least recently, so cold prompts on idle replicas take turns instead of
    landing by chance (random picks put 1.3 times the mean on one of 8 replicas in 336 requests);
    never by list order: replicas not chosen yet are taken in random order."""

    Params = MaxScoreParams

    def __init__(self, params: MaxScoreParams | None = None, rng: random.Random | None = None) -> None:
        super().__init__(params)
        self.tolerance = params.tie_tolerance if params is not None else 0.0
        self._rng = rng or random.Random()
        self._turn = itertools.count()
        self._chosen: dict[str, float] = {}  # replica name -> turn it was last chosen at

    def tied(self, scored: list[Scored]) -> list[Scored]:
        best = max(s for _, s in scored)
        floor = best - max(1e-12, self.tolerance * abs(best))
        return [pair for pair in scored if pair[1] >= floor]

    def __call__(self, req: RouteRequest, scored: list[Scored]) -> Scored:
        if len(scored) == 1:
            pick = scored[0]
        else:
            tied = self.tied(scored)
            if len(tied) == 1:
                pick = tied[0]
            else:
                chosen, rng = self._chosen, self._rng
                pick = min(tied, key=lambda pair: (chosen.get(pair[0].name, -1.0), rng.random()))
        if len(self._chosen) > 4096:  # names of replicas long gone
            self._chosen.clear()
        self._chosen[pick[0].name] = next(self._turn)
        return pick


@register_picker("round-robin")
class RoundRobinPicker(Picker):
    """Takes the best-scored candidates in turn, in name order (all of them when no scorer is set)."""

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self._turn = itertools.count()

    def __call__(self, req: RouteRequest, scored: list[Scored]) -> Scored:
        ordered = sorted(_best(scored), key=lambda pair: pair[0].name)
        return ordered[next(self._turn) % len(ordered)]


# -- policies ------------------------------------------------------------------------------


class Policy:
    def __init__(self, name: str, scorers: Sequence[tuple[Scorer, float]], picker: Picker,
                 filters: Sequence[Filter] | None = None) -> None:
        self.name = name
        self.filters = tuple(filters) if filters is not None else tuple(FILTERS[f]() for f in DEFAULT_FILTERS)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.uses_prefix = any(s.uses_prefix for s, _ in self.scorers)
        # filters that judge each replica alone can run in one pass; one that looks at the whole list cannot
        self._keeps = tuple(f.keep for f in self.filters) if all(
            type(f).__call__ is Filter.__call__ for f in self.filters) else None

    def candidates(self, req: RouteRequest, views: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Run the filters; raise :class:`NoCandidate` naming the first one that left nobody.

        A request pinned to a replica (it names a response stored there) is weighed on that replica alone.
        """
        if req.pinned is not None:
            views = [v for v in views if v.name == req.pinned]
        keeps = self._keeps
        if keeps is not None:
            # one pass over the replicas with every filter (the common case: someone is left)...
            current = [v for v in views if all(keep(req, v) for keep in keeps)]
            if current:
                return current
        # ...and filter by filter only to tell which one left nobody
        current = list(views)
        for f in self.filters:
            current = f(req, current)
            if not current:
                raise NoCandidate(f.when_empty)
        return current  # a filter that keeps a replica alone but drops it among others

    def score(self, req: RouteRequest, view: ReplicaView) -> float:
        return sum(w * s(req, view) for s, w in self.scorers)

    def explain(self, req: RouteRequest, views: Sequence[ReplicaView]) -> dict[str, Any]:
        """What :meth:`choose` would weigh for ``req``, without choosing (a picker keeps turns): each
        replica left out with the filter that left it out, each candidate with its score, each scorer's
        rating and weight and what the rating is made of, best first, and the best-scored ones."""
        filtered: list[dict[str, str]] = []
        candidates: list[dict[str, Any]] = []
        scored: list[Scored] = []
        for v in views:
            dropped = next((f.name for f in self.filters if not f(req, [v])), None)
            if dropped is not None:
                filtered.append({"replica": v.name, "filter": dropped})
                continue
            scorers = []
            for s, w in self.scorers:
                entry: dict[str, Any] = {"name": s.name, "weight": w, "score": s(req, v)}
                parts = s.explain(req, v)
                if parts is not None:
                    entry.update(parts)
                scorers.append(entry)
            scored.append((v, sum(e["weight"] * e["score"] for e in scorers)))  # as score() adds them
            candidates.append({"replica": v.name, "score": scored[-1][1],
                               "cached_tokens": req.cached.get(v.name, 0), "load": v.load,
                               "pending_prefill": v.pending_prefill, "returning": req.returning.get(v.name, 0.0),
                               "scorers": scorers})
        candidates.sort(key=lambda c: -c["score"])
        best = sorted(v.name for v, _ in self.picker.tied(scored)) if scored else []
        return {"policy": self.name, "picker": self.picker.name, "best": best, "candidates": candidates,
                "filtered": filtered}

    def choose(self, req: RouteRequest, views: Sequence[ReplicaView]) -> Scored:
        cands = self.candidates(req, views)
        scorers = self.scorers
        if len(scorers) == 1:
            s, w = scorers[0]
            scored = [(v, w * s(req, v)) for v in cands]
        else:
            scored = [(v, sum(w * s(req, v) for s, w in scorers)) for v in cands]
        return self.picker(req, scored)


# -- building from the configuration -------------------------------------------------------

PRESETS: dict[str, PolicyConfig] = {
    # costs within about a millisecond (0.1% of 1 + cost seconds) are ties: an index's occupancy differing by
    # a block or two should not decide where a cold prompt goes, taking turns should
    "cache-aware": PolicyConfig(scorers=[StageConfig(name="predicted-ttft")],
                                picker=StageConfig(name="max-score", tie_tolerance=0.001)),
    "least-loaded": PolicyConfig(scorers=[StageConfig(name="load"), StageConfig(name="session")]),
    "round-robin": PolicyConfig(scorers=[StageConfig(name="session")], picker="round-robin"),
}
assert set(PRESETS) == set(POLICIES)


def _resolve(table: dict[str, Any], base: type[Stage], what: str, field: str, name: str) -> type[Stage]:
    cls = table.get(name)
    if cls is not None:
        return cls
    if ":" in name:  # a plug-in: module:Class
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"invalid configuration:\n  {field}: cannot load {what} {name!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"invalid configuration:\n  {field}: {name!r} is not a {what} "
                              f"(subclass router.policy.{base.__name__})")
        return cls
    known = ", ".join(sorted(table))
    raise ConfigError(f"invalid configuration:\n  {field}: unknown {what} {name!r}; known: {known}, "
                      "or module:Class for a plug-in")


def _build(table: dict[str, Any], base: type[Stage], what: str, field: str, spec: str | StageConfig,
           defaults: dict[str, dict[str, Any]]) -> Any:
    if isinstance(spec, str):
        spec = StageConfig(name=spec)
    cls = _resolve(table, base, what, f"{field}.name", spec.name)
    params = spec.params
    if cls.Params is None:
        if params:
            raise ConfigError(f"invalid configuration:\n  {field}: {what} {spec.name!r} takes no parameters "
                              f"(got {', '.join(sorted(params))})")
        return cls()
    try:
        return cls(cls.Params.model_validate({**defaults.get(cls.name, {}), **params}))
    except ValidationError as e:
        lines = [f"  {field}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def build_policy(spec: str | PolicyConfig = "cache-aware", cache_aware: CacheAwareConfig | None = None) -> Policy:
    """A preset by name, or a pipeline from ``{filters, scorers, picker}``.

    Raises :class:`~router.config.ConfigError` naming the field of an unknown stage or a bad parameter.
    """
    name = spec if isinstance(spec, str) else "custom"
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"invalid configuration:\n  policy: unknown policy {spec!r}; "
                              f"choose one of: {', '.join(POLICIES)}")
        spec = PRESETS[spec]
    defaults = {"predicted-ttft": (cache_aware or CacheAwareConfig()).model_dump()}
    filters = None if spec.filters is None else [
        _build(FILTERS, Filter, "filter", f"policy.filters.{i}", f, defaults) for i, f in enumerate(spec.filters)]
    scorers = [(_build(SCORERS, Scorer, "scorer", f"policy.scorers.{i}", s, defaults), s.weight)
               for i, s in enumerate(spec.scorers)]
    picker = _build(PICKERS, Picker, "picker", "policy.picker", spec.picker, defaults)
    return Policy(name, scorers, picker, filters)
