"""The Responses API and the other endpoints vLLM serves, through the router (``router/responses.py``).

A stored response lives in the memory of the replica that made it: whatever names it afterwards
(``previous_response_id``, ``GET /v1/responses/{id}``, cancel) must reach that replica, or get a clear
error from the router, never a 404 from a replica picked at random.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from loadtest.cluster import HTTP
from support import paths

FIXTURES = paths.FIXTURES / "vllm-apis"
STORE = ("--ttft-ms", "2", "--itl-ms", "1", "--store-responses")


def client(rt) -> openai.OpenAI:
    return openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture
def three(cluster):
    sims = [cluster.sim(*STORE) for _ in range(3)]
    return sims, cluster.router(sims, "--policy", "round-robin")


def served_by(sims, rt_headers) -> str:
    return rt_headers["x-kvroute-replica"]


def test_fifty_chained_responses_over_three_replicas_all_find_their_previous_one(three):
    """Round robin would send each follow-up elsewhere: every one still reaches the replica holding its
    previous response."""
    sims, rt = three
    c = client(rt)
    previous = None
    replicas = set()
    for i in range(50):
        raw = c.responses.with_raw_response.create(model="tiny", input=f"turn {i}: alpha bravo", max_output_tokens=4,
                                                   previous_response_id=previous)
        out = raw.parse()
        assert out.object == "response" and out.status in ("completed", "incomplete")
        replicas.add(raw.headers["x-kvroute-replica"])
        previous = out.id
    assert len(replicas) == 1  # the chain's first response decided where all of them live
    for s in sims:
        assert HTTP.get(s.url + "/sim/state").json()["counters"]["received"] in (0, 50)


def test_separate_conversations_spread_over_the_replicas(three):
    sims, rt = three
    c = client(rt)
    homes = {c.responses.with_raw_response.create(model="tiny", input=f"conversation {i}",
                                                  max_output_tokens=2).headers["x-kvroute-replica"]
             for i in range(6)}
    assert len(homes) == 3


def test_a_streamed_response_can_be_continued_and_retrieved(three):
    sims, rt = three
    c = client(rt)
    events = list(c.responses.create(model="tiny", input="alpha", max_output_tokens=3, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    first = events[-1].response.id
    second = c.responses.create(model="tiny", input="bravo", max_output_tokens=3, previous_response_id=first)
    assert second.previous_response_id == first
    for _ in range(3):  # whichever replica round robin would pick
        assert c.responses.retrieve(first).id == first


def test_a_clients_own_request_id_names_the_response(three):
    sims, rt = three
    r = HTTP.post(rt.url + "/v1/responses", json={"model": "tiny", "input": "x", "max_output_tokens": 2,
                                                  "request_id": "resp_mine_42"})
    assert r.status_code == 200 and r.json()["id"] == "resp_mine_42"
    follow = client(rt).responses.create(model="tiny", input="y", max_output_tokens=2,
                                         previous_response_id="resp_mine_42")
    assert follow.status in ("completed", "incomplete")


def test_cancel_goes_to_the_replica_holding_the_response(three):
    sims, rt = three
    rid = client(rt).responses.create(model="tiny", input="x", max_output_tokens=2).id
    r = HTTP.post(f"{rt.url}/v1/responses/{rid}/cancel")
    assert r.status_code == 400 and r.json()["error"]["message"] == "Cannot cancel a synchronous response."


def test_an_id_this_router_never_routed_is_a_clear_404(three):
    sims, rt = three
    with pytest.raises(openai.NotFoundError) as e:
        client(rt).responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    body = e.value.response.json()["error"]
    assert body["code"] == "response_not_found" and body["param"] == "previous_response_id"
    assert "resp_unknown" in body["message"]
    assert all(HTTP.get(s.url + "/sim/state").json()["counters"]["received"] == 0 for s in sims)


def test_with_its_replica_gone_a_follow_up_gets_a_clear_error_not_another_replicas_404(three, cluster):
    sims, rt = three
    c = client(rt)
    raw = c.responses.with_raw_response.create(model="tiny", input="x", max_output_tokens=2)
    rid, home = raw.parse().id, raw.headers["x-kvroute-replica"]
    next(s for s in sims if s.url.endswith(home.split(":")[-1])).kill()
    seen = []
    for _ in range(20):  # the attempt that finds it gone fails (502); once the router knows, a clear 404
        try:
            c.responses.create(model="tiny", input="y", max_output_tokens=2, previous_response_id=rid)
        except openai.APIStatusError as e:
            body = e.response.json()["error"]
            seen.append((e.status_code, body["code"]))
            if e.status_code == 404:
                assert home in body["message"] and rid in body["message"]
                break
    assert seen[-1] == (404, "response_unavailable"), seen
    assert all(status in (404, 502) for status, _ in seen) and sum(status == 404 for status, _ in seen) == 1


def test_an_overlong_response_id_is_refused_before_any_lookup(three):
    sims, rt = three
    r = HTTP.post(rt.url + "/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": "r" * 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert len(r.content) < 1000


@pytest.mark.shared
def test_routers_sharing_redis_know_each_others_responses(cluster, redis_proc):
    sims = [cluster.sim(*STORE) for _ in range(3)]
    url = f"redis://127.0.0.1:{redis_proc.port}/0"
    a = cluster.router(sims, "--index", url, "--policy", "round-robin")
    b = cluster.router(sims, "--index", url, "--policy", "round-robin")
    previous = None
    for i in range(10):
        rt = (a, b)[i % 2]
        previous = client(rt).responses.create(model="tiny", input=f"turn {i}", max_output_tokens=2,
                                               previous_response_id=previous).id


def test_the_stand_in_answers_as_vllm_does():
    """The stand-in's shapes follow the captures from a real replica."""
    real = json.loads((FIXTURES / "responses.json").read_text().split("\nstatus=")[0])
    from loadtest.stand_in_apis import response_object
    ours = response_object("resp_x", "tiny", {"instructions": "be brief", "max_output_tokens": 4}, "t", 42, 0, 4,
                           "msg_x", 0, True)
    assert list(ours) == list(real)
    assert list(ours["usage"]) == list(real["usage"]) and list(ours["output"][0]) == list(real["output"][0])
    events = [line.split(": ", 1)[1] for line in (FIXTURES / "responses-stream.sse").read_text().splitlines()
              if line.startswith("event: ")]
    from loadtest.stand_in_apis import response_events
    mine = [chunk.split(b"\n")[0].split(b": ", 1)[1].decode()
            for chunk in response_events("resp_x", "tiny", {}, ["a"], 3, 0)]
    assert mine == events


