"""The simulated vLLM engine (loadtest/engine.py): scheduling, KV blocks and the prefix cache, step by step."""

import pytest

from loadtest.engine import Engine, Request, StepCost

B = 16


def engine(**kw):
    events = {"stored": [], "removed": []}
    kw.setdefault("block_size", B)
    e = Engine(stored=lambda h, p, t: events["stored"].append((h, p, t)),
               removed=lambda h: events["removed"].append(h), seed=1, **kw)
    return e, events


def prompt(tag, n):
    return [tag * 1000 + i for i in range(n)]


def run(e, limit=10_000):
    for _ in range(limit):
        if e.idle:
            return
        e.step()
    raise AssertionError("the engine did not drain")


def test_a_request_gets_its_first_token_after_the_step_that_finishes_its_prompt_then_one_per_step():
    e, _ = engine(max_num_batched_tokens=64)
    r = Request("a", prompt(1, 150), max_tokens=3)
    e.add(r)
    steps = []
    while not e.idle:
        res = e.step()
        steps.append((res.prefill_tokens, res.decode_seqs, r.output))
    # 150 prompt tokens in chunks of 64: three prefill steps, the first token with the last chunk
    assert steps == [(64, 0, 0), (64, 0, 0), (22, 0, 1), (0, 1, 2), (0, 1, 3)]


def test_freed_blocks_are_hit_by_the_next_request_with_the_same_prefix_but_never_its_last_token():
    e, _ = engine(num_blocks=64)
    e.add(Request("a", prompt(1, 64), max_tokens=2))
    run(e)
    again = Request("b", prompt(1, 64), max_tokens=1)
    longer = Request("c", prompt(1, 64) + [7] * 20, max_tokens=1)
    e.add(again)
    run(e)
    e.add(longer)
    run(e)
    assert again.cached_tokens == 48  # 4 full blocks cached, but the last token is always computed
    assert longer.cached_tokens == 64


def test_cached_blocks_are_evicted_least_recently_freed_first_a_prompts_tail_before_its_root():
    e, events = engine(num_blocks=6)
    old, new = Request("a", prompt(1, 64), max_tokens=1), Request("b", prompt(2, 64), max_tokens=1)
    for r in (old, new):  # 4 blocks each: b takes the 2 never used, then a's last two
        e.add(r)
        run(e)
    again_old, again_new = Request("c", prompt(1, 64), max_tokens=1), Request("d", prompt(2, 64), max_tokens=1)
    e.add(again_new)
    run(e)
    e.add(again_old)
    run(e)
    assert again_new.cached_tokens == 48
    # b's blocks evicted a's last two; d's recomputed last block took a's second; a's root remains
    assert events["removed"][:2] == [old.hashes[3:1:-1], [old.hashes[1]]]
    assert again_old.cached_tokens == 16


def test_a_request_that_needs_a_block_when_none_is_free_preempts_the_newest_running_one():
    e, _ = engine(num_blocks=10, max_num_batched_tokens=4096)
    first, second = Request("a", prompt(1, 70), max_tokens=40), Request("b", prompt(2, 70), max_tokens=40)
    e.add(first)
    e.step()
    e.add(second)
    preempted = []
    while not e.idle:
        preempted += e.step().preempted
    assert preempted and preempted[0] is second  # the newest goes, the oldest keeps running
    assert first.preemptions == 0 and second.preemptions >= 1
    assert first.finished_at < second.finished_at
    assert e.preemptions == len(preempted)


def test_step_time_grows_with_the_batch_and_its_context():
    cost = StepCost(base_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=1e-3, context_s_per_token=1e-6)
    assert cost.time(0, 1, 100) < cost.time(0, 8, 800) < cost.time(512, 8, 800)
    e, _ = engine(cost=cost)
    for i in range(8):
        e.add(Request(str(i), prompt(i + 1, 32), max_tokens=4))
    prefill = e.step()
    decode = e.step()
    assert prefill.prefill_tokens == 8 * 32 and decode.decode_seqs == 8
    assert prefill.seconds == cost.time(256, 0, 0) and decode.seconds == cost.time(0, 8, 8 * 32)


def test_a_step_with_prefill_costs_its_fixed_extra_once_and_a_decode_only_step_does_not():
    cost = StepCost(base_s=0.01, prefill_s_per_token=0.0, decode_s_per_seq=0.0, context_s_per_token=0.0,
                    prefill_base_s=0.03)
    assert cost.time(0, 4, 100) == pytest.approx(0.01)
    assert cost.time(1, 4, 100) == cost.time(2000, 0, 0) == pytest.approx(0.04)


