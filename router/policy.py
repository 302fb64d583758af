"""The routing stage: filters narrow the replicas, scorers rate the rest, a picker chooses.

Every filter, scorer and picker is a small object that can be tested on its own; a policy is
just an ordered list of filters, weighted scorers and a picker. The score of a replica is
``sum(weight * scorer(replica))`` with every scorer in [0, 1]; ties are broken at random, so
equally good replicas share cold traffic instead of the first one in the list taking it all.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence

from .config import CacheAwareConfig
from .pool import Replica

if TYPE_CHECKING:
    from .prefix import PromptKey

# Why a filter left no replica: each maps to a different answer to the client.
Empty = Literal["no_ready", "unknown_model", "drained", "tried", "at_capacity"]


@dataclass
class RouteRequest:
    """What the routing stage knows of a request."""

    model: str | None
    request_id: str
    endpoint: str
    session_id: str | None = None
    exclude: set[str] = field(default_factory=set)
    key: "PromptKey | None" = None
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)  # predicted cached tokens per replica name
    occupancy: dict[str, float] = field(default_factory=dict)  # share of each replica's KV blocks indexed
    index_fallback: bool = False
    session_replica: str | None = None

    def uncached(self, replica: str) -> int:
        """Prompt tokens ``replica`` would have to prefill (as the prefix index predicts)."""
        return max(0, self.prompt_tokens - self.cached.get(replica, 0))


@dataclass
class Decision:
    replica: Replica
    reason: str
    score: float


class NoCandidate(Exception):
    def __init__(self, why: Empty) -> None:
        super().__init__(why)
        self.why = why


# -- filters -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filter:
    name: str
    keep: Callable[[RouteRequest, Replica], bool]
    when_empty: Empty

    def __call__(self, req: RouteRequest, replicas: Sequence[Replica]) -> list[Replica]:
        keep = self.keep
        return [r for r in replicas if keep(req, r)]


READY = Filter("ready", lambda req, r: r.ready, "no_ready")
SERVES_MODEL = Filter("serves-model", lambda req, r: req.model is None or req.model in r.models, "unknown_model")
NOT_DRAINED = Filter("not-drained", lambda req, r: not r.drained, "drained")
NOT_TRIED = Filter("not-tried", lambda req, r: r.name not in req.exclude, "tried")
BELOW_CAPACITY = Filter("below-capacity", lambda req, r: r.inflight < r.slots, "at_capacity")

DEFAULT_FILTERS: tuple[Filter, ...] = (READY, SERVES_MODEL, NOT_DRAINED, NOT_TRIED, BELOW_CAPACITY)


# -- scorers -------------------------------------------------------------------------------


class Scorer(Protocol):
    name: str

    def __call__(self, req: RouteRequest, replica: Replica) -> float:
        """A rating in [0, 1]; higher is better."""
        ...


class LoadScorer:
    """Prefers the replica with the lowest load relative to its capacity.

    Load is this router's in-flight requests plus the other traffic the replica reported at the
    last scrape; capacity grows with ``max_num_seqs`` and the speed of the parallel group.
    """

    name = "load"

    def __call__(self, req: RouteRequest, replica: Replica) -> float:
        return 1.0 / (1.0 + replica.load / replica.capacity)


class PredictedTTFTScorer:
    """Prefers the replica expected to produce the first token soonest.

    cost (seconds) = (uncached prompt tokens + queued prefill that will not fit in its step) / prefill rate
                   + evict_weight x (uncached tokens beyond the free part of its cache) / prefill rate
                   + load_weight_s x load / max_num_seqs
                   + kv_weight_s x (KV cache usage above kv_threshold, scaled to 0..1)
                   + occupancy_weight_s x share of its KV blocks the index holds
                   - session_bonus_s if it served this session last
    score = 1 / (1 + cost). Uncached tokens come from the prefix index (``req.cached``).
    """

    name = "predicted-ttft"

    def __init__(self, cfg: CacheAwareConfig) -> None:
        self.cfg = cfg

    def cost(self, req: RouteRequest, replica: Replica) -> float:
        uncached = req.uncached(replica.name)
        # vLLM prefills several requests in one scheduler step (chunked prefill): only queued prefill
        # that does not fit in a step beside this request's own delays it
        pending = replica.pending_prefill
        queued = min(pending, max(0, pending + uncached - replica.config.max_num_batched_tokens))
        cost = (uncached + queued) / replica.prefill_rate
        occupancy = req.occupancy.get(replica.name, 0.0)
        if self.cfg.evict_weight and uncached:
            # what does not fit in the free part of its cache pushes out cached prefixes, which their
            # owners will have to prefill again: a small shared prefix should not pull new prompts onto
            # a full replica while others have room
            free = (1.0 - occupancy) * replica.kv_blocks * replica.block_size
            cost += self.cfg.evict_weight * max(0.0, uncached - free) / replica.prefill_rate
        cost += self.cfg.load_weight_s * replica.load / replica.slots
        if replica.stats is not None and replica.stats.kv_usage > self.cfg.kv_threshold:
            # only a nearly full cache delays a new request (vLLM queues or preempts then); below
            # that, a scrape up to an interval old would only steer prefixes away from their cache
            over = (replica.stats.kv_usage - self.cfg.kv_threshold) / (1.0 - self.cfg.kv_threshold)
            cost += self.cfg.kv_weight_s * min(1.0, over)
        cost += self.cfg.occupancy_weight_s * occupancy
        if req.session_replica is not None and req.session_replica == replica.name:
            cost -= self.cfg.session_bonus_s
        return max(0.0, cost)

    def __call__(self, req: RouteRequest, replica: Replica) -> float:
        return 1.0 / (1.0 + self.cost(req, replica))


# -- pickers -------------------------------------------------------------------------------


class Picker(Protocol):
    name: str

    def __call__(self, req: RouteRequest, scored: list[tuple[Replica, float]]) -> tuple[Replica, float]: ...


class MaxScorePicker:
    """The best score wins; equal best scores are broken at random."""

    name = "max-score"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def __call__(self, req: RouteRequest, scored: list[tuple[Replica, float]]) -> tuple[Replica, float]:
        best = max(s for _, s in scored)
        top = [pair for pair in scored if best - pair[1] <= 1e-12]
        return top[0] if len(top) == 1 else self._rng.choice(top)


class RoundRobinPicker:
    """Takes the candidates in turn, whatever their scores."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, req: RouteRequest, scored: list[tuple[Replica, float]]) -> tuple[Replica, float]:
        ordered = sorted(scored, key=lambda pair: pair[0].name)
        return ordered[next(self._turn) % len(ordered)]


