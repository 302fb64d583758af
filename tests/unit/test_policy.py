"""The routing stage piece by piece: filters, scorers and pickers on plain replica views, and policies."""

import collections
import random

import pytest

from router import platforms
from router.config import CacheAwareConfig, ConfigError, PolicyConfig, ReplicaConfig
from router.metrics import Metrics
from router.policy import (BelowCapacity, KVUsageScorer, LoadScorer, MaxScorePicker, NoCandidate,
                           PredictedTTFTScorer, RoundRobinPicker, SessionScorer, build_policy)
from router.request import RouteRequest
from router.view import ReplicaView


def view(name, inflight=0, ready=True, models=("m",), drained=False, pending=0, kv_usage=0.0, external=0.0,
         **cfg):
    """A replica as a filter or scorer sees it, from literals (capacity and rates as the config derives them)."""
    c = ReplicaConfig(name=name, url=f"http://{name}:8000", **cfg)
    return ReplicaView(name=name, ready=ready, drained=drained, models=frozenset(models),
                       max_num_seqs=c.max_num_seqs, capacity=c.capacity,
                       block_size=c.block_size or platforms.get(c.platform).block_size,
                       kv_blocks=c.num_gpu_blocks or 16384, prefill_rate=c.prefill_rate,
                       max_num_batched_tokens=c.max_num_batched_tokens, kv_usage=kv_usage,
                       external_load=external, inflight=inflight, pending_prefill=pending)


def req(model="m", exclude=(), session=None, prompt=0, cached=None, occupancy=None, returning=None, extends=False,
        turns_ahead=0.0):
    r = RouteRequest(model=model, request_id="r", endpoint="/v1/completions",
                     exclude=exclude if isinstance(exclude, dict) else dict.fromkeys(exclude, 0))
    r.session_replica = session
    r.prompt_tokens, r.cached, r.occupancy = prompt, dict(cached or {}), dict(occupancy or {})
    r.best_cached = max(r.cached.values(), default=0)
    r.returning = dict(returning or {})
    r.extends_earlier = extends
    r.turns_ahead = turns_ahead
    return r


# -- filters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("views, model, why", [
    ([], "m", "no_ready"),
    ([view("a", ready=False)], "m", "no_ready"),
    ([view("a", models=("x",))], "m", "unknown_model"),
    ([view("a", drained=True)], "m", "drained"),
    ([view("a", inflight=2, max_num_seqs=2)], "m", "at_capacity"),
])
def test_filters_say_why_nobody_is_left(views, model, why):
    with pytest.raises(NoCandidate) as e:
        build_policy("least-loaded").candidates(req(model), views)
    assert e.value.why == why


def test_a_tried_replica_that_restarted_since_may_be_tried_again():
    views = [view("a")._replace(restarts=1), view("b")]
    assert sorted(v.name for v in build_policy("least-loaded").candidates(req(exclude={"a": 0}), views)) == ["a", "b"]
    assert [v.name for v in build_policy("least-loaded").candidates(req(exclude={"a": 1}), views)] == ["b"]


def test_tried_replicas_are_excluded():
    views = [view("a"), view("b")]
    assert [v.name for v in build_policy("least-loaded").candidates(req(exclude={"a"}), views)] == ["b"]


def test_below_capacity_keeps_replicas_with_a_free_slot():
    views = [view("a", inflight=3, max_num_seqs=4), view("b", inflight=4, max_num_seqs=4)]
    assert [v.name for v in BelowCapacity()(req(), views)] == ["a"]


# -- scorers ---------------------------------------------------------------------------------


def test_load_score_falls_with_load_and_rises_with_capacity():
    s = LoadScorer()
    assert s(req(), view("a", inflight=0)) > s(req(), view("b", inflight=5))
    tp1 = view("tp1", inflight=8, platform="gaudi2", tensor_parallel_size=1)
    tp8 = view("tp8", inflight=8, platform="gaudi2", tensor_parallel_size=8)
    assert s(req(), tp8) > s(req(), tp1)
    assert 0 < s(req(), tp1) <= 1


def test_session_scorer_rates_only_the_sessions_replica():
    s = SessionScorer()
    assert (s(req(session="b"), view("a")), s(req(session="b"), view("b")), s(req(), view("b"))) == (0.0, 1.0, 0.0)