def test_time_to_first_token_counts_the_queue_the_prefill_steps_and_the_front_end():
    e, _ = engine(max_num_batched_tokens=64, cost=StepCost(base_s=0.01, prefill_s_per_token=0.0,
                                                          decode_s_per_seq=0.0, context_s_per_token=0.0),
                  frontend_s=0.05)
    e.add(Request("a", prompt(1, 100), max_tokens=1))  # two prefill steps
    e.add(Request("b", prompt(2, 10), max_tokens=1))  # shares the second step with a's last chunk
    run(e)
    assert e.ttft.count == 2 and e.ttft.sum == pytest.approx(2 * 0.05 + 0.02 + 0.02)
    assert e.ttft.buckets[e.ttft.bounds.index(0.06)] == 0 and e.ttft.buckets[e.ttft.bounds.index(0.08)] == 2


def test_prefill_time_is_summed_per_request_from_first_scheduled_to_first_token_as_vllm_counts_it():
    e, _ = engine(max_num_batched_tokens=64, cost=StepCost(base_s=0.01, prefill_s_per_token=0.0,
                                                          decode_s_per_seq=0.0, context_s_per_token=0.0))
    e.add(Request("a", prompt(1, 100), max_tokens=1))  # two prefill steps
    e.add(Request("b", prompt(2, 10), max_tokens=1))  # scheduled in the second, its first token after it
    run(e)
    assert e.prefill_requests == 2 and e.prefill_seconds == pytest.approx(0.02 + 0.01)


def test_queue_time_is_summed_per_request_from_arrival_to_first_scheduled_as_vllm_counts_it():
    e, _ = engine(max_num_batched_tokens=64, cost=StepCost(base_s=0.01, prefill_s_per_token=0.0,
                                                          decode_s_per_seq=0.0, context_s_per_token=0.0))
    e.add(Request("a", prompt(1, 100), max_tokens=1))  # scheduled at once
    e.add(Request("b", prompt(2, 10), max_tokens=1))  # no token budget left in the first step: waits one step
    run(e)
    assert e.queue_seconds == pytest.approx(0.01)


def test_at_most_max_num_seqs_run_and_the_rest_wait_in_arrival_order():
    e, _ = engine(max_num_seqs=2)
    reqs = [Request(str(i), prompt(i + 1, 20), max_tokens=2) for i in range(4)]
    for r in reqs:
        e.add(r)
    e.step()
    assert [r.id for r in e.running] == ["0", "1"] and [r.id for r in e.waiting] == ["2", "3"]
    while not any(r.id == "2" for r in e.running):
        e.step()
    assert [r.id for r in e.running] == ["2", "3"]
    run(e)
    assert reqs[2].first_token_at > reqs[1].finished_at - 1e-12


def test_stored_blocks_are_announced_with_their_parent_and_tokens_once():
    e, events = engine(num_blocks=64)
    shared = prompt(1, 32)
    a, b = Request("a", shared + prompt(2, 32), max_tokens=1), Request("b", shared + prompt(3, 32), max_tokens=1)
    e.add(a)
    run(e)
    e.add(b)
    run(e)
    (ha, pa, ta), (hb, pb, tb) = events["stored"]
    assert pa is None and len(ha) == 4 and ta == a.prompt
    assert pb == ha[1] and len(hb) == 2 and tb == b.prompt[32:]  # only b's own blocks, after the shared two


# -- the stand-in replica with the engine (python -m loadtest.simulator --engine) -------------------

import asyncio  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from loadtest.cluster import HTTP
from support.state import replicas_view
from support.traffic import cached, chat, predicted
from support.waiting import wait_until  # noqa: E402
from loadtest.cluster import free_ports  # noqa: E402


