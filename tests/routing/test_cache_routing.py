"""Cache-aware routing against simulated replicas that model vLLM's prefix cache."""

import collections
import concurrent.futures
import threading
import time


from loadtest.cluster import HTTP
from support.state import replicas_view
from support.waiting import wait_until
from loadtest.cluster import wait_redis
from loadtest.simulator import PrefixCache, byte_token_ids, prompt_text
from loadtest.workloads import shared_prefix
from router.replicas.stats import parse_metrics

# Replicas with small KV caches: 400 blocks of 16 tokens (4 bytes each). 12 groups with a 1024-token
# system prompt (~64 blocks each) need ~800 blocks: more than one replica holds, less than three.
SIM = ("--ttft-ms", "1", "--itl-ms", "1", "--prefill-us-per-token", "20", "--block-size", "16",
       "--num-gpu-blocks", "400")
WORKLOAD = dict(groups=12, prompts_per_group=16, system_bytes=4096, question_bytes=96, seed=7)


def router_config(sims, policy, **extra):
    return {"policy": policy, "replicas": [
        {"name": f"r{i}", "url": s.url, "prefill_tokens_per_s": 50000} for i, s in enumerate(sims)], **extra}


def send(url, req, timeout=20):
    r = HTTP.post(url + "/v1/chat/completions", timeout=timeout,
                   json={"model": "tiny", "messages": req.messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r


def run_workload(rt, requests, concurrency=4):
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda q: send(rt.url, q), requests))


def hit_rate(sims):
    hits = queries = 0
    for s in sims:
        st = parse_metrics(HTTP.get(s.url + "/metrics").text)
        hits += st.prefix_hits
        queries += st.prefix_queries
    return hits / queries


def measure(cluster, policy, concurrency=4, sim_args=SIM):
    sims = [cluster.sim(*sim_args) for _ in range(3)]
    rt = cluster.router([], config=router_config(sims, policy))
    wait_until(lambda: all(r["block_size"] == 16 for r in replicas_view(rt).values()), timeout=5)
    responses = run_workload(rt, shared_prefix(**WORKLOAD), concurrency)
    share = collections.Counter(r.headers["x-kvroute-replica"] for r in responses)
    return hit_rate(sims), share, responses, rt


def infinite_cache_hit_rate(requests):
    """The best any router can do: the same requests in order against one cache that never evicts."""
    cache = PrefixCache(block_size=16, num_blocks=10**9)
    hits = queries = 0
    for q in requests:
        ids = byte_token_ids(prompt_text({"messages": q.messages}, chat=True).encode())
        hits += cache.admit(ids)
        queries += len(ids)
    return hits / queries


def test_cache_aware_hit_rate_nears_the_bound_and_is_far_above_round_robin(cluster):
    bound = infinite_cache_hit_rate(shared_prefix(**WORKLOAD))
    rr_rate, _, _, _ = measure(cluster, "round-robin")
    ca_rate, share, responses, rt = measure(cluster, "cache-aware")
    print(f"hit rate: infinite cache {bound:.3f}, round robin {rr_rate:.3f}, cache-aware {ca_rate:.3f}; "
          f"share {dict(share)}")
    # round robin's rate depends on how the concurrent arrivals interleave (0.24-0.44 seen), so it is
    # compared by a fixed margin; cache-aware is held to the bound
    assert ca_rate >= 0.95 * bound
    assert ca_rate >= rr_rate + 0.4
    mean = len(responses) / 3
    assert len(share) == 3 and max(share.values()) <= 1.5 * mean
    predicted = sum(int(r.headers["x-kvroute-cached-tokens"]) for r in responses)
    assert predicted > 0


def test_the_requests_of_one_group_stay_together(cluster):
    """One request at a time, caches large enough for all groups: only the cached prefix decides."""
    roomy = SIM[:-1] + ("4000",)
    _, _, responses, _ = measure(cluster, "cache-aware", concurrency=1, sim_args=roomy)
    by_group = collections.defaultdict(set)
    for q, r in zip(shared_prefix(**WORKLOAD), responses):
        by_group[q.group].add(r.headers["x-kvroute-replica"])
    assert all(len(replicas) == 1 for replicas in by_group.values()), dict(by_group)


