"""Mid-stream failover against stand-in replicas: a stream its replica breaks goes on on another one.

Each test has a replica that breaks (or stalls) every stream after a few chunks and a good one;
requests are sent until one lands on the bad replica first (its name is in x-kvroute-replica).
"""

from __future__ import annotations

import json
import sys

import pytest

from support.processes import FAST
from loadtest.cluster import HTTP
from support.sse import sse_events
from support.state import replicas_view, set_faults, sim_state
from loadtest.cluster import Proc, free_port

pytestmark = pytest.mark.timeout(120)


def stream(rt, path: str, body: dict) -> tuple[str, list[dict | str]]:
    r = HTTP.post(rt.url + path, json={"model": "tiny", "stream": True, **body}, timeout=30)
    if r.status_code != 200:
        return r.headers.get("x-kvroute-replica", ""), []
    events = [e if e == "[DONE]" else json.loads(e) for e in sse_events(r.content)]
    return r.headers["x-kvroute-replica"], events


def on_bad(rt, bad, path: str, body: dict) -> list[dict | str]:
    """The events of the first stream that started on ``bad`` (requests that land elsewhere are skipped)."""
    name = f"127.0.0.1:{bad.port}"
    for _ in range(20):
        replica, events = stream(rt, path, body)
        if replica == name:
            return events
    raise AssertionError("no request went to the bad replica first")


