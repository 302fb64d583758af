"""/metrics reports what happened, with the right values, after a scripted sequence of requests."""

import threading

from prometheus_client.parser import text_string_to_metric_families

from loadtest.cluster import HTTP
from support.state import set_faults
from support.waiting import wait_until


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(HTTP.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scripted_sequence(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([], config={
        "replicas": [{"name": "a", "url": a.url}, {"name": "b", "url": b.url, "max_num_seqs": 1}],
        "policy": "round-robin", "queue": {"max_size": 0}})
    post = lambda body: HTTP.post(rt.url + "/v1/completions", json=body, timeout=10)
    ok = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    for _ in range(4):  # round robin: a, b, a, b
        assert post(ok).status_code == 200
    assert post({"model": "nope", "prompt": "x"}).status_code == 404
    assert post({"model": "tiny"}).status_code == 400
    assert post({**ok, "max_tokens": 100000}).status_code == 400  # the replica's 400, passed through
    set_faults(a, fail_status=500, fail_count=1)
    r = post(ok)  # either a fails first and b answers, or b answers at once; a's fault then hits the next
    r2 = post(ok)
    assert r.status_code == r2.status_code == 200

    m = scrape(rt.url)
    assert value(m, "kvroute_requests_total", model="tiny", replica="none", status="404") == 0
    assert value(m, "kvroute_requests_total", model="other", replica="none", status="404") == 1
    assert value(m, "kvroute_requests_total", model="", replica="none", status="400") == 1
    ok_a = value(m, "kvroute_requests_total", model="tiny", replica="a", status="200")
    ok_b = value(m, "kvroute_requests_total", model="tiny", replica="b", status="200")
    bad = (value(m, "kvroute_requests_total", model="tiny", replica="a", status="400")
           + value(m, "kvroute_requests_total", model="tiny", replica="b", status="400"))
    assert ok_a + ok_b == 6 and bad == 1
    assert value(m, "kvroute_retries_total", reason="status_5xx") == 1
    assert value(m, "kvroute_upstream_errors_total", replica="a", kind="status_5xx") == 1
    ttfb_count = sum(value(m, "kvroute_time_to_first_byte_seconds_count", replica=n) for n in "ab")
    assert ttfb_count == 7, "one first byte per request that reached a replica and got an answer"
    assert sum(value(m, "kvroute_request_duration_seconds_count", replica=n) for n in "ab") == 7
    assert value(m, "kvroute_inflight_requests", replica="a") == 0
    assert value(m, "kvroute_inflight_requests", replica="b") == 0
    assert value(m, "kvroute_replica_ready", replica="a") == 1
    assert value(m, "kvroute_queue_length") == 0


def test_inflight_queue_and_rejections_while_busy(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "20")
    rt = cluster.router([], config={"replicas": [{"name": "only", "url": sim.url, "max_num_seqs": 2}],
                                    "queue": {"max_size": 1, "timeout_s": 10}})
    results = []
    def run():
        results.append(HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 150},
                                  timeout=20).status_code)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: value(scrape(rt.url), "kvroute_queue_length") == 1, timeout=3)
    m = scrape(rt.url)
    assert value(m, "kvroute_inflight_requests", replica="only") == 2
    assert HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 429
    for t in threads:
        t.join()
    m = scrape(rt.url)
    assert sorted(results) == [200, 200, 200]
    assert value(m, "kvroute_queue_rejected_total", reason="full") == 1
    assert value(m, "kvroute_queue_wait_seconds_count") == 1
    assert value(m, "kvroute_queue_wait_seconds_sum") > 0.3
    assert value(m, "kvroute_requests_total", model="tiny", replica="none", status="429") == 1


def test_replica_readiness_and_engine_stats(cluster):
    sim = cluster.sim()
    rt = cluster.router([], config={"replicas": [{"name": "r", "url": sim.url}], "health": {"interval_s": 0.2}})
    wait_until(lambda: value(scrape(rt.url), "kvroute_replica_ready", replica="r") == 1, timeout=3)
    sim.kill()
    wait_until(lambda: value(scrape(rt.url), "kvroute_replica_ready", replica="r") == 0, timeout=2)


def test_counters_export_no_created_series(cluster):
    rt = cluster.router([cluster.sim()])
    HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=5)
    assert "_created" not in HTTP.get(rt.url + "/metrics").text