def test_the_stand_in_with_an_engine_makes_requests_past_max_num_seqs_wait_for_a_slot(cluster):
    sim = cluster.sim("--engine", "--max-num-seqs", "2", "--step-base-ms", "5", "--block-size", "16")

    async def one(client, i):
        body = {"model": "tiny", "prompt": f"request {i} " * 8, "max_tokens": 20, "stream": True}
        t0 = time.perf_counter()
        first = None
        async with client.stream("POST", sim.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - t0
        return first

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            return sorted(await asyncio.gather(*(one(client, i) for i in range(6))))

    ttft = asyncio.run(main())
    # two run at once, 20 steps of at least 5 ms each: the last pair waits for two pairs ahead of it
    assert ttft[4] - ttft[1] > 0.15, ttft


@pytest.mark.parametrize("repeats", [12, 100])  # 100: a prompt long enough to be encoded from where one left off
def test_a_router_predicts_an_engine_replicas_cache_exactly_from_its_events(cluster, tmp_path, repeats):
    from loadtest.tiny_model import write_tokenizer
    root = str(write_tokenizer(tmp_path / "tiny"))
    sims = [cluster.sim("--engine", "--root", root, "--block-size", "16", "--num-gpu-blocks", "128", "--kv-events")
            for _ in range(2)]
    rt = cluster.router(sims)
    wait_until(lambda: all(r["index"]["mode"] == "precise" for r in replicas_view(rt).values()), 10)
    system = "alpha bravo charlie delta echo foxtrot golf hotel " * repeats
    pairs = []
    with httpx.Client(timeout=30) as c:
        for i in range(12):
            r = chat(c, rt.url, [{"role": "system", "content": system}, {"role": "user", "content": f"question {i} " * 6}])
            pairs.append((predicted(r), cached(r)))
    assert sum(a for _, a in pairs) > 0 and [p for p, _ in pairs] == [a for _, a in pairs], pairs


# -- platform profiles ------------------------------------------------------------------------------


def test_profiles_are_derived_from_the_model_and_the_devices():
    from loadtest.profiles import GAUDI2, LLAMA_70B, PROFILES, PVC_TILE, derive
    g2 = PROFILES["gaudi2-tp8"]
    assert LLAMA_70B.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    # 8 x 96 GB at 0.9, less 141 GB of weights and a 5% reserve, in blocks of 128 tokens of 320 KiB each
    assert g2.num_gpu_blocks == int((8 * 96e9 * 0.85 - 141.2e9) // (327_680 * 128))
    assert derive("x", "gaudi2", LLAMA_70B, GAUDI2, 4, 128).num_gpu_blocks < g2.num_gpu_blocks
    assert PROFILES["gaudi3-tp8"].prefill_tokens_per_s > g2.prefill_tokens_per_s
    with pytest.raises(ValueError, match="does not fit"):
        derive("x", "aurora-pvc", LLAMA_70B, PVC_TILE, 1, 64)


def test_the_stand_in_takes_a_profile_and_reports_its_cache(cluster):
    from loadtest.profiles import PROFILES
    sim = cluster.sim("--profile", "gaudi2-tp8")
    metrics = HTTP.get(sim.url + "/metrics", timeout=5).text
    p = PROFILES["gaudi2-tp8"]
    assert 'block_size="128"' in metrics and f'num_gpu_blocks="{p.num_gpu_blocks}"' in metrics


def test_the_stand_ins_time_to_first_token_histogram_includes_its_front_end_time(cluster):
    sim = cluster.sim("--engine", "--frontend-ms", "80", "--step-base-ms", "1")
    with httpx.Client(timeout=10) as c:
        t0 = time.perf_counter()
        c.post(sim.url + "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 1})
        took = time.perf_counter() - t0
        metrics = c.get(sim.url + "/metrics").text
    assert took >= 0.08
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="tiny"} 0.0' in metrics
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 1.0' in metrics
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 1.0' in metrics


def _send_long_prompts(rt) -> None:
    """Distinct prompts of about 1,000 tokens, one at a time: 8 samples of the replica's prefill."""
    with httpx.Client(timeout=10) as c:
        for i in range(8):
            c.post(rt.url + "/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                    "prompt": f"request {i} " + "word " * 1000})


def test_a_router_learns_a_replicas_prefill_rate_from_its_metrics(cluster):
    # 50 us per prompt token: 20,000 tokens/s, where the platform's guess for a gaudi2 TP-8 replica is 64,000
    sim = cluster.sim("--engine", "--step-base-ms", "1", "--step-prefill-us-per-token", "50")
    rt = cluster.router([], config={"replicas": [{"url": sim.url, "platform": "gaudi2",
                                                     "tensor_parallel_size": 8}]})
    assert replicas_view(rt)[sim.url]["prefill_rate_source"] == "platform guess"
    _send_long_prompts(rt)
    wait_until(lambda: replicas_view(rt)[sim.url]["prefill_rate_source"] == "learned from its metrics", timeout=10)
    rate = replicas_view(rt)[sim.url]["prefill_tokens_per_s"]
    assert 14_000 < rate < 21_000, rate  # a step's fixed 1 ms counts too
    wait_until(lambda: "prefill at" in rt.log_tail(4000), timeout=5)  # written by the logging thread


def test_a_router_learns_what_each_queued_prompt_token_adds_to_a_replicas_step(cluster):
    # a step takes 20 ms plus 50 us per prompt token: prompts of different lengths between scrapes tell
    # the two apart (the rate alone, tokens over seconds, mixes them)
    sim = cluster.sim("--engine", "--step-base-ms", "20", "--step-prefill-us-per-token", "50")
    rt = cluster.router([sim.url], "--set", "health.metrics_interval_s=0.5")
    with httpx.Client(timeout=10) as c:
        for i, words in enumerate([1000, 150, 2000, 400, 1000, 150]):
            for j in range(6):
                c.post(rt.url + "/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                        "prompt": f"request {i}.{j} " + "word " * words})
            time.sleep(1.2)  # at least one scrape between sizes
    per_token = replicas_view(rt)[sim.url]["prefill_s_per_token_in_step"]
    assert per_token is not None and 35e-6 < per_token < 70e-6, per_token


def test_replicas_alike_route_by_one_prefill_rate_learned_from_all_of_them(cluster):
    # the same engine twice: what each one's samples say differs by what it served, the speed does not
    sims = [cluster.sim("--engine", "--step-base-ms", "1", "--step-prefill-us-per-token", "50") for _ in range(2)]
    rt = cluster.router([s.url for s in sims])
    with httpx.Client(timeout=10) as c:
        for i in range(16):
            c.post(sims[i % 2].url + "/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                             "prompt": f"request {i} " + "word " * (200 + 800 * (i % 2))})
    wait_until(lambda: all(v["prefill_tokens_per_s_own"] for v in replicas_view(rt).values()), timeout=10)
    views = replicas_view(rt)
    own = [views[s.url]["prefill_tokens_per_s_own"] for s in sims]
    used = [views[s.url]["prefill_tokens_per_s"] for s in sims]
    assert own[0] != own[1] and used == [pytest.approx(sum(own) / 2)] * 2


def test_a_replica_without_samples_of_its_own_routes_by_its_alike_replicas_rate_and_says_so(cluster):
    sims = [cluster.sim("--engine", "--step-base-ms", "1", "--step-prefill-us-per-token", "50") for _ in range(2)]
    rt = cluster.router([s.url for s in sims])
    with httpx.Client(timeout=10) as c:
        for i in range(8):
            c.post(sims[0].url + "/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                         "prompt": f"request {i} " + "word " * 1000})
    wait_until(lambda: replicas_view(rt)[sims[0].url]["prefill_tokens_per_s_own"], timeout=10)
    served, idle = (replicas_view(rt)[s.url] for s in sims)
    assert (idle["prefill_tokens_per_s_own"], idle["prefill_rate_source"]) == (None, "learned from replicas alike")
    assert idle["prefill_tokens_per_s"] == served["prefill_tokens_per_s_own"]
    assert served["prefill_rate_source"] == "learned from its metrics"


def test_a_configured_prefill_rate_is_kept_whatever_the_metrics_show(cluster):
    sim = cluster.sim("--engine", "--step-base-ms", "1", "--step-prefill-us-per-token", "50")
    rt = cluster.router([], config={"replicas": [{"url": sim.url, "prefill_tokens_per_s": 5000}]})
    _send_long_prompts(rt)
    time.sleep(2.5)  # two scrapes
    view = replicas_view(rt)[sim.url]
    assert (view["prefill_tokens_per_s"], view["prefill_rate_source"]) == (5000, "configured")


def test_one_process_serves_several_replicas_on_consecutive_ports_behind_a_router(cluster):
    base = free_ports(3)
    host = cluster.sim("--replicas", "3", "--profile", "aurora-pvc-tp1", "--time-scale", "0.1", port=base)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(3)]
    for u in urls:
        HTTP.get(u + "/health", timeout=5).raise_for_status()
    rt = cluster.router(urls, "--policy", "round-robin")
    wait_until(lambda: all(r["ready"] for r in replicas_view(rt).values()), 10)
    with httpx.Client(timeout=30) as c:
        seen = {c.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": f"distinct prompt {i}",
                                                          "max_tokens": 2}).headers["x-kvroute-replica"]
                for i in range(12)}
    assert seen == {f"127.0.0.1:{base + i}" for i in range(3)}
    assert host.popen.poll() is None