def test_kv_usage_scorer_prefers_free_cache():
    s = KVUsageScorer()
    assert s(req(), view("a", kv_usage=0.2)) > s(req(), view("b", kv_usage=0.9))


def cost(v, cached=0, prompt=1024, returning=None, **cfg):
    r = req(prompt=prompt, cached={v.name: cached}, returning=returning)
    return PredictedTTFTScorer(CacheAwareConfig(**cfg)).cost(r, v)


def test_kv_usage_costs_nothing_until_the_cache_is_nearly_full():
    base = cost(view("a", prefill_tokens_per_s=1000))
    assert cost(view("a", prefill_tokens_per_s=1000, kv_usage=0.85)) == base
    assert cost(view("a", prefill_tokens_per_s=1000, kv_usage=0.95)) == pytest.approx(base + 0.25)
    assert cost(view("a", prefill_tokens_per_s=1000, kv_usage=1.0)) == pytest.approx(base + 0.5)


def test_cached_prefix_lowers_the_cost_by_its_prefill_time():
    v = view("a", prefill_tokens_per_s=1000)
    assert cost(v, cached=0) - cost(v, cached=768) == pytest.approx(0.768)


def test_a_split_requests_decode_costs_reading_what_it_lacks_a_sixteenth_of_computing_it():
    v = view("a", prefill_tokens_per_s=1000)
    scorer = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0, evict_weight=0))
    costs = {}
    for cached in (0, 768):
        r = req(prompt=1024, cached={"a": cached})
        r.phase = "decode"
        costs[cached] = scorer.cost(r, v)
    assert costs[0] - costs[768] == pytest.approx(0.768 / 16)  # the decode replica holding more is preferred


def test_eviction_cost_counts_only_what_does_not_fit():
    v = view("a", prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100)
    r = req(prompt=1030, occupancy={"a": 0.5})  # 64 whole blocks (1024 tokens) stored, 800 tokens free: 224 evict
    with_evict = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0, evict_weight=1)).cost(r, v)
    without = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0, evict_weight=0)).cost(r, v)
    assert with_evict - without == pytest.approx(0.224)
    default = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0)).cost(r, v)
    assert default - without == pytest.approx(3 * 0.224)  # evict_weight 3: the tokens pushed out, and their return


def test_requests_in_flight_cost_the_time_the_replica_takes_to_prefill_load_weight_tokens():
    def load_cost(rate, **cfg):
        return (cost(view("a", prefill_tokens_per_s=rate, max_num_seqs=256, inflight=64), **cfg)
                - cost(view("a", prefill_tokens_per_s=rate, max_num_seqs=256), **cfg))
    # a quarter of its capacity in flight: a quarter of 32,000 tokens' prefill
    assert (load_cost(8000), load_cost(32000)) == (pytest.approx(1.0), pytest.approx(0.25))
    assert load_cost(8000, load_weight_s=2.0) == load_cost(32000, load_weight_s=2.0) == pytest.approx(0.5)


def test_a_conversation_waiting_between_turns_weighs_like_a_request_in_flight():
    def weight(**cfg):
        return (cost(view("a", prefill_tokens_per_s=8000, max_num_seqs=256), returning={"a": 64}, **cfg)
                - cost(view("a", prefill_tokens_per_s=8000, max_num_seqs=256), **cfg))
    in_flight = (cost(view("a", prefill_tokens_per_s=8000, max_num_seqs=256, inflight=64))
                 - cost(view("a", prefill_tokens_per_s=8000, max_num_seqs=256)))
    assert weight() == pytest.approx(in_flight) == pytest.approx(1.0)
    assert weight(returning_weight=0.5) == pytest.approx(0.5)
    assert weight(returning_weight=0) == 0