def test_a_hot_prefix_spreads_once_one_replica_is_full(cluster):
    sims = [cluster.sim("--ttft-ms", "1", "--itl-ms", "20", "--block-size", "16") for _ in range(3)]
    rt = cluster.router([], config={"replicas": [
        {"name": f"r{i}", "url": s.url, "max_num_seqs": 4} for i, s in enumerate(sims)]})
    hot = shared_prefix(1, 12, 4096, 64, seed=1)
    send(rt.url, hot[0])  # the prefix is now cached on one replica
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda q: HTTP.post(rt.url + "/v1/chat/completions", timeout=20, json={
            "model": "tiny", "messages": q.messages, "max_tokens": 30}), hot))
    used = collections.Counter(r.headers["x-kvroute-replica"] for r in responses)
    assert all(r.status_code == 200 for r in responses)
    assert len(used) == 3 and max(used.values()) <= 6, used


def test_restarted_replica_is_forgotten(cluster):
    sim = cluster.sim(*SIM)
    rt = cluster.router([], config={**router_config([sim], "cache-aware"),
                                    "health": {"interval_s": 0.2, "metrics_interval_s": 0.2}})
    wait_until(lambda: replicas_view(rt)[sim.url]["block_size"] == 16, timeout=5)
    q = shared_prefix(1, 2, 4096, 64)
    send(rt.url, q[0])
    assert int(send(rt.url, q[1]).headers["x-kvroute-cached-tokens"]) > 0
    sim.stop()
    sim.start()
    sim.wait_http()
    wait_until(lambda: replicas_view(rt)[sim.url]["restarts"] == 1, timeout=5)
    time.sleep(0.2)
    assert send(rt.url, q[1]).headers["x-kvroute-cached-tokens"] == "0"


def test_two_routers_sharing_redis_send_a_prefix_group_to_the_same_replica(cluster, shared_url):
    sims = [cluster.sim(*SIM) for _ in range(3)]
    # a generous Redis timeout: this test is about sharing, not about a loaded CI machine's latency
    cfg = {**router_config(sims, "cache-aware"),
           "index": {"backend": shared_url, "timeout_s": 0.5}}
    a = cluster.router([], config=cfg)
    b = cluster.router([], config=cfg)
    for rt in (a, b):
        wait_until(lambda: all(r["block_size"] == 16 for r in replicas_view(rt).values()), timeout=5)
    groups = collections.defaultdict(set)
    via_b_cached = []
    for i, q in enumerate(shared_prefix(6, 4, 4096, 64, seed=3)):
        rt = a if i % 2 == 0 else b
        r = send(rt.url, q)
        groups[q.group].add(r.headers["x-kvroute-replica"])
        if rt is b:
            via_b_cached.append(int(r.headers["x-kvroute-cached-tokens"]))
    assert all(len(replicas) == 1 for replicas in groups.values()), dict(groups)
    assert sum(1 for c in via_b_cached if c > 0) >= len(via_b_cached) - 6  # all but first sightings hit


def test_a_prompt_shorter_than_a_block_is_not_a_redis_fallback(cluster, redis_proc):
    sims = [cluster.sim(*SIM)]
    cfg = {**router_config(sims, "cache-aware"), "index": {"backend": f"redis://127.0.0.1:{redis_proc.port}/0"}}
    rt = cluster.router([], config=cfg)
    r = HTTP.post(rt.url + "/v1/chat/completions", timeout=20,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200
    text = HTTP.get(rt.url + "/metrics").text
    assert 'kvroute_routing_decisions_total{reason="load"} 1.0' in text
    assert 'reason="fallback"' not in text


def test_redis_dying_and_returning_fails_no_request(cluster, redis_proc):
    sims = [cluster.sim(*SIM) for _ in range(2)]
    cfg = {**router_config(sims, "cache-aware"),
           "index": {"backend": f"redis://127.0.0.1:{redis_proc.port}/0", "retry_after_s": 0.3}}
    rt = cluster.router([], config=cfg)
    statuses = []
    stop = threading.Event()
    work = shared_prefix(4, 200, 2048, 64, seed=5)

    def client():
        i = 0
        while not stop.is_set() and i < len(work):
            r = HTTP.post(rt.url + "/v1/chat/completions", timeout=20,
                           json={"model": "tiny", "messages": work[i].messages, "max_tokens": 2})
            statuses.append(r.status_code)
            i += 1

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    redis_proc.kill()
    time.sleep(1.5)
    redis_proc.start()
    wait_redis(redis_proc)
    metrics = lambda: HTTP.get(rt.url + "/metrics").text
    wait_until(lambda: "kvroute_index_fallback 0.0" in metrics(), timeout=5)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(30)
    assert statuses and set(statuses) == {200}, collections.Counter(statuses)
    text = metrics()
    assert 'kvroute_routing_decisions_total{reason="fallback"}' in text
    assert "kvroute_index_errors_total" in text
