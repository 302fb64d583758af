"""A soak: mixed traffic for a long time (SOAK_SECONDS, 20 minutes by default; CI runs a shorter one) with
clients that leave mid-stream, replicas restarted in turn and Redis restarted; the router's memory, tasks and
open files sampled every 10 s from its /metrics. Memory may not grow by 10% from the end of warm-up
(minute 2, or a third of a shorter run) to the end."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from loadtest.cluster import HTTP
from support.traffic import Load
from loadtest.cluster import redis_server, wait_redis

SOAK_S = float(os.environ.get("SOAK_SECONDS", "1200"))
pytestmark = [pytest.mark.soak, pytest.mark.timeout(SOAK_S + 300)]


def sample(url: str) -> dict[str, float]:
    wanted = ("process_resident_memory_bytes", "process_open_fds", "kvroute_event_loop_tasks", "kvroute_index_blocks")
    out: dict[str, float] = {}
    for line in HTTP.get(url + "/metrics", timeout=5).text.splitlines():
        for name in wanted:
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def leaver(url: str, stop: threading.Event, left: list[int]) -> None:
    """A client that reads the first bytes of a long stream and hangs up."""
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            try:
                with client.stream("POST", url + "/v1/completions", json={
                        "model": "tiny", "prompt": "leave early " * 50, "max_tokens": 200, "stream": True}) as r:
                    next(r.iter_bytes())
                left[0] += 1
            except (httpx.HTTPError, StopIteration):
                pass
            time.sleep(0.2)


def test_soak(cluster, figure, tmp_path):
    redis = redis_server(log_dir=tmp_path).start()
    cluster.procs.append(redis)
    wait_redis(redis)
    sims = [cluster.sim("--ttft-ms", "5", "--itl-ms", "10") for _ in range(3)]
    rt = cluster.router(sims, "--index", f"redis://127.0.0.1:{redis.port}/0")
    warm = min(120.0, SOAK_S / 3)
    series: list[tuple[float, dict[str, float]]] = []
    stop = threading.Event()
    left = [0]
    leaving = threading.Thread(target=leaver, args=(rt.url, stop, left))
    start = time.monotonic()
    with Load(rt.url, clients=8, max_tokens=12) as load:
        leaving.start()
        next_sample = next_restart = next_redis = start
        turn = redis_restarts = 0
        while (now := time.monotonic()) - start < SOAK_S:
            if now >= next_sample:
                series.append((round(now - start), sample(rt.url)))
                next_sample += 10
            if now >= next_restart and now - start > 5:
                sims[turn % 3].restart()  # SIGTERM, then up again on the same port
                sims[turn % 3].wait_http()
                turn += 1
                next_restart = now + 30
            if now >= next_redis and now - start > 15:
                redis.restart()
                wait_redis(redis)
                redis_restarts += 1
                next_redis = now + 60
            time.sleep(0.5)
        stop.set()
        leaving.join(15)
    series.append((round(time.monotonic() - start), sample(rt.url)))
    rss = [(t, s["process_resident_memory_bytes"] / 2**20) for t, s in series]
    base = next(mb for t, mb in rss if t >= warm)
    growth = (rss[-1][1] - base) / base
    s = load.summary()
    figure({"seconds": SOAK_S, "requests": s["requests"], "failed": s["failed"], "failures": s["failures"],
            "left_mid_stream": left[0], "replica_restarts": turn, "redis_restarts": redis_restarts, "rss_mb": [(t, round(mb, 1)) for t, mb in rss],
            "rss_growth_after_warmup": round(growth, 3),
            "tasks": [int(x["kvroute_event_loop_tasks"]) for _, x in series],
            "open_fds": [int(x["process_open_fds"]) for _, x in series]})
    assert s["requests"] > SOAK_S * 20 and s["failed"] == 0, s
    assert growth < 0.10, rss
    assert max(x["kvroute_event_loop_tasks"] for _, x in series) < 200
    assert series[-1][1]["process_open_fds"] < 200
