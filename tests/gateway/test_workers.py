"""Several worker processes on one port (kvroute serve --workers N)."""

import asyncio
import signal
import subprocess
import sys
import threading

import httpx

from support.sse import sse_events
from support.state import sim_state
from support.waiting import wait_until
from loadtest.cluster import ROOT


def test_two_workers_never_put_more_than_max_num_seqs_on_a_replica(cluster):
    sims = [cluster.sim("--ttft-ms", "20", "--itl-ms", "2") for _ in range(2)]
    rt = cluster.router([], "--workers", "2", config={"policy": "least-loaded", "replicas": [
        {"name": f"r{i}", "url": s.url, "max_num_seqs": 4} for i, s in enumerate(sims)]})

    async def flood():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            return await asyncio.gather(*(client.post(rt.url + "/v1/completions", json={
                "model": "tiny", "prompt": f"request {i}", "max_tokens": 4}) for i in range(200)))

    responses = asyncio.run(flood())
    assert [r.status_code for r in responses] == [200] * 200
    states = [sim_state(s) for s in sims]
    assert sum(st["completed"] for st in states) == 200
    # each replica was kept busy up to its limit, never past it, although two processes sent to it
    assert [st["peak_in_flight"] for st in states] == [4, 4], states


def test_sigterm_lets_in_flight_streams_finish_on_every_worker(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "40")
    rt = cluster.router([sim], "--workers", "2", "--policy", "least-loaded")
    bodies: list[bytes] = []

    def stream() -> None:
        with httpx.Client(timeout=30) as client:  # one connection per stream: spread over the workers
            r = client.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 30,
                                                              "stream": True})
            bodies.append(r.content)

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: sim_state(sim)["running"] == 8, timeout=5)
    rt.signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert rt.popen.wait(20) == 0
    assert len(bodies) == 8
    for body in bodies:
        events = sse_events(body)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events) and len(events) == 31


def test_several_workers_with_a_cache_aware_policy_need_a_shared_index():
    out = subprocess.run([sys.executable, "-m", "router", "serve", "--workers", "2", "--port", "0",
                          "--replica", "http://127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "workers" in out.stderr and "--index redis://" in out.stderr


def test_sessions_stick_across_workers_without_redis(cluster):
    sims = [cluster.sim("--ttft-ms", "1", "--itl-ms", "1") for _ in range(3)]
    rt = cluster.router(sims, "--workers", "2", "--policy", "least-loaded")
    placed = {}
    for session in range(4):
        seen = set()
        for turn in range(8):
            with httpx.Client(timeout=10) as client:  # a new connection each turn: either worker may take it
                r = client.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": f"turn {turn}",
                                                                  "max_tokens": 1},
                                headers={"x-session-id": f"conversation-{session}"})
            assert r.status_code == 200
            seen.add(r.headers["x-kvroute-replica"])
        placed[session] = seen
    assert all(len(seen) == 1 for seen in placed.values()), placed
