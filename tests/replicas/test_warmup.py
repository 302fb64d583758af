"""A replica warming up (refusing connections until it listens, as Gaudi replicas do) is starting, not failing."""

from __future__ import annotations

import re
import time


from loadtest.cluster import HTTP
from support.state import replicas_view
from support.waiting import wait_until

WARMUP_S = 10


def error_samples(text: str) -> dict[str, float]:
    """Samples an operator alerts on: upstream errors, retries, readiness."""
    out = {}
    for line in text.splitlines():
        if re.match(r"kvroute_(upstream_errors_total|retries_total|replica_ready|replica_restarts_total)\b", line):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_a_replica_warming_up_is_starting_moves_no_error_metric_and_takes_traffic_once_ready(cluster):
    up = cluster.sim()
    warming = cluster.sim("--warmup-s", str(WARMUP_S), wait=False)
    rt = cluster.router([up, warming], "--set", "health.interval_s=0.2", "--set", "health.metrics_interval_s=0.2")
    name = f"127.0.0.1:{warming.port}"
    before = error_samples(HTTP.get(rt.url + "/metrics").text)
    log_before = rt.log_tail(100_000)
    for _ in range(20):  # traffic meanwhile goes to the ready replica
        r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] != name
    time.sleep(3)
    assert replicas_view(rt)[warming.url]["state"] == "starting"
    assert error_samples(HTTP.get(rt.url + "/metrics").text) == before
    new_log = rt.log_tail(100_000)[len(log_before):]
    assert "WARNING" not in new_log and "ERROR" not in new_log, new_log

    wait_until(lambda: replicas_view(rt)[warming.url]["state"] == "ready", timeout=WARMUP_S + 20, interval=0.2)
    after = error_samples(HTTP.get(rt.url + "/metrics").text)
    assert {k: v for k, v in after.items() if "replica_ready" not in k} == \
        {k: v for k, v in before.items() if "replica_ready" not in k}
    served = set()
    for i in range(40):
        r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": f"p{i} " * 50, "max_tokens": 2})
        assert r.status_code == 200
        served.add(r.headers["x-kvroute-replica"])
    assert name in served
    assert "WARNING" not in rt.log_tail(100_000)[len(log_before):]


def test_a_replica_that_never_listens_is_reported_failed_to_start_after_the_startup_timeout(cluster):
    up = cluster.sim()
    never = cluster.sim("--warmup-s", "600", wait=False)
    rt = cluster.router([up, never], "--set", "health.interval_s=0.2", "--set", "health.startup_timeout_s=2")
    wait_until(lambda: replicas_view(rt)[never.url]["state"] == "unready", timeout=10, interval=0.2)
    view = replicas_view(rt)[never.url]
    assert view["failed_to_start"].startswith("did not become ready within 2 s")
    wait_until(lambda: "failed to start" in rt.log_tail(100_000), timeout=5)  # written by the logging thread
    log = rt.log_tail(100_000)
    assert log.count("failed to start") == 1, log
