"""The routing stage piece by piece: filters, the load scorer, pickers and policies."""

import collections
import random

import pytest

from router.config import ReplicaConfig
from router.metrics import Metrics
from router.policy import (BELOW_CAPACITY, LoadScorer, MaxScorePicker, NoCandidate, RoundRobinPicker, RouteRequest,
                           build_policy)
from router.pool import Replica


def replica(name, inflight=0, ready=True, models=("m",), drained=False, **cfg):
    r = Replica(ReplicaConfig(name=name, url=f"http://{name}:8000", models=list(models), **cfg), None, Metrics())
    r.state = "ready" if ready else "unready"
    r.inflight = inflight
    r.drained = drained
    return r


def req(model="m", exclude=()):
    return RouteRequest(model=model, request_id="r", endpoint="/v1/completions", exclude=set(exclude))


@pytest.mark.parametrize("pool, model, why", [
    ([], "m", "no_ready"),
    ([replica("a", ready=False)], "m", "no_ready"),
    ([replica("a", models=("x",))], "m", "unknown_model"),
    ([replica("a", drained=True)], "m", "drained"),
    ([replica("a", inflight=2, max_num_seqs=2)], "m", "at_capacity"),
])
def test_filters_say_why_nobody_is_left(pool, model, why):
    with pytest.raises(NoCandidate) as e:
        build_policy("least-loaded").candidates(req(model), pool)
    assert e.value.why == why


def test_tried_replicas_are_excluded():
    pool = [replica("a"), replica("b")]
    assert [r.name for r in build_policy("least-loaded").candidates(req(exclude={"a"}), pool)] == ["b"]


def test_below_capacity_keeps_replicas_with_a_free_slot():
    pool = [replica("a", inflight=3, max_num_seqs=4), replica("b", inflight=4, max_num_seqs=4)]
    assert [r.name for r in BELOW_CAPACITY(req(), pool)] == ["a"]


def test_load_score_falls_with_load_and_rises_with_capacity():
    s = LoadScorer()
    assert s(req(), replica("a", inflight=0)) > s(req(), replica("b", inflight=5))
    tp1 = replica("tp1", inflight=8, platform="gaudi2", tensor_parallel_size=1)
    tp8 = replica("tp8", inflight=8, platform="gaudi2", tensor_parallel_size=8)
    assert s(req(), tp8) > s(req(), tp1)
    assert 0 < s(req(), tp1) <= 1


def test_least_loaded_picks_the_lowest_relative_load():
    pool = [replica("a", inflight=5), replica("b", inflight=2), replica("c", inflight=9)]
    assert build_policy("least-loaded").choose(req(), pool).replica.name == "b"


def test_least_loaded_weighs_the_tensor_parallel_group():
    """A TP-8 replica with 4x the requests of a TP-1 one is still the less loaded."""
    pool = [replica("tp1", inflight=2, tensor_parallel_size=1), replica("tp8", inflight=8, tensor_parallel_size=8)]
    assert build_policy("least-loaded").choose(req(), pool).replica.name == "tp8"


def test_external_load_counts():
    a, b = replica("a", inflight=1), replica("b", inflight=1)
    a.external_load = 5
    assert build_policy("least-loaded").choose(req(), [a, b]).replica.name == "b"


def test_ties_are_broken_at_random_not_by_list_order():
    pool = [replica(n) for n in "abc"]
    picker = MaxScorePicker(random.Random(7))
    counts = collections.Counter(picker(req(), [(r, 1.0) for r in pool])[0].name for _ in range(300))
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 60


def test_round_robin_takes_turns_in_name_order():
    pool = [replica(n) for n in "cab"]
    picker = RoundRobinPicker()
    assert [picker(req(), [(r, 0.0) for r in pool])[0].name for _ in range(6)] == list("abcabc")


def test_platform_defaults():
    assert replica("g", platform="gaudi2").block_size == 128
    assert replica("p", platform="aurora-pvc").block_size == 16
    assert replica("c", platform="cuda").block_size == 16


def cache_aware_cost(replica_obj, cached=0, prompt=1024):
    from router.config import CacheAwareConfig
    from router.policy import PredictedTTFTScorer
    r = req()
    r.prompt_tokens, r.cached = prompt, {replica_obj.name: cached}
    return PredictedTTFTScorer(CacheAwareConfig()).cost(r, replica_obj)


def test_kv_usage_costs_nothing_until_the_cache_is_nearly_full():
    from router.replica_metrics import ReplicaStats
    r = replica("a", prefill_tokens_per_s=1000)
    base = cache_aware_cost(r)
    r.stats = ReplicaStats(kv_usage=0.85)
    assert cache_aware_cost(r) == base
    r.stats = ReplicaStats(kv_usage=0.95)
    assert cache_aware_cost(r) == pytest.approx(base + 0.25)
    r.stats = ReplicaStats(kv_usage=1.0)
    assert cache_aware_cost(r) == pytest.approx(base + 0.5)


def test_cached_prefix_lowers_the_cost_by_its_prefill_time():
    r = replica("a", prefill_tokens_per_s=1000)
    assert cache_aware_cost(r, cached=0) - cache_aware_cost(r, cached=768) == pytest.approx(0.768)


def choose_cache_aware(pool, prompt_tokens, cached, occupancy):
    from router.policy import build_policy
    r = req()
    r.prompt_tokens, r.cached, r.occupancy = prompt_tokens, cached, occupancy
    return build_policy("cache-aware").choose(r, pool).replica.name


def full_and_empty():
    # 100 blocks of 16 tokens each: 1600 tokens of KV cache
    return [replica(n, prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100) for n in ("full", "empty")]


def test_a_small_shared_prefix_does_not_pull_a_new_prompt_onto_a_full_replica():
    # 256 of 1024 tokens cached on a full replica: storing the other 768 there evicts as much
    assert choose_cache_aware(full_and_empty(), 1024, {"full": 256, "empty": 0}, {"full": 1.0, "empty": 0.0}) == "empty"


def test_a_mostly_cached_prompt_stays_on_its_full_replica():
    assert choose_cache_aware(full_and_empty(), 1024, {"full": 768, "empty": 0}, {"full": 1.0, "empty": 0.0}) == "full"


def test_a_cached_prefix_wins_while_its_replica_has_room():
    assert choose_cache_aware(full_and_empty(), 1024, {"full": 256, "empty": 0}, {"full": 0.2, "empty": 0.0}) == "full"


def test_eviction_cost_counts_only_what_does_not_fit():
    from router.config import CacheAwareConfig
    from router.policy import PredictedTTFTScorer
    r = replica("a", prefill_tokens_per_s=1000, block_size=16, num_gpu_blocks=100)
    rq = req()
    rq.prompt_tokens, rq.occupancy = 1000, {"a": 0.5}  # 800 tokens free: 200 of the 1000 evict
    with_evict = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0)).cost(rq, r)
    without = PredictedTTFTScorer(CacheAwareConfig(occupancy_weight_s=0, evict_weight=0)).cost(rq, r)
    assert with_evict - without == pytest.approx(0.2)


def test_queued_prefill_delays_only_what_does_not_fit_in_one_scheduler_step():
    r = replica("a", prefill_tokens_per_s=1000, max_num_batched_tokens=2048)
    idle = cache_aware_cost(r, prompt=1024)
    r.pending_prefill = 1000  # fits beside 1024 new tokens in one 2048-token step
    assert cache_aware_cost(r, prompt=1024) == pytest.approx(idle)
    r.pending_prefill = 3000  # 1976 tokens over the step wait for the next steps
    assert cache_aware_cost(r, prompt=1024) - idle == pytest.approx(1.976)