def test_a_prompt_that_may_start_a_conversation_weighs_load_once_per_turn_it_is_expected_to_send():
    busy = view("a", prefill_tokens_per_s=8000, max_num_seqs=256, inflight=64)
    idle = view("a", prefill_tokens_per_s=8000, max_num_seqs=256)

    def load_cost(turns_ahead=0.0, cfg=None):
        scorer = PredictedTTFTScorer(CacheAwareConfig(**(cfg or {})))
        r = req(prompt=1024, turns_ahead=turns_ahead)
        return scorer.cost(r, busy) - scorer.cost(r, idle)
    once = load_cost()
    assert load_cost(turns_ahead=3.0) == pytest.approx(4 * once)  # its own turn, and three more
    assert load_cost(turns_ahead=20.0) == pytest.approx(9 * once)  # at most turns_ahead_max (8) more
    assert load_cost(turns_ahead=3.0, cfg={"turns_ahead_max": 0}) == pytest.approx(once)


def test_turns_ahead_weigh_waiting_conversations_too():
    def returning_s(turns_ahead):
        r = req(returning={"a": 4}, turns_ahead=turns_ahead)
        return PredictedTTFTScorer(CacheAwareConfig()).explain(r, view("a", prefill_tokens_per_s=8000))["returning_s"]
    assert returning_s(1.0) == pytest.approx(2 * returning_s(0.0)) != 0


def test_computing_again_what_another_replica_holds_costs_recompute_weight_times_its_prefill():
    r = req(prompt=4096, cached={"holder": 3072, "other": 1024}, extends=True)  # its own history
    parts = {n: PredictedTTFTScorer(CacheAwareConfig(recompute_weight=3)).explain(r, view(n, prefill_tokens_per_s=1000))
             for n in ("holder", "other", "cold")}
    assert parts["holder"]["recompute_s"] == 0
    assert parts["other"]["recompute_s"] == pytest.approx(3 * 2.048)  # 2,048 tokens the holder has, 3 times
    assert parts["cold"]["recompute_s"] == pytest.approx(3 * 3.072)
    off = PredictedTTFTScorer(CacheAwareConfig(recompute_weight=0)).explain(r, view("other", prefill_tokens_per_s=1000))
    assert off["recompute_s"] == 0


def test_a_prefix_many_prompts_share_costs_nothing_to_compute_again_on_another_replica():
    # a prompt that holds no earlier prompt's end: what another replica holds is a shared system prompt, and a
    # copy of it on each replica is how the prompts under it spread
    r = req(prompt=4096, cached={"holder": 3072, "other": 1024})
    scorer = PredictedTTFTScorer(CacheAwareConfig(recompute_weight=3))
    assert scorer.explain(r, view("other", prefill_tokens_per_s=1000))["recompute_s"] == 0


def test_a_split_requests_prefill_pays_prefill_recompute_weight_for_a_shared_prefix_held_elsewhere():
    # on a prefill replica a copy of a shared system prompt is time every request queued behind it waits
    r = req(prompt=12_288, cached={"holder": 8192, "other": 0})
    r.phase = "prefill"
    scorer = PredictedTTFTScorer(CacheAwareConfig(recompute_weight=3, prefill_recompute_weight=0.5))
    parts = {n: scorer.explain(r, view(n, prefill_tokens_per_s=1000)) for n in ("holder", "other")}
    assert parts["holder"]["recompute_s"] == 0
    assert parts["other"]["recompute_s"] == pytest.approx(0.5 * 8.192)
    off = PredictedTTFTScorer(CacheAwareConfig(prefill_recompute_weight=0)).explain(r, view("other",
                                                                                           prefill_tokens_per_s=1000))
    assert off["recompute_s"] == 0


def test_a_split_requests_prefill_of_its_own_history_is_priced_by_recompute_weight_alone():
    r = req(prompt=4096, cached={"holder": 3072, "other": 0}, extends=True)
    r.phase = "prefill"
    off = PredictedTTFTScorer(CacheAwareConfig(recompute_weight=0, prefill_recompute_weight=5))
    assert off.explain(r, view("other", prefill_tokens_per_s=1000))["recompute_s"] == 0