def test_anthropic_messages_pass_through_with_their_own_stream(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    r = HTTP.post(rt.url + "/v1/messages", json={"model": "tiny", "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "alpha"}]})
    assert r.status_code == 200 and r.json()["type"] == "message" and r.json()["usage"]["output_tokens"] == 3
    with httpx.stream("POST", rt.url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "stream": True,
                                                             "messages": [{"role": "user", "content": "a"}]}) as s:
        kinds = [line[7:] for line in s.iter_lines() if line.startswith("event: ")]
    real = [line[7:] for line in (FIXTURES / "messages-stream.sse").read_text().splitlines()
            if line.startswith("event: ")]
    assert kinds == real
    count = HTTP.post(rt.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": [
        {"role": "user", "content": "alpha"}]})
    assert count.status_code == 200 and count.json()["input_tokens"] > 0


def test_the_anthropic_client_gets_messages_and_their_stream_through_the_router(cluster):
    import anthropic
    sim = cluster.sim()
    rt = cluster.router([sim])
    client = anthropic.Anthropic(base_url=rt.url, api_key="unused", max_retries=0, timeout=10)
    message = client.messages.create(model="tiny", max_tokens=3, system="be brief",
                                     messages=[{"role": "user", "content": "alpha"}])
    assert message.type == "message" and message.role == "assistant" and message.usage.output_tokens == 3
    assert message.content[0].type == "text" and message.content[0].text
    with client.messages.stream(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "beta"}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) == 4 and "".join(pieces) == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
    assert client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "alpha"}]).input_tokens > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/rerank", {"model": "tiny", "query": "a", "documents": ["b"]}),
    ("/v1/score", {"model": "tiny", "text_1": "a", "text_2": "b"}),
    ("/pooling", {"model": "tiny", "input": "a"}),
    ("/classify", {"model": "tiny", "input": "a"}),
])
def test_pooling_endpoints_reach_a_replica_and_its_answer_comes_back(cluster, path, body):
    """The stand-in serves a generative model, as the tiny vLLM does: it answers these 404 itself."""
    sim = cluster.sim()
    rt = cluster.router([sim])
    r = HTTP.post(rt.url + path, json=body)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert r.headers["x-kvroute-replica"] == f"127.0.0.1:{sim.port}"
