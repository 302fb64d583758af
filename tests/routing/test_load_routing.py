"""Load-based routing across real processes."""

import collections
import threading

import httpx

from loadtest.cluster import HTTP
from support.waiting import wait_until

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 1}


def test_cold_sequential_requests_spread_over_idle_replicas(cluster):
    """Equal loads tie; the tie is broken at random, not in favour of the first replica."""
    sims = [cluster.sim() for _ in range(3)]
    rt = cluster.router(sims)
    counts = collections.Counter(
        HTTP.post(rt.url + "/v1/completions", json=BODY).headers["x-kvroute-replica"] for _ in range(60))
    assert len(counts) == 3 and min(counts.values()) >= 6, counts


def test_concurrent_load_is_balanced(cluster):
    sims = [cluster.sim("--ttft-ms", "5", "--itl-ms", "30") for _ in range(3)]
    rt = cluster.router(sims)
    threads = [threading.Thread(target=httpx.post, args=(rt.url + "/v1/completions",),
                                kwargs={"json": {**BODY, "max_tokens": 40}, "timeout": 20}) for _ in range(12)]
    for t in threads:
        t.start()
    snapshot = {}
    def all_started():
        body = HTTP.get(rt.url + "/admin/replicas").json()
        snapshot.update({r["name"]: r["inflight"] for r in body["replicas"]})
        return sum(snapshot.values()) == 12
    wait_until(all_started, timeout=3)
    for t in threads:
        t.join()
    assert sorted(snapshot.values()) == [4, 4, 4], snapshot


def test_round_robin_cycles(cluster):
    sims = [cluster.sim() for _ in range(3)]
    rt = cluster.router(sims, "--policy", "round-robin")
    seq = [HTTP.post(rt.url + "/v1/completions", json=BODY).headers["x-kvroute-replica"] for _ in range(6)]
    assert seq[:3] == seq[3:] and len(set(seq[:3])) == 3


def test_requests_go_only_to_replicas_serving_the_model(cluster):
    a = cluster.sim(model="llama")
    b = cluster.sim(model="qwen")
    rt = cluster.router([a, b])
    for model, sim in (("llama", a), ("qwen", b)):
        for _ in range(5):
            r = HTTP.post(rt.url + "/v1/completions", json={**BODY, "model": model})
            assert r.headers["x-kvroute-replica"] == "127.0.0.1:%d" % sim.port
    ids = sorted(m["id"] for m in HTTP.get(rt.url + "/v1/models").json()["data"])
    assert ids == ["llama", "qwen"]
    r = HTTP.post(rt.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", "two models: the client must choose"


def test_models_list_only_ready_replicas(cluster):
    a = cluster.sim(model="llama")
    b = cluster.sim(model="qwen")
    rt = cluster.router([a, b], "--set", "health.interval_s=0.2")
    b.kill()
    wait_until(lambda: [m["id"] for m in HTTP.get(rt.url + "/v1/models").json()["data"]] == ["llama"], timeout=2)