def test_a_split_requests_prefill_stays_with_the_holder_of_its_shared_prefix_until_its_queue_outweighs_the_copy():
    # 8,192 tokens held by one replica; the other would compute them again. Alone, the request's own time says
    # move once the holder's queue beyond its step passes 8,192 tokens; the copy's cost to others doubles that
    r = req(prompt=12_288, cached={"holder": 8192, "idle": 0})
    r.phase = "prefill"

    def pick(queued, weight=1.0):
        scorer = PredictedTTFTScorer(CacheAwareConfig(prefill_recompute_weight=weight))
        views = [view("holder", pending=queued, prefill_tokens_per_s=10_000, max_num_batched_tokens=8192),
                 view("idle", prefill_tokens_per_s=10_000, max_num_batched_tokens=8192)]
        return max(views, key=lambda v: scorer(r, v)).name

    assert pick(12_288) == "holder"  # three prompts' questions queued there
    assert pick(12_288, weight=0) == "idle"  # by its own time alone a tie, lost on the holder's fuller cache
    assert pick(24_576) == "idle"


def test_a_prompt_longer_than_a_step_costs_stall_weight_times_the_rest_of_its_prefill_per_request_running_there():
    r = req(prompt=10_240, cached={"holder": 8192})
    scorer = PredictedTTFTScorer(CacheAwareConfig(stall_weight=0.5))
    stall = {n: scorer.explain(r, view(n, inflight=k, prefill_tokens_per_s=1000, max_num_batched_tokens=2048))["stall_s"]
             for n, k in (("holder", 4), ("busy", 4), ("idle", 0))}
    assert stall["busy"] == pytest.approx(0.5 * 4 * 8.192)  # 10,240 tokens, all but one step's 2,048, 4 held up
    assert stall["holder"] == 0  # the 2,048 it computes there fit in one step: each stream waits a step once
    assert stall["idle"] == 0


def test_a_long_first_prompt_goes_where_fewer_streams_decode_at_equal_queues():
    r = req(prompt=100_000)
    views = [view(name, inflight=k, prefill_tokens_per_s=10_000, max_num_batched_tokens=8192)
             for name, k in (("crowded", 12), ("quiet", 2))]
    scorer = PredictedTTFTScorer(CacheAwareConfig(stall_weight=0.3))
    assert max(views, key=lambda v: scorer(r, v)).name == "quiet"
    crowded, quiet = (scorer.explain(r, v)["stall_s"] for v in views)
    assert crowded - quiet == pytest.approx(0.3 * 10 * 9.1808)  # 10 more streams, held up 9.2 s past the first step


def test_a_prefill_replica_and_a_split_requests_decode_hold_up_no_stream():
    scorer = PredictedTTFTScorer(CacheAwareConfig(stall_weight=0.5))
    both = view("b", inflight=6, prefill_tokens_per_s=1000)
    assert scorer.explain(req(prompt=8192), both)["stall_s"] > 0
    assert scorer.explain(req(prompt=8192), both._replace(role="prefill"))["stall_s"] == 0
    decode = req(prompt=8192)
    decode.phase = "decode"
    assert scorer.explain(decode, both)["stall_s"] == 0


def test_the_cost_is_the_sum_of_the_terms_it_explains():
    v = view("a", prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100, inflight=8, pending=300,
             kv_usage=0.95, max_num_batched_tokens=512)
    r = req(prompt=1030, cached={"a": 256, "b": 512}, occupancy={"a": 0.5}, session="a", returning={"a": 2.5},
            extends=True)
    scorer = PredictedTTFTScorer(CacheAwareConfig(stall_weight=0.3))
    parts = scorer.explain(r, v)
    terms = {k: x for k, x in parts.items() if k != "cost_s"}
    assert set(terms) == {"prefill_s", "shared_step_s", "evict_s", "load_s", "kv_s", "occupancy_s", "session_s",
                          "returning_s", "recompute_s", "stall_s"}
    assert all(x != 0 for k, x in terms.items() if k != "shared_step_s")  # each term has something to say here
    assert parts["cost_s"] == pytest.approx(sum(terms.values())) == pytest.approx(scorer.cost(r, v))


def test_explain_lists_each_filtered_replica_with_its_filter_and_the_candidates_best_first():
    views = [view("busy", inflight=3), view("drained", drained=True), view("idle"), view("other", models=("x",))]
    out = build_policy("least-loaded").explain(req(), views)
    assert out["filtered"] == [{"replica": "drained", "filter": "not-drained"},
                               {"replica": "other", "filter": "serves-model"}]
    assert [c["replica"] for c in out["candidates"]] == ["idle", "busy"] and out["best"] == ["idle"]
    assert [s["name"] for s in out["candidates"][0]["scorers"]] == ["load", "session"]


