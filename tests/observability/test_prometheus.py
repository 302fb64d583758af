"""A real Prometheus scrapes a router and its replicas; the dashboard and the alert rules hold against it.

Every query of every Grafana panel is evaluated through Prometheus's HTTP API after a run that makes
each of them mean something (cache hits, a failing replica, a Redis outage, a full queue, a refused
client, KV events); a panel that stays empty fails. The alert rules are checked and unit-tested with
promtool, and evaluated by the same Prometheus without errors.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from loadtest.cluster import prometheus_server, wait_redis
from loadtest.tiny_model import write_tokenizer
from loadtest.cluster import HTTP
from support.state import set_faults
from support.traffic import text
from support.waiting import wait_until
from support.paths import DEPLOY

pytestmark = pytest.mark.timeout(180)

PROM_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvroute.json"


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)


def test_alert_rules_are_valid():
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 14 rules found" in out.stdout


def test_alert_rules_fire_as_their_unit_tests_specify():
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_deploy_configuration_loads_the_alert_rules():
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]


def query(prom, expr: str) -> list[dict]:
    r = HTTP.get(prom.url + "/api/v1/query", params={"query": expr}, timeout=5)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def has_data(prom, expr: str) -> bool:
    """At least one series with a number (histogram_quantile over no observations gives NaN)."""
    return any(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in query(prom, expr))


def send(client: httpx.Client, url: str, prompt: str, stream: bool = False) -> int:
    try:
        r = client.post(url + "/v1/completions", timeout=10,
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream})
        return r.status_code
    except httpx.HTTPError:
        return -1


def oversized_header(url: str) -> bytes:
    """A request whose headers pass client.max_header_bytes: the router answers 431 itself."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 80_000 + b"\r\n\r\n")
        return s.recv(64)


@pytest.fixture
def scraped(cluster, redis_proc, tmp_path):
    """Two healthy replicas publishing KV events, one failing every request, a router on a shared
    Redis index with a queue that is quickly full, and Prometheus scraping all of them every 0.5 s."""
    root = str(write_tokenizer(tmp_path / "tiny"))
    sims = [cluster.sim("--ttft-ms", "30", "--itl-ms", "2", "--root", root, "--block-size", "16", "--kv-events")
            for _ in range(2)]
    bad = cluster.sim("--ttft-ms", "2", "--itl-ms", "1", "--root", root, "--block-size", "16")
    set_faults(bad, fail_status=500, fail_count=10_000)
    config = {
        "replicas": [{"url": s.url, "max_num_seqs": 2} for s in [*sims, bad]],
        "index": {"backend": f"redis://127.0.0.1:{redis_proc.port}/0", "retry_after_s": 0.5},
        "queue": {"max_size": 1, "timeout_s": 0.2},
        "health": {"eject_after": 3, "eject_s": 60},
    }
    rt = cluster.router([], config=config)
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(yaml.safe_dump({
        # 1 s, so that a scrape of a busy stand-in has a whole second before it times out
        "global": {"scrape_interval": "1s", "evaluation_interval": "500ms"},
        "rule_files": [str(PROM_DIR / "alerts.yml")],
        "scrape_configs": [
            {"job_name": "kvroute", "static_configs": [{"targets": [f"127.0.0.1:{rt.port}"]}]},
            {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{p.port}" for p in [*sims, bad]]}]},
        ],
    }))
    prom = prometheus_server(prom_cfg, tmp_path / "tsdb", log_dir=tmp_path)
    cluster.procs.append(prom.start())
    prom.wait_http("/-/ready", timeout=30)
    return rt, prom, redis_proc


def test_every_dashboard_panel_query_returns_data(scraped):
    rt, prom, redis = scraped
    rng = random.Random(7)
    system = [text(rng, 120) for _ in range(3)]
    fallback_alert = []
    with httpx.Client() as client:
        def traffic(rounds: int) -> list[int]:
            prompts = [system[rng.randrange(3)] + text(rng, 10) for _ in range(rounds)]
            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda p: send(client, rt.url, p, stream=rng.random() < 0.5), prompts))

        statuses = traffic(40)
        assert oversized_header(rt.url).startswith(b"HTTP/1.1 431")
        # A burst past the replicas' capacity (2 + 2 + the queue's 1): some are rejected with 429.
        with ThreadPoolExecutor(12) as pool:
            burst = list(pool.map(lambda i: send(client, rt.url, system[0] + text(rng, 10)), range(12)))
        assert 429 in burst
        redis.stop()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not fallback_alert:
            statuses += traffic(4)
            fallback_alert = [a for a in HTTP.get(prom.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
                              if a["labels"]["alertname"] == "KvrouteIndexFallback"]
        redis.start()
        wait_redis(redis)
        statuses += traffic(20)
    assert set(statuses) == {200}, statuses
    assert fallback_alert and fallback_alert[0]["state"] == "pending"

    empty: list[tuple[str, str]] = []
    queries = panel_queries()
    client = httpx.Client()

    def all_have_data() -> bool:
        # traffic goes on, past the capacity (2 + 2) now and then: rates over the last minute stay up, the queue's too
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda p: send(client, rt.url, p), [system[0] + text(rng, 10) for _ in range(6)]))
        empty[:] = [(title, expr) for title, expr in queries if not has_data(prom, expr)]
        return not empty

    try:
        wait_until(all_have_data, timeout=40, interval=0.5)
    except AssertionError:
        pass
    finally:
        client.close()
    assert not empty, "panels without data:\n" + "\n".join(f"  {t}: {e}" for t, e in empty)
    assert len(queries) >= 19


def test_prometheus_scrapes_every_target_and_evaluates_every_rule(scraped):
    rt, prom, _ = scraped
    with httpx.Client() as client:
        for i in range(5):
            send(client, rt.url, f"hello {i}")

    def all_up() -> bool:
        targets = HTTP.get(prom.url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return len(targets) == 4 and all(t["health"] == "up" for t in targets)

    wait_until(all_up, timeout=15, interval=0.25)

    def evaluated() -> list[dict]:
        groups = HTTP.get(prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    wait_until(lambda: all(r.get("lastEvaluation", "").startswith("20") for r in evaluated()), 15, 0.25)
    rules = evaluated()
    assert len(rules) == 14
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
