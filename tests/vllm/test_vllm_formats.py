"""The parsers read real vLLM 0.32 output, and the stand-in replica answers in exactly its shapes.

Fixtures in tests/fixtures/vllm-0.32 were captured from a real vLLM replica (see its README).
"""

import json

import pytest

from loadtest.cluster import HTTP
from support.sse import sse_json
from router.replicas.stats import parse_metrics
from support.paths import FIXTURES

FIX = FIXTURES / "vllm-0.32"


def shape(obj):
    """The structure of a JSON value: keys in order and value types, not the values."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    return type(obj).__name__


def test_metrics_parser_reads_a_real_exposition():
    s = parse_metrics((FIX / "metrics.txt").read_text())
    assert (s.running, s.waiting, s.kv_usage) == (0.0, 0.0, 0.0)
    assert (s.prefix_hits, s.prefix_queries) == (1536.0, 3238.0)
    assert (s.block_size, s.num_gpu_blocks) == (128, 16384)
    assert s.kv_capacity_tokens == 2097152
    assert s.start_time == pytest.approx(1795945935.71)


def test_metrics_parser_reads_prompt_tokens_and_prefill_time_of_a_real_exposition():
    s = parse_metrics((FIX / "metrics.txt").read_text())
    assert s.prompt_tokens == 3238.0
    assert (s.prefill_requests, s.prefill_seconds) == (4.0, pytest.approx(0.0356433980005022))


def test_metrics_parser_sums_engines_and_accepts_old_names():
    text = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="m"} 3',
        'vllm:num_requests_running{engine="1",model_name="m"} 2',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.5',
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 10',
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 40',
        "process_start_time_seconds 12.5",
    ])
    s = parse_metrics(text)
    assert (s.running, s.waiting, s.kv_usage, s.prefix_hits, s.prefix_queries, s.start_time) == (
        5.0, 0.0, 0.5, 10.0, 40.0, 12.5)
    assert s.block_size is None and s.kv_capacity_tokens is None


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    from loadtest.cluster import simulator
    p = simulator(None, "tiny", "--ttft-ms", "1", "--itl-ms", "1", log_dir=tmp_path_factory.mktemp("sim")).start()
    p.wait_http()
    yield p
    p.stop()


def fixture_error(name):
    body, status = (FIX / name).read_text().strip().rsplit("\n", 1)
    return json.loads(body), int(status.split("=")[1])


CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "q"}],
        "max_tokens": 5}


def test_chat_response_has_vllms_shape(sim):
    got = HTTP.post(sim.url + "/v1/chat/completions", json=CHAT).json()
    assert shape(got) == shape(json.loads((FIX / "chat.json").read_text()))


def test_completion_response_has_vllms_shape(sim):
    got = HTTP.post(sim.url + "/v1/completions", json={"model": "tiny", "prompt": "p" * 100, "max_tokens": 6}).json()
    assert shape(got) == shape(json.loads((FIX / "completions.json").read_text()))


@pytest.mark.parametrize("path, fixture, body", [
    ("/v1/chat/completions", "chat-stream.sse", {**CHAT, "max_tokens": 4}),
    ("/v1/completions", "completions-stream.sse", {"model": "tiny", "prompt": "p", "max_tokens": 4}),
])
def test_stream_chunks_have_vllms_shape_and_framing(sim, path, fixture, body):
    raw = HTTP.post(sim.url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    want = (FIX / fixture).read_bytes()
    assert raw.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert [shape(c) for c in sse_json(raw.content)] == [shape(c) for c in sse_json(want)]
    assert raw.content.endswith(b"data: [DONE]\n\n") and want.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("fixture, request_body", [
    ("error-unknown-model.txt", {"model": "nope", "prompt": "x"}),
    ("error-missing-prompt.txt", {"model": "tiny"}),
    ("error-max-tokens.txt", {"model": "tiny", "prompt": "x", "max_tokens": 100000}),
])
def test_errors_match_vllm(sim, fixture, request_body):
    want, status = fixture_error(fixture)
    r = HTTP.post(sim.url + "/v1/completions", json=request_body)
    assert r.status_code == status and r.json() == want


def test_bad_json_error_matches_vllm(sim):
    want, status = fixture_error("error-bad-json.txt")
    r = HTTP.post(sim.url + "/v1/completions", content=b"{bad")
    assert r.status_code == status and r.json() == want


def test_models_and_tokenize_have_vllms_shape(sim):
    got = HTTP.get(sim.url + "/v1/models").json()
    want = json.loads((FIX / "models.json").read_text())
    assert shape(got) == shape(want)
    tok = HTTP.post(sim.url + "/tokenize", json={"model": "tiny", "prompt": "hello there"}).json()
    assert shape(tok) == {**shape(json.loads((FIX / "tokenize.json").read_text())), "token_strs": "NoneType"}


def test_simulator_metrics_parse_like_vllms(sim):
    s = parse_metrics(HTTP.get(sim.url + "/metrics").text)
    assert s.block_size == 128 and s.num_gpu_blocks == 16384 and s.start_time > 0
    assert {"running", "waiting", "kv_usage", "prefix_hits", "prefix_queries", "cache_config"} <= s.seen