def test_explain_names_every_replica_the_picker_would_take_turns_among():
    out = build_policy("cache-aware").explain(req(prompt=100), [view("a"), view("b")])
    assert out["best"] == ["a", "b"]


def test_a_full_cache_costs_the_time_the_replica_takes_to_prefill_occupancy_weight_tokens():
    def occupancy_cost(rate, **cfg):
        def one(occupancy):
            v = view("a", prefill_tokens_per_s=rate)
            r = req(prompt=1024, occupancy={"a": occupancy})
            return PredictedTTFTScorer(CacheAwareConfig(**cfg)).cost(r, v)
        return one(0.5) - one(0.0)
    # half its cache held: half of 256 tokens' prefill
    assert (occupancy_cost(8000), occupancy_cost(32000)) == (pytest.approx(0.016), pytest.approx(0.004))
    assert occupancy_cost(8000, occupancy_weight_s=0.2) == occupancy_cost(32000, occupancy_weight_s=0.2) \
        == pytest.approx(0.1)


def test_a_cached_history_outweighs_a_fuller_cache_on_a_fast_replica():
    # a conversation's 1,600-token history, 1,280 of it cached on a replica whose cache is nearly full, against
    # an empty replica, both prefilling 30,000 tokens/s: it stays (as a fixed 0.1 s the full cache moved it)
    views = [view("full", prefill_tokens_per_s=30000), view("empty", prefill_tokens_per_s=30000)]
    turn = req(prompt=1600, cached={"full": 1280}, occupancy={"full": 0.95, "empty": 0.05})
    assert build_policy("cache-aware").choose(turn, views)[0].name == "full"


def test_queued_prefill_beyond_the_step_waits_at_the_prefill_rate():
    idle = cost(view("a", prefill_tokens_per_s=1000), occupancy_weight_s=0)
    # 3000 pending beside 1024 new tokens in a 2048-token step: 1976 tokens wait for the steps before
    assert cost(view("a", prefill_tokens_per_s=1000, pending=3000), occupancy_weight_s=0) - idle == pytest.approx(1.976)


def test_queued_prefill_that_shares_the_step_costs_what_its_tokens_add_to_a_step():
    idle = cost(view("a", prefill_tokens_per_s=1000), occupancy_weight_s=0)
    # 1000 pending tokens fit beside 1024 new ones in one 2048-token step: free while the step's
    # per-token part is not known, 0.5 ms each once it is
    assert cost(view("a", prefill_tokens_per_s=1000, pending=1000), occupancy_weight_s=0) == pytest.approx(idle)
    shared = view("a", prefill_tokens_per_s=1000, pending=1000)._replace(prefill_marginal_s=0.5e-3)
    assert cost(shared, occupancy_weight_s=0) - idle == pytest.approx(0.5)


def test_blocks_of_prompts_still_in_prefill_are_in_use_not_room():
    # the index holds half of each cache; on "busy" 16 blocks more are taken by a prompt in prefill,
    # which the index shows only once computed: a new prompt there evicts them, on "idle" it does not
    idle = view("idle", prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=32)
    busy = view("busy", prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=32, pending=256)
    r = req(prompt=257, occupancy={"idle": 0.5, "busy": 0.5})  # 16 whole blocks to store
    scorer = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0, evict_weight=1))
    assert scorer.cost(r, busy) - scorer.cost(r, idle) == pytest.approx(0.256)  # evicts 256 tokens


# -- pickers ---------------------------------------------------------------------------------


def test_tied_replicas_take_turns():
    views = [view(n) for n in "abc"]
    picker = MaxScorePicker(rng=random.Random(7))
    counts = collections.Counter(picker(req(), [(v, 1.0) for v in views])[0].name for _ in range(300))
    assert counts == {"a": 100, "b": 100, "c": 100}


def test_the_first_of_tied_replicas_is_not_the_first_in_the_list():
    views = [view(n) for n in "abc"]
    firsts = {MaxScorePicker(rng=random.Random(seed))(req(), [(v, 1.0) for v in views])[0].name for seed in range(30)}
    assert firsts == {"a", "b", "c"}


