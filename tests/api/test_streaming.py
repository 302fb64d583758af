"""Streams: first byte on arrival, upstream closed when the client leaves, stalls ended with an SSE error."""

import json
import socket
import time


from loadtest.cluster import HTTP
from support.sse import sse_events
from support.state import sim_state, set_faults
from support.waiting import wait_until

SLOW = ("--ttft-ms", "5", "--itl-ms", "50")


def stream_body(n: int = 100) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "stream": True}


def test_client_disconnect_cancels_the_upstream_request_within_a_second(cluster):
    sim = cluster.sim(*SLOW)
    rt = cluster.router([sim])
    with HTTP.stream("POST", rt.url + "/v1/chat/completions", json=stream_body(200), timeout=10) as r:
        chunks = r.iter_raw()
        next(chunks)
        next(chunks)
        assert sim_state(sim)["running"] == 1
        left = time.monotonic()
    # leaving the block closed the client connection mid-stream
    took = wait_until(lambda: sim_state(sim)["aborted"] == 1, timeout=1.0)
    assert sim_state(sim)["running"] == 0
    assert time.monotonic() - left < 1.0, took


def test_disconnect_while_waiting_for_a_non_streaming_answer_cancels_upstream(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "20")
    rt = cluster.router([sim])
    with socket.create_connection(("127.0.0.1", rt.port)) as s:
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 200}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: sim_state(sim)["running"] == 1, timeout=2)
    wait_until(lambda: sim_state(sim)["aborted"] == 1, timeout=1.0)
    view = HTTP.get(rt.url + "/admin/replicas").json()["replicas"][0]
    assert view["inflight"] == 0


def test_chunks_are_relayed_as_they_arrive(cluster):
    """With 50 ms between tokens the client sees them spaced out, not all at the end."""
    sim = cluster.sim(*SLOW)
    rt = cluster.router([sim])
    stamps = []
    with HTTP.stream("POST", rt.url + "/v1/chat/completions", json=stream_body(8), timeout=10) as r:
        for chunk in r.iter_raw():
            stamps.append(time.monotonic())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) >= 8
    assert sum(1 for g in gaps if g > 0.03) >= 6, gaps


def test_stalled_stream_ends_with_an_sse_error_event(cluster):
    sim = cluster.sim(*SLOW)
    rt = cluster.router([sim], "--set", "proxy.stream_idle_timeout_s=0.5")
    set_faults(sim, stall_after_chunks=3)
    start = time.monotonic()
    r = HTTP.post(rt.url + "/v1/chat/completions", json=stream_body(50), timeout=10)
    elapsed = time.monotonic() - start
    events = sse_events(r.content)
    assert r.status_code == 200
    assert len(events) == 3 + 2
    assert json.loads(events[-2])["error"]["code"] == "stream_idle_timeout"
    assert events[-1] == "[DONE]"
    assert 0.5 <= elapsed < 2.0
    # the stalled upstream request was closed, so the replica aborted it
    wait_until(lambda: sim_state(sim)["aborted"] == 1, timeout=1.0)


def test_a_stream_longer_than_the_idle_timeout_is_not_cut_while_its_events_keep_coming(cluster):
    """The idle limit is on each wait for the replica's next event: 40 tokens 50 ms apart outlast 0.5 s."""
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "50")
    rt = cluster.router([sim], "--set", "proxy.stream_idle_timeout_s=0.5")
    started = time.monotonic()
    r = HTTP.post(rt.url + "/v1/completions", timeout=10, json={
        "model": "tiny", "prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True})
    events = sse_events(r.content)
    assert time.monotonic() - started > 1.5
    assert r.status_code == 200
    assert len(events) == 40 + 1 and events[-1] == "[DONE]"
    assert not [e for e in events[:-1] if "error" in json.loads(e)]


def test_replica_dropping_the_stream_ends_it_with_an_sse_error_event(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    set_faults(sim, die_after_chunks=2)
    r = HTTP.post(rt.url + "/v1/chat/completions", json=stream_body(20), timeout=10)
    events = sse_events(r.content)
    assert len(events) == 2 + 2
    assert json.loads(events[-2])["error"]["code"] == "upstream_disconnected"
    assert events[-1] == "[DONE]"
