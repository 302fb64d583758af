"""Latency targets per request (x-slo-ttft-ms, x-slo-tpot-ms): a request goes only to a replica predicted to meet
them; where none is, it is answered at once with 503 slo_unattainable (slo.on_miss reject, the default) or routed
anyway (route); a request waiting in the queue is answered when its target can no longer be met."""

import threading
import time

from loadtest.cluster import HTTP
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "a prompt of some forty words " * 8  # ~230 bytes: about 60 tokens


def post(rt, headers=None, stream=False, max_tokens=4, prompt=PROMPT):
    return HTTP.post(rt.url + "/v1/completions", headers=headers or {}, timeout=30,
                     json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})


def slo_count(rt, target, outcome):
    for fam in text_string_to_metric_families(HTTP.get(rt.url + "/metrics").text):
        for s in fam.samples:
            if s.name == "kvroute_slo_requests_total" and s.labels == {"target": target, "outcome": outcome}:
                return s.value
    return 0.0


def slow_and_fast(cluster, **config):
    """Two stand-ins: the first configured to prefill 20 tokens a second (a 60-token prompt: ~3 s), the other
    200,000; round robin, which alone would alternate between them."""
    slow, fast = cluster.sim(), cluster.sim()
    rt = cluster.router([], config={"policy": "round-robin", "prediction": {"correct": False}, "replicas": [
        {"url": slow.url, "name": "slow", "prefill_tokens_per_s": 20},
        {"url": fast.url, "name": "fast", "prefill_tokens_per_s": 200_000}], **config})
    return rt


def test_a_request_with_a_ttft_target_goes_only_where_it_is_predicted_to_be_met(cluster):
    rt = slow_and_fast(cluster)
    without = {post(rt).headers["x-kvroute-replica"] for _ in range(4)}
    assert without == {"slow", "fast"}
    served = {post(rt, {"x-slo-ttft-ms": "1000"}).headers["x-kvroute-replica"] for _ in range(6)}
    assert served == {"fast"}


def test_a_ttft_target_no_replica_can_meet_is_answered_503_at_once(cluster):
    rt = slow_and_fast(cluster)
    started = time.monotonic()
    r = post(rt, {"x-slo-ttft-ms": "0.001"})
    assert time.monotonic() - started < 1.0
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "slo_unattainable" and err["param"] == "x-slo-ttft-ms"
    assert "predicted at" in err["message"]
    assert slo_count(rt, "ttft", "rejected") == 1


def test_with_on_miss_route_an_unmeetable_target_is_served_anyway(cluster):
    rt = slow_and_fast(cluster, slo={"on_miss": "route"})
    r = post(rt, {"x-slo-ttft-ms": "0.001"})
    assert r.status_code == 200
    assert slo_count(rt, "ttft", "routed") == 1


def test_a_queued_request_is_answered_when_its_target_can_no_longer_be_met(cluster):
    sim = cluster.sim("--ttft-ms", "10", "--itl-ms", "100")
    rt = cluster.router([], config={"replicas": [{"url": sim.url, "max_num_seqs": 1, "prefill_tokens_per_s": 1e6}]})
    holder = threading.Thread(target=post, args=(rt,), kwargs={"max_tokens": 40}, daemon=True)  # ~4 s
    holder.start()
    time.sleep(0.3)
    started = time.monotonic()
    r = post(rt, {"x-slo-ttft-ms": "600"})
    waited = time.monotonic() - started
    holder.join()
    assert r.status_code == 503 and r.json()["error"]["code"] == "slo_unattainable"
    assert 0.4 < waited < 1.5  # about its target, not the queue's 30 s timeout nor the holder's 4 s


def test_a_tpot_target_is_judged_by_the_replicas_measured_streams(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "40")
    rt = cluster.router([sim])
    assert post(rt, {"x-slo-tpot-ms": "10"}).status_code == 200  # nothing measured yet: not judged
    for _ in range(3):
        assert post(rt, stream=True, max_tokens=8).status_code == 200
    r = post(rt, {"x-slo-tpot-ms": "10"})
    assert r.status_code == 503 and r.json()["error"]["param"] == "x-slo-tpot-ms"
    assert post(rt, {"x-slo-tpot-ms": "200"}).status_code == 200


def test_met_and_missed_targets_are_counted(cluster):
    sim = cluster.sim("--ttft-ms", "100", "--itl-ms", "1")
    rt = cluster.router([], config={"replicas": [{"url": sim.url, "prefill_tokens_per_s": 1e6}]})
    assert post(rt, {"x-slo-ttft-ms": "5000"}, stream=True).status_code == 200
    assert post(rt, {"x-slo-ttft-ms": "50"}, stream=True).status_code == 200  # predicted ~0: it is tried, and misses
    assert slo_count(rt, "ttft", "met") == 1
    assert slo_count(rt, "ttft", "missed") == 1


def test_a_latency_target_that_is_not_a_positive_number_is_a_400(cluster):
    rt = cluster.router([cluster.sim()])
    for bad in ("soon", "-5", "0", "nan", "1e12"):
        r = post(rt, {"x-slo-ttft-ms": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "x-slo-ttft-ms"