def text_of(events: list[dict | str]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            if piece:
                out.append(piece)
    return out


def failovers(rt, outcome: str) -> float:
    for line in HTTP.get(rt.url + "/metrics").text.splitlines():
        if line.startswith(f'kvroute_stream_failovers_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def pair(cluster):
    bad = cluster.sim(*FAST, "--die-after-chunks", "5")
    good = cluster.sim(*FAST)
    rt = cluster.router([bad, good], "--set", "health.eject_after=100")
    return rt, bad, good


def test_a_broken_completion_stream_continues_with_the_text_so_far_appended_to_the_prompt(pair):
    rt, bad, good = pair
    prompt = "Tell me about caches. " * 20
    events = on_bad(rt, bad, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "echo": True,
                                                  "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    pieces = text_of(events)
    assert len(pieces) == 12
    sent = sim_state(good)["last_body"]
    assert sent["prompt"] == prompt + "".join(pieces[:5])  # the five chunks the bad replica sent
    assert sent["max_tokens"] == 7 and sent["echo"] is False
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    direct = HTTP.post(good.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                        timeout=10).json()["usage"]["prompt_tokens"]
    assert abs(usage["prompt_tokens"] - direct) <= 2  # the continuation's prompt less the tokens it carried
    assert len({e["id"] for e in events[:-1]}) == 1 and len({e["created"] for e in events[:-1]}) == 1
    assert failovers(rt, "completed") == 1


def test_a_broken_chat_stream_continues_as_the_final_assistant_message(pair):
    rt, bad, good = pair
    messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "Why cache?"}]
    events = on_bad(rt, bad, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 10})
    assert events[-1] == "[DONE]"
    pieces = text_of(events)
    assert len(pieces) == 10
    roles = [e for e in events if isinstance(e, dict) and e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1  # the continuation's own role chunk is not passed on
    sent = sim_state(good)["last_body"]
    # the bad replica sent the role chunk and four tokens before it broke
    assert sent["messages"] == [*messages, {"role": "assistant", "content": "".join(pieces[:4])}]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["max_completion_tokens"] == 6
    assert {e["model"] for e in events[:-1]} == {"tiny"} and len({e["id"] for e in events[:-1]}) == 1
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_continuation_that_breaks_again_continues_on_a_third_replica(cluster):
    bads = [cluster.sim(*FAST, "--die-after-chunks", "4") for _ in range(2)]
    good = cluster.sim(*FAST)
    rt = cluster.router([*bads, good], "--set", "health.eject_after=100", "--set", "proxy.max_attempts=3")
    twice = []
    for i in range(40):  # until a continuation went to the other bad replica first
        replica, events = stream(rt, "/v1/completions", {"prompt": f"a b c {i}", "max_tokens": 11})
        assert events[-1] == "[DONE]" and len(text_of(events)) == 11
        if sim_state(good)["last_body"].get("max_tokens") == 3:  # 11 - 4 - 4
            twice.append(i)
            break
    assert twice
    assert failovers(rt, "completed") >= 1 and failovers(rt, "failed") == 0


def test_a_stream_that_falls_silent_continues_on_another_replica(cluster):
    bad = cluster.sim(*FAST, "--stall-after-chunks", "3")
    good = cluster.sim(*FAST)
    rt = cluster.router([bad, good], "--set", "proxy.stream_idle_timeout_s=0.5", "--set", "health.eject_after=100")
    events = on_bad(rt, bad, "/v1/completions", {"prompt": "slow", "max_tokens": 6})
    assert events[-1] == "[DONE]" and len(text_of(events)) == 6
    assert sim_state(good)["last_body"]["max_tokens"] == 3


def test_a_stream_broken_after_its_last_token_ends_with_the_usage_the_client_asked_for(cluster):
    # four tokens, then the connection drops before the usage chunk and [DONE]
    bad = cluster.sim(*FAST, "--die-after-chunks", "4")
    good = cluster.sim(*FAST)
    rt = cluster.router([bad, good], "--set", "health.eject_after=100")
    events = on_bad(rt, bad, "/v1/completions", {"prompt": "done soon", "max_tokens": 4,
                                                  "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and len(text_of(events)) == 4
    assert events[-2]["usage"]["completion_tokens"] == 4 and events[-2]["id"] == events[0]["id"]
    assert "kvroute_retries_total{" not in HTTP.get(rt.url + "/metrics").text  # nothing was sent again


def test_a_stream_with_logprobs_is_not_continued(pair):
    rt, bad, good = pair
    events = on_bad(rt, bad, "/v1/completions", {"prompt": "x", "max_tokens": 10, "logprobs": 1})
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_disconnected"
    assert failovers(rt, "not_resumable") == 1 and failovers(rt, "completed") == 0


def test_a_continuation_the_other_replica_refuses_ends_the_stream_with_an_error_event(pair):
    rt, bad, good = pair
    set_faults(good, fail_status=400, fail_count=1000)
    events = on_bad(rt, bad, "/v1/completions", {"prompt": "x", "max_tokens": 10})
    assert len(text_of(events)) == 5
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "upstream_error"
    assert failovers(rt, "failed") == 1


def test_a_stream_broken_before_its_first_chunk_is_answered_whole_by_another_replica(cluster):
    bad = cluster.sim(*FAST, "--die-after-chunks", "0")  # headers, then the connection drops
    good = cluster.sim(*FAST)
    rt = cluster.router([bad, good], "--set", "health.eject_after=100")
    events = on_bad(rt, bad, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 5})
    assert events[-1] == "[DONE]" and len(text_of(events)) == 5
    assert "role" in events[0]["choices"][0]["delta"]  # the continuation's role chunk is the stream's first
    assert sim_state(good)["last_body"]["messages"] == [{"role": "user", "content": "hi"}]


def test_the_replica_that_completes_a_continuation_is_judged_by_its_own_answer(pair):
    rt, bad, good = pair
    on_bad(rt, bad, "/v1/completions", {"prompt": "x", "max_tokens": 8})
    view = replicas_view(rt)
    assert view[good.url]["failed_requests_in_a_row"] == 0 and view[good.url]["state"] == "ready"
    assert view[bad.url]["failed_requests_in_a_row"] >= 1


def bad_and_good(cluster, mode: str):
    port = free_port()
    bad = Proc("bad", [sys.executable, "-m", "loadtest.bad_replica", "--port", str(port), "--mode", mode], port,
               log_path=cluster.log_dir / "bad.log")
    cluster.procs.append(bad.start())
    bad.wait_http("/health")
    good = cluster.sim(*FAST)
    rt = cluster.router([], config={"replicas": [{"url": bad.url}, {"url": good.url}], "health": {"eject_after": 100}})
    return rt, bad, good


def test_half_an_event_from_the_broken_replica_never_reaches_the_client(cluster):
    rt, bad, good = bad_and_good(cluster, "truncated_chunked")
    events = on_bad(rt, bad, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 3})
    assert events[-1] == "[DONE]" and len(text_of(events)) == 3
    assert all(isinstance(e, dict) and "error" not in e and e["id"] == events[0]["id"] for e in events[:-1])


def test_an_event_stream_answering_a_json_request_is_read_whole_and_retried_when_it_breaks(cluster):
    rt, bad, good = bad_and_good(cluster, "truncated_chunked")
    for _ in range(6):  # whichever replica each lands on first
        r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.content[:200]
        assert r.json()["choices"][0]["text"]


def test_a_stream_does_not_pass_on_the_replicas_content_length(cluster):
    # the replica declares 100 bytes and sends 26 of an invalid event: the client gets them, then an error
    # event, with no length that those would contradict
    rt, bad, good = bad_and_good(cluster, "invalid_sse")
    for _ in range(10):
        r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                         "stream": True}, timeout=10)
        assert "content-length" not in r.headers
        if r.headers["x-kvroute-replica"] == f"127.0.0.1:{bad.port}":
            assert sse_events(r.content)[-1] == "[DONE]" and '"error"' in sse_events(r.content)[-2]
            return
    raise AssertionError("no request went to the bad replica first")
