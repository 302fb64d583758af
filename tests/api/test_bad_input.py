"""Hostile input: the router answers it cleanly and keeps its logs and metrics bounded; the stand-in refuses
what vLLM refuses."""

from __future__ import annotations

import httpx

from loadtest.cluster import HTTP
from support.waiting import wait_until

CHAT = "/v1/chat/completions"


def nested(depth: int) -> bytes:
    """A JSON array nested ``depth`` deep (as text: Python's own encoder stops near 1,000 levels)."""
    return b"[" * depth + b'"x"' + b"]" * depth


def raw_post(url: str, body: bytes) -> httpx.Response:
    return HTTP.post(url, content=body, headers={"content-type": "application/json"}, timeout=10)


def test_content_nested_too_deep_to_key_is_routed_and_answered_by_the_replica(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    body = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [' + nested(985) + b"]}]}"
    r = raw_post(rt.url + CHAT, body)
    assert r.status_code == 400, r.text  # the replica's verdict, as vLLM gives it
    assert r.headers["content-type"].startswith("application/json") and "error" in r.json()
    assert "RecursionError" not in rt.log_tail()
    assert HTTP.post(rt.url + CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "ok"}]},
                      timeout=10).status_code == 200


def test_a_body_nested_past_the_parsers_limit_is_a_400_from_the_router(cluster):
    rt = cluster.router([cluster.sim()])
    r = raw_post(rt.url + CHAT, b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "Traceback" not in rt.log_tail()


def test_a_client_cannot_send_kv_transfer_parameters_which_are_the_routers_to_set(cluster):
    sim = cluster.sim("--kv-connector", "NixlConnector", "--ttft-ms", "2", "--itl-ms", "1")
    rt = cluster.router([sim])
    r = HTTP.post(rt.url + "/v1/completions", timeout=10, json={
        "model": "tiny", "prompt": "x" * 2000, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "reserved_field"
    state = HTTP.get(sim.url + "/sim/state", timeout=5).json()
    assert state["counters"]["received"] == 0 and state["kv_transfer"]["held"] == 0


def test_a_newline_in_the_model_name_cannot_forge_a_log_line(cluster):
    rt = cluster.router([cluster.sim()])
    forged = "tiny\n2026-01-01 00:00:00,000 INFO kvroute.proxy: /v1/chat/completions admin -> x 200 ok"
    HTTP.post(rt.url + CHAT, json={"model": forged, "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    wait_until(lambda: "tiny\\n2026-01-01" in rt.log_tail(), timeout=5)  # a thread writes the log
    assert not any(line.startswith("2026-01-01 00:00:00,000") for line in rt.log_tail().splitlines())


def test_model_names_no_replica_serves_share_one_metric_label(cluster):
    rt = cluster.router([cluster.sim()])
    before = len(HTTP.get(rt.url + "/metrics").content)
    with httpx.Client(timeout=10) as http:
        for i in range(300):
            http.post(rt.url + CHAT, json={"model": f"made-up-{i}-" + "m" * 1000,
                                           "messages": [{"role": "user", "content": "x"}]})
        http.post(rt.url + CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    text = HTTP.get(rt.url + "/metrics").text
    assert "made-up-" not in text
    assert 'model="other"' in text and 'model="tiny"' in text
    assert len(text) < before + 4096


def test_the_stand_in_refuses_what_vllm_refuses(cluster):
    sim = cluster.sim()
    url = sim.url + "/v1/completions"
    for body in (b'{"model": "tiny", "prompt": "x", "max_tokens": "abc"}',
                 b'{"model": "tiny", "prompt": "x", "stream": "maybe"}',
                 b'{"model": "tiny", "prompt": [' + nested(985) + b"]}"):
        r = raw_post(url, body)
        assert r.status_code == 400, (body[:80], r.status_code, r.text)
        assert r.json()["error"]["code"] == 400
    r = raw_post(url, b'{"model": "tiny", "prompt": "a \\ud800 b"}')  # a lone surrogate
    assert r.status_code == 400, r.text


def test_the_stand_in_reads_lax_booleans_and_integers_as_vllm_does(cluster):
    sim = cluster.sim()
    r = HTTP.post(sim.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": "false",
                                                      "max_tokens": "3"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json()["usage"]["completion_tokens"] == 3


def test_a_huge_model_name_gets_a_small_answer_and_a_small_log_line(cluster):
    rt = cluster.router([cluster.sim()])
    log_before = len(rt.log_tail(10**9))
    for size in (30 * 1024 * 1024, 5000):
        r = HTTP.post(rt.url + CHAT, json={"model": "m" * size, "messages": [{"role": "user", "content": "x"}]},
                      timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_too_long"
        assert len(r.content) < 1000
    r = HTTP.post(rt.url + CHAT, json={"model": "n" * 1000, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and len(r.content) < 1000  # a name no replica serves: shown cut short
    wait_until(lambda: len(rt.log_tail(10**9)) > log_before, timeout=5)
    assert len(rt.log_tail(10**9)) - log_before < 8000