def test_a_better_score_wins_over_taking_turns():
    views = [view(n) for n in "ab"]
    picker = MaxScorePicker()
    assert {picker(req(), [(views[0], 0.5), (views[1], 0.6)])[0].name for _ in range(5)} == {"b"}


def test_scores_within_the_tie_tolerance_take_turns():
    from router.policy import MaxScoreParams
    views = [view(n) for n in "abc"]
    picker = MaxScorePicker(MaxScoreParams(tie_tolerance=0.01))
    scored = [(views[0], 1.0), (views[1], 0.995), (views[2], 0.98)]
    assert collections.Counter(picker(req(), scored)[0].name for _ in range(10)) == {"a": 5, "b": 5}


def test_cache_aware_sends_cold_prompts_in_turn_whatever_a_few_blocks_of_occupancy_say():
    views = [view("a", prefill_tokens_per_s=1000), view("b", prefill_tokens_per_s=1000)]
    policy = build_policy("cache-aware")
    cold = req(prompt=1024, occupancy={"a": 0.500, "b": 0.505})  # 1.3 ms apart (a full cache: 256 tokens, 0.256 s)
    assert collections.Counter(policy.choose(cold, views)[0].name for _ in range(10)) == {"a": 5, "b": 5}
    cached = req(prompt=1024, cached={"b": 512}, occupancy={"a": 0.500, "b": 0.505})
    assert {policy.choose(cached, views)[0].name for _ in range(4)} == {"b"}


def test_round_robin_takes_turns_in_name_order():
    views = [view(n) for n in "cab"]
    picker = RoundRobinPicker()
    assert [picker(req(), [(v, 0.0) for v in views])[0].name for _ in range(6)] == list("abcabc")


def test_round_robin_turns_among_the_best_scored_only():
    views = [view(n) for n in "abc"]
    picker = RoundRobinPicker()
    assert {picker(req(), [(views[0], 0.0), (views[1], 1.0), (views[2], 1.0)])[0].name for _ in range(4)} == {"b", "c"}


# -- policies --------------------------------------------------------------------------------


def test_least_loaded_picks_the_lowest_relative_load():
    views = [view("a", inflight=5), view("b", inflight=2), view("c", inflight=9)]
    assert build_policy("least-loaded").choose(req(), views)[0].name == "b"


def test_least_loaded_weighs_the_tensor_parallel_group():
    """A TP-8 replica with 4x the requests of a TP-1 one is still the less loaded."""
    views = [view("tp1", inflight=2, tensor_parallel_size=1), view("tp8", inflight=8, tensor_parallel_size=8)]
    assert build_policy("least-loaded").choose(req(), views)[0].name == "tp8"


def test_external_load_counts():
    assert build_policy("least-loaded").choose(req(), [view("a", inflight=1, external=5),
                                                       view("b", inflight=1)])[0].name == "b"


def test_least_loaded_keeps_a_session_on_its_replica_until_it_is_full():
    views = [view("a", inflight=9, max_num_seqs=10), view("b", inflight=0, max_num_seqs=10)]
    policy = build_policy("least-loaded")
    assert policy.choose(req(session="a"), views)[0].name == "a"
    full = [view("a", inflight=10, max_num_seqs=10), view("b", inflight=0, max_num_seqs=10)]
    assert policy.choose(req(session="a"), full)[0].name == "b"


def test_round_robin_keeps_a_session_on_its_replica():
    policy = build_policy("round-robin")
    views = [view(n) for n in "abc"]
    assert {policy.choose(req(session="c"), views)[0].name for _ in range(6)} == {"c"}


def choose_cache_aware(views, prompt_tokens, cached, occupancy, extends=False):
    return build_policy("cache-aware").choose(req(prompt=prompt_tokens, cached=cached, occupancy=occupancy,
                                                  extends=extends), views)[0].name


def full_and_empty():
    # 100 blocks of 16 tokens each: 1600 tokens of KV cache
    return [view(n, prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100) for n in ("full", "empty")]


def test_a_small_shared_prefix_does_not_pull_a_new_prompt_onto_a_full_replica():
    # 256 of 1024 tokens cached on a full replica: storing the other 768 there evicts as much
    assert choose_cache_aware(full_and_empty(), 1024, {"full": 256, "empty": 0}, {"full": 1.0, "empty": 0.0}) == "empty"


