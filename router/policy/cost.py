"""The cache-aware cost: a replica's predicted time to first token for a request, as a scorer
(``predicted-ttft``, the ``cache-aware`` preset). Its terms are documented on :class:`PredictedTTFTScorer`."""

from __future__ import annotations

from typing import NamedTuple

from ..config import CacheAwareConfig
from ..request import RouteRequest
from ..view import ReplicaView
from .predict import prefill_terms
from .stages import Scorer, register_scorer


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
    recompute_s: float  # computing again what another replica holds
    stall_s: float  # the requests running there, held up while it computes its prompt


@register_scorer("predicted-ttft")
class PredictedTTFTScorer(Scorer):
    """Prefers the replica expected to produce the first token soonest.

    cost (seconds) = (uncached prompt tokens + queued prefill that will not fit in its step) / prefill rate
                   + queued prefill that fits in its step x seconds a token adds to a step
                   + evict_weight x (uncached whole blocks beyond the free part of its cache) / prefill rate
                   + load_weight_tokens / prefill rate (or load_weight_s) x load / max_num_seqs
                   + the same x returning_weight x requests its waiting conversations are expected to send
                     (both x (1 + the further turns a conversation sends, at most turns_ahead_max) for a prompt
                     that holds no earlier prompt's end: it may start one)
                   + kv_weight_s x (KV cache usage above kv_threshold, scaled to 0..1)
                   + occupancy_weight_tokens / prefill rate (or occupancy_weight_s)
                     x share of its KV blocks the index holds (if the prompt adds a block)
                   - session_bonus_s if it served this session last
                   + recompute_weight x (prompt tokens another replica holds cached that it lacks) / prefill rate,
                     for a prompt that holds its own history; for one that shares a prefix with others, the same
                     x prefill_recompute_weight on a split request's prefill, else nothing
                   + stall_weight x load x (uncached prompt tokens beyond one step's max_num_batched_tokens)
                     / prefill rate
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
        prefill, shared_step = prefill_terms(req, view, cfg.kv_read_cost)
        # the model's own prefill, not the line its answers showed (router.policy.predict): weighed by each
        # replica's slope (or by that over its kind's), noise between replicas alike moved prompts off their
        # cache on the CPU profile (hit rate 0.74-0.77 against 0.82-0.86 with the model alone)
        missing = req.missing(view.name)
        pending = view.pending_prefill
        # the index holds a prompt's blocks once they are computed: blocks taken by prompts still in prefill
        # there are in use too, not room (without them a busy replica looks like the emptiest)
        cache_tokens = view.kv_blocks * view.block_size
        occupancy = min(1.0, req.occupancy.get(view.name, 0.0) + pending / cache_tokens)
        stored = missing - missing % view.block_size  # the whole blocks it adds to the cache (about)
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
        if req.turns_ahead and cfg.turns_ahead_max:
            # a prompt that may start a conversation: its later turns stay where it starts (the recompute term)
            # and meet the load there, while what it finds cached there (a shared system prompt) saves prefill
            # once; weighed per turn alone, a burst of new conversations piled on that prompt's first holder
            # (multi-turn at 23.8 requests/s: TTFT p90 170-200 ms, p99 0.8-1.1 s, two replicas unused)
            per_seq *= 1.0 + min(req.turns_ahead, cfg.turns_ahead_max)
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
        recompute = 0.0
        held_elsewhere = req.best_cached - req.cached.get(view.name, 0)
        if held_elsewhere > 0 and req.phase != "decode":
            # the fleet pays for a prompt's own history computed twice: prefill others wait for, and a second copy
            # in cache. Not for a prefix many prompts share: a copy of it on each replica is how their load spreads
            # (weighed alike, conversations under one system prompt piled on its first holder: multi-turn hit
            # rate 0.70-0.74 against 0.78-0.79, TTFT p90 268-387 ms against 112-133).
            # But on a prefill replica the copy is the whole cost to others: all it does is prefill, so every request
            # queued there waits for it. Weighed by this request's time alone, a shared prefix was copied whenever its
            # holder had a prompt or two queued: up to one prompt in 16 computed 8,192 tokens again, and with the
            # prompts queued behind those they made the p90 (disaggregated benchmark at 70% load, eleven runs: hit
            # rate 0.624-0.663 against 0.665, TTFT p90 802-1,526 ms against 799-872 in eleven runs with the term)
            weight = cfg.recompute_weight if req.extends_earlier else \
                cfg.prefill_recompute_weight if req.phase == "prefill" else 0.0
            recompute = weight * held_elsewhere / view.prefill_rate
        stall = 0.0
        beyond = missing - view.max_num_batched_tokens
        if cfg.stall_weight and beyond > 0 and req.phase != "decode" and view.role != "prefill":
            # the steps that compute its prompt decode the streams running there too: one step's worth delays each
            # of their tokens once, a longer prompt step after step, and those are the inter-token latency tail
            # (a replayed trace's 100,000-token first turns; a prefill replica decodes none)
            stall = cfg.stall_weight * view.load * beyond / view.prefill_rate
        return prefill, shared_step, evict, load, kv, occupied, session, returning, recompute, stall

    def explain(self, req: RouteRequest, view: ReplicaView) -> dict[str, float]:
        terms = self.terms(req, view)
        return {"cost_s": max(0.0, sum(terms)), **terms._asdict()}

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return 1.0 / (1.0 + self.cost(req, view))
