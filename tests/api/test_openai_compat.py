"""The official openai client gets the same answers through the gateway as from the replica itself."""

import re

import openai
import pytest

from loadtest.cluster import HTTP
from support.sse import sse_events

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def normalise(obj: dict) -> dict:
    """Drop the fields that differ between any two requests (ids and timestamps)."""
    obj = dict(obj)
    obj.pop("id", None)
    obj.pop("created", None)
    return obj


@pytest.fixture
def pair(cluster):
    """One replica, reachable directly and through the gateway."""
    sim = cluster.sim()
    rt = cluster.router([sim])
    direct = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    gateway = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0)
    return direct, gateway, sim, rt


def test_chat_completion_matches(pair):
    direct, gateway, *_ = pair
    a = direct.chat.completions.create(model="tiny", messages=CHAT, max_tokens=7)
    b = gateway.chat.completions.create(model="tiny", messages=CHAT, max_tokens=7)
    assert normalise(b.model_dump()) == normalise(a.model_dump())
    assert b.choices[0].message.content and b.usage.completion_tokens == 7


def test_completion_matches(pair):
    direct, gateway, *_ = pair
    a = direct.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5)
    b = gateway.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5)
    assert normalise(b.model_dump()) == normalise(a.model_dump())


@pytest.mark.parametrize("usage", [False, True])
def test_chat_stream_chunk_sequence_matches(pair, usage):
    direct, gateway, *_ = pair
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=6, stream=True)
    if usage:
        kwargs["stream_options"] = {"include_usage": True}
    a = [normalise(c.model_dump()) for c in direct.chat.completions.create(**kwargs)]
    b = [normalise(c.model_dump()) for c in gateway.chat.completions.create(**kwargs)]
    assert b == a
    assert len(b) == 1 + 6 + (1 if usage else 0)


def test_completion_stream_chunk_sequence_matches(pair):
    direct, gateway, *_ = pair
    kwargs = dict(model="tiny", prompt="abc", max_tokens=4, stream=True, stream_options={"include_usage": True})
    a = [normalise(c.model_dump()) for c in direct.completions.create(**kwargs)]
    b = [normalise(c.model_dump()) for c in gateway.completions.create(**kwargs)]
    assert b == a and len(b) == 5


def test_stream_bytes_pass_through_unchanged(pair):
    """Apart from ids and timestamps the SSE body is the replica's, byte for byte."""
    *_, sim, rt = pair
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    scrub = lambda raw: re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", raw)
    a = HTTP.post(sim.url + "/v1/chat/completions", json=body).content
    b = HTTP.post(rt.url + "/v1/chat/completions", json=body).content
    assert scrub(b) == scrub(a)
    assert sse_events(b)[-1] == "[DONE]"


def test_models_embeddings_and_tokenizer_endpoints(pair):
    direct, gateway, sim, rt = pair
    assert [m.id for m in gateway.models.list()] == [m.id for m in direct.models.list()] == ["tiny"]
    emb = gateway.embeddings.create(model="tiny", input="hello world")
    assert len(emb.data[0].embedding) == 8
    tok = HTTP.post(rt.url + "/tokenize", json={"model": "tiny", "prompt": "hello world!"}).json()
    assert tok == HTTP.post(sim.url + "/tokenize", json={"model": "tiny", "prompt": "hello world!"}).json()
    detok = HTTP.post(rt.url + "/detokenize", json={"model": "tiny", "tokens": tok["tokens"]})
    assert detok.status_code == 200 and "prompt" in detok.json()


def test_every_response_names_the_replica_and_carries_a_request_id(pair):
    *_, sim, rt = pair
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert r.headers["x-kvroute-replica"] == "127.0.0.1:%d" % sim.port
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_client_request_id_is_propagated_to_the_replica(pair):
    *_, sim, rt = pair
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                   headers={"x-request-id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    seen = HTTP.get(sim.url + "/sim/state").json()["counters"]["last_headers"]
    assert seen["x-request-id"] == "trace-42"


def test_model_may_be_omitted_when_the_pool_serves_one_model(pair):
    *_, rt = pair
    r = HTTP.post(rt.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200