# -- policies ------------------------------------------------------------------------------


class Policy:
    def __init__(
        self,
        name: str,
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        filters: Sequence[Filter] = DEFAULT_FILTERS,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker

    def candidates(self, req: RouteRequest, replicas: Sequence[Replica]) -> list[Replica]:
        """Run the filters; raise :class:`NoCandidate` naming the first one that left nobody."""
        current = list(replicas)
        for f in self.filters:
            current = f(req, current)
            if not current:
                raise NoCandidate(f.when_empty)
        return current

    def score(self, req: RouteRequest, replica: Replica) -> float:
        return sum(w * s(req, replica) for s, w in self.scorers)

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        cands = self.candidates(req, replicas)
        scored = [(r, self.score(req, r)) for r in cands]
        replica, score = self.picker(req, scored)
        return Decision(replica, self.name, score)


def build_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> Policy:
    if name == "cache-aware":
        return Policy(name, [(PredictedTTFTScorer(cache_aware or CacheAwareConfig()), 1.0)], MaxScorePicker())
    if name == "least-loaded":
        return Policy(name, [(LoadScorer(), 1.0)], MaxScorePicker())
    if name == "round-robin":
        return Policy(name, [], RoundRobinPicker())
    raise ValueError(f"unknown policy {name!r}")
