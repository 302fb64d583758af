"""Start-up, drain/undrain and graceful shutdown."""

import json
import signal
import threading
import time

import httpx
import pytest

from loadtest.cluster import HTTP
from support.sse import sse_events
from support.waiting import refused, wait_until


def stream_running(rt, sim, max_tokens: int) -> tuple[threading.Thread, list[list[str]]]:
    """A streaming request through ``rt``, started in a thread and running on ``sim`` when this returns."""
    out: list[list[str]] = []

    def stream() -> None:
        r = HTTP.post(rt.url + "/v1/chat/completions", timeout=20, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens, "stream": True})
        out.append(sse_events(r.content))

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: HTTP.get(sim.url + "/sim/state").json()["counters"]["running"] == 1, timeout=3)
    return t, out


def test_sigterm_lets_inflight_streams_finish_and_refuses_new_connections(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "40")
    rt = cluster.router([sim], "--set", "shutdown_grace_s=10")
    t, out = stream_running(rt, sim, 30)
    rt.signal(signal.SIGTERM)
    time.sleep(0.2)
    with pytest.raises(httpx.ConnectError):
        HTTP.get(rt.url + "/health", timeout=1)
    t.join(10)
    assert out and out[0][-1] == "[DONE]" and len(out[0]) == 1 + 30 + 1
    assert rt.popen.wait(10) == 0


def test_sigterm_ends_streams_that_outlast_the_grace_period_with_an_error_event(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "100")
    rt = cluster.router([sim], "--set", "shutdown_grace_s=0.5")
    with HTTP.stream("POST", rt.url + "/v1/chat/completions", timeout=20, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "stream": True}) as r:
        chunks = r.iter_raw()
        raw = next(chunks)
        start = time.monotonic()
        rt.signal(signal.SIGTERM)
        for chunk in chunks:
            raw += chunk
    assert time.monotonic() - start < 3
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert rt.popen.wait(5) == 0
    assert "Traceback" not in rt.log_tail()
    assert " ERROR " not in rt.log_tail()  # streams cut at the end of the grace period are expected: a warning
    wait_until(lambda: HTTP.get(sim.url + "/sim/state").json()["counters"]["aborted"] == 1, timeout=2)


def test_drained_replica_gets_no_new_requests_and_undrain_restores_it(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([], config={"replicas": [{"name": "a", "url": a.url}, {"name": "b", "url": b.url}]})
    r = HTTP.post(rt.url + "/admin/replicas/a/drain")
    assert r.status_code == 200 and r.json()["drained"] is True
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    assert {HTTP.post(rt.url + "/v1/completions", json=body).headers["x-kvroute-replica"] for _ in range(20)} == {"b"}
    HTTP.post(rt.url + "/admin/replicas/a/undrain").raise_for_status()
    assert "a" in {HTTP.post(rt.url + "/v1/completions", json=body).headers["x-kvroute-replica"] for _ in range(30)}


def test_draining_every_replica_makes_the_router_unready(cluster):
    a = cluster.sim()
    rt = cluster.router([], config={"replicas": [{"name": "a", "url": a.url}]})
    HTTP.post(rt.url + "/admin/replicas/a/drain").raise_for_status()
    assert HTTP.get(rt.url + "/ready").status_code == 503
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"


def test_unknown_replica_in_admin_is_404(cluster):
    a = cluster.sim()
    rt = cluster.router([a])
    r = HTTP.post(rt.url + "/admin/replicas/ghost/drain")
    assert r.status_code == 404 and "ghost" in r.json()["error"]["message"]


def test_replica_that_starts_late_becomes_ready_when_it_answers(cluster):
    from loadtest.cluster import free_port
    port = free_port()
    rt = cluster.router([f"http://127.0.0.1:{port}"], "--set", "health.interval_s=0.2", wait_ready=False)
    assert HTTP.get(rt.url + "/ready").status_code == 503
    view = HTTP.get(rt.url + "/admin/replicas").json()["replicas"][0]
    assert view["state"] == "starting"
    cluster.sim(port=port)
    took = wait_until(lambda: HTTP.get(rt.url + "/ready").status_code == 200, timeout=3)
    assert took < 1.0


def test_sigterm_turns_ready_to_503_while_requests_are_still_served_when_something_polls_ready(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "40")
    rt = cluster.router([sim], "--set", "shutdown_grace_s=10")
    with httpx.Client(timeout=5) as http:
        for _ in range(4):  # a load balancer polling every second
            assert http.get(rt.url + "/ready").status_code == 200
            time.sleep(1.0)
    t, out = stream_running(rt, sim, 40)
    rt.signal(signal.SIGTERM)
    time.sleep(0.1)
    r = HTTP.get(rt.url + "/ready", timeout=2)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    # still served: the balancer has not seen the 503 yet (with polls 0.4 s apart the window was 0.8 s, and
    # a loaded CI machine once took longer than that to send this request)
    assert HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                      timeout=5).status_code == 200
    wait_until(lambda: refused(rt.url + "/health"), timeout=5)  # then the listener closes (two polls: ~2 s)
    t.join(10)
    assert out and out[0][-1] == "[DONE]" and len(out[0]) == 1 + 40 + 1
    assert rt.popen.wait(10) == 0