def test_a_conversations_mostly_cached_next_turn_stays_on_its_full_replica():
    assert choose_cache_aware(full_and_empty(), 1024, {"full": 768, "empty": 0}, {"full": 1.0, "empty": 0.0},
                              extends=True) == "full"


def test_a_prompt_shorter_than_a_block_spreads_by_load_whatever_the_caches_hold():
    views = [view("full", inflight=1, prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100),
             view("empty", inflight=2, prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100)]
    assert choose_cache_aware(views, 10, {}, {"full": 1.0, "empty": 0.0}) == "full"


def test_a_cached_prefix_wins_while_its_replica_has_room():
    assert choose_cache_aware(full_and_empty(), 1024, {"full": 256, "empty": 0}, {"full": 0.2, "empty": 0.0}) == "full"


# -- policies from configuration -------------------------------------------------------------


def test_a_pipeline_from_configuration_weighs_its_scorers():
    views = [view("busy", inflight=8, kv_usage=0.1), view("full", inflight=0, kv_usage=0.95)]
    by_load = build_policy(PolicyConfig.model_validate({"scorers": [{"name": "load"}]}))
    by_kv = build_policy(PolicyConfig.model_validate({"scorers": [{"name": "load", "weight": 0.1},
                                                                  {"name": "kv-usage", "weight": 1.0}]}))
    assert (by_load.choose(req(), views)[0].name, by_kv.choose(req(), views)[0].name) == ("full", "busy")


def test_scorer_parameters_come_from_the_entry_over_the_cache_aware_section():
    policy = build_policy(PolicyConfig.model_validate({"scorers": [{"name": "predicted-ttft", "load_weight_s": 5}]}),
                          CacheAwareConfig(load_weight_s=1, kv_weight_s=0.25))
    scorer = policy.scorers[0][0]
    assert (scorer.cfg.load_weight_s, scorer.cfg.kv_weight_s, policy.uses_prefix) == (5, 0.25, True)


@pytest.mark.parametrize("spec, field", [
    ({"scorers": [{"name": "nope"}]}, "policy.scorers.0.name: unknown scorer 'nope'"),
    ({"scorers": [{"name": "load"}, {"name": "predicted-ttft", "kv_threshold": 2}]}, "policy.scorers.1.kv_threshold"),
    ({"scorers": [{"name": "load", "speed": 1}]}, "policy.scorers.0: scorer 'load' takes no parameters"),
    ({"filters": ["ready", "fast"]}, "policy.filters.1.name: unknown filter 'fast'"),
    ({"picker": "best"}, "policy.picker.name: unknown picker 'best'"),
    ({"scorers": [{"name": "no_such_module:Scorer"}]}, "policy.scorers.0.name: cannot load scorer"),
    ({"scorers": [{"name": "collections:OrderedDict"}]}, "is not a scorer"),
])
def test_configuration_errors_name_the_field(spec, field):
    with pytest.raises(ConfigError) as e:
        build_policy(PolicyConfig.model_validate(spec))
    assert field in str(e.value)


def test_a_plug_in_scorer_by_module_and_class(tmp_path, monkeypatch):
    (tmp_path / "my_scorers.py").write_text(
        "from router.policy import Scorer\n"
        "class Last(Scorer):\n"
        "    def __call__(self, req, view):\n"
        "        return 1.0 if view.name == 'c' else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = build_policy(PolicyConfig.model_validate({"scorers": [{"name": "my_scorers:Last"}]}))
    assert {policy.choose(req(), [view(n) for n in "abc"])[0].name for _ in range(10)} == {"c"}


def test_platform_defaults():
    from router.replicas import Replica

    def block_size(platform):
        return Replica(ReplicaConfig(name="r", url="http://r:1", platform=platform), None, Metrics()).block_size

    # Aurora: vLLM's XPU platform uses blocks of 64 when --block-size is not given
    assert (block_size("gaudi2"), block_size("aurora-pvc"), block_size("cuda")) == (128, 64, 16)


def test_an_unknown_platform_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown platform 'tpu'.*gaudi2, gaudi3, aurora-pvc, cuda, cpu"):
        ReplicaConfig(url="http://r:1", platform="tpu")
