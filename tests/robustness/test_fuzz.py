"""Property-based fuzzing of the HTTP surface: thousands of generated bodies, headers and raw requests.

Every answer must be well-formed: never a 5xx, every error an OpenAI-shaped JSON body; the router must
stay up and keep answering; malformed HTTP never reaches a replica. One router and one stand-in replica
serve the whole module (they are real processes on 127.0.0.1).
"""

from __future__ import annotations

import json
import socket
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from support.processes import Cluster
from loadtest.cluster import HTTP
from support.state import sim_state
from loadtest.cluster import Proc

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

CASES = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
RAW_CASES = settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, httpx.Client]]:
    c = Cluster(tmp_path_factory.mktemp("fuzz"))
    sim = c.sim("--ttft-ms", "0", "--itl-ms", "0")
    rt = c.router([sim], "--set", "client.header_timeout_s=2", "--set", "client.body_timeout_s=2",
                  "--set", "log.level=warning")
    with httpx.Client(base_url=rt.url, timeout=30) as client:
        yield rt, sim, client
    c.stop_all()


def well_formed(r: httpx.Response) -> None:
    """The property every answer has: no server error, and errors in OpenAI's shape."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        error = r.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), error
        assert "param" in error and "code" in error, error


# -- JSON bodies ---------------------------------------------------------------------------

leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                             max_size=4),
                        max_leaves=16)
small_int = st.integers(min_value=-3, max_value=24)
content = st.text(max_size=300) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                                   "text": st.text(max_size=50)}), max_size=3)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "?"]) | anything,
                                 "content": content | anything})
common = {
    "model": st.just("tiny") | st.text(max_size=30) | anything,
    "stream": st.booleans() | st.sampled_from(["true", "false", "1", "yes", "nope"]) | anything,
    "max_tokens": small_int | st.sampled_from(["4", "abc", 4.0, 1e30]) | anything,
    "n": st.sampled_from([1, 2, 0, -1, "1"]),
    "temperature": st.floats(allow_nan=False, allow_infinity=False) | anything,
    "logprobs": st.sampled_from([None, 0, 2, True]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | anything}) | anything,
    "seed": st.integers() | anything,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | anything,
    "ignore_eos": st.booleans() | anything,
    "extra": anything,
}
completions_body = st.fixed_dictionaries(
    {"prompt": st.text(max_size=500) | st.lists(st.integers(0, 40000), max_size=50) | anything}, optional=common)
chat_body = st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | anything}, optional={
    **common, "max_completion_tokens": small_int | anything, "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(), "tools": anything, "response_format": anything})


def post_json(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    # ensure_ascii: a lone surrogate goes out as its \ud800 escape, as a hostile client would send it
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@CASES
@given(body=completions_body)
def test_completions_bodies(served, body):
    well_formed(post_json(served[2], "/v1/completions", body))


@CASES
@given(body=chat_body)
def test_chat_bodies(served, body):
    well_formed(post_json(served[2], "/v1/chat/completions", body))


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=anything, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]))
def test_bodies_of_any_json_shape(served, body, path):
    well_formed(post_json(served[2], path, body))


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.binary(max_size=300), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_bodies_that_are_not_json(served, raw, path):
    well_formed(served[2].post(path, content=raw, headers={"content-type": "application/json"}))


# -- headers -------------------------------------------------------------------------------

header_value = st.binary(max_size=200).filter(lambda v: b"\r" not in v and b"\n" not in v and b"\x00" not in v)
header_name = st.sampled_from([b"x-request-id", b"x-session-id", b"authorization", b"content-type", b"accept",
                               b"accept-encoding", b"traceparent", b"host", b"x-forwarded-for", b"x-kvroute-replica",
                               b"expect", b"x-other"])


@CASES
@given(headers=st.dictionaries(header_name, header_value, max_size=5))
def test_request_headers(served, headers):
    rt, sim, _ = served
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'
    lines = b"".join(b"%s: %s\r\n" % kv for kv in headers.items())
    answer = exchange(rt, b"POST /v1/completions HTTP/1.1\r\n" + lines + b"connection: close\r\n"
                      b"content-length: %d\r\n\r\n" % len(body) + body)
    status = statuses(answer)
    assert len(status) == 1 and status[0] < 500, answer[:300]  # one answer (400 for a header it cannot read)
    head = answer.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
    if status[0] == 200:
        rid = [line[14:] for line in head if line.startswith(b"x-request-id: ")][0]
        assert rid.isascii() and rid.decode().isprintable() and 0 < len(rid) <= 128, rid
        # no header chooses the host
        assert b"x-kvroute-replica: 127.0.0.1:%d" % sim.port in head


# -- raw bytes on the socket ---------------------------------------------------------------


def exchange(rt: Proc, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read what comes back until the router closes it, or until
    ``timeout`` of silence (a request still waiting for bytes it was promised)."""
    out = b""
    with socket.create_connection(("127.0.0.1", rt.port), timeout=timeout) as s:
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                out += chunk
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass
    return out


def statuses(answer: bytes) -> list[int]:
    return [int(line.split(b" ")[1]) for line in answer.split(b"\r\n")
            if line.startswith(b"HTTP/1.1 ") and line[9:12].isdigit()]


request_line = st.sampled_from([b"POST /v1/completions HTTP/1.1", b"GET /health HTTP/1.1", b"POST /v1/chat/completions HTTP/1.0",
                                b"PUT / HTTP/1.1", b"POST /v1/completions HTTP/9.9", b"GET /../../etc/passwd HTTP/1.1",
                                b"POST http://evil.example/v1/completions HTTP/1.1", b"\x00\x01\x02", b""])
raw_header = st.binary(max_size=60).filter(lambda b: b"\r\n" not in b) | st.sampled_from([
    b"Content-Length: 10", b"Content-Length: -1", b"Content-Length: 99999999999999999999", b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked", b"Host: evil.example:9", b"x-request-id: a\tb", b"Expect: 100-continue"])


RAW_ANSWERS: list[int] = []  # per raw case: the number of answers it got


@RAW_CASES
@given(line=request_line, headers=st.lists(raw_header, max_size=5), body=st.binary(max_size=100))
def test_raw_requests(served, line, headers, body):
    rt, sim, _ = served
    head = line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"connection: close\r\n\r\n"
    answer = exchange(rt, head + body, timeout=0.3)
    assert all(s < 500 for s in statuses(answer)), answer[:300]
    RAW_ANSWERS.append(len(statuses(answer)))


# -- the admin API and the Responses API ------------------------------------------------------

replica_body = st.fixed_dictionaries(
    {"url": st.sampled_from(["http://127.0.0.1:9", "https://127.0.0.1:1/v", "ftp://x", "http://user:pw@127.0.0.1:9",
                             "http://127.0.0.1:9?q=1"]) | st.text(max_size=40) | anything},
    optional={"name": st.text(max_size=140) | anything, "max_num_seqs": st.integers() | anything,
              "models": st.lists(st.text(max_size=20), max_size=3) | anything,
              "platform": st.sampled_from(["gaudi2", "cpu", "aurora-pvc", "x"]) | anything,
              "tensor_parallel_size": st.integers() | anything, "block_size": st.integers() | anything,
              "num_gpu_blocks": st.integers() | anything, "speed": st.floats() | anything,
              "kv_events": st.text(max_size=30) | anything, "api_key": st.text(max_size=20) | anything})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=replica_body | anything)
def test_admin_registration_bodies(served, body):
    """Whatever an admin call sends is answered well-formed; what it registers can be deleted again."""
    r = post_json(served[2], "/admin/replicas", body)
    well_formed(r)
    if r.status_code == 201:
        assert served[2].delete(f"/admin/replicas/{r.json()['name']}").status_code == 202


responses_body = st.fixed_dictionaries(
    {"input": st.text(max_size=200) | st.lists(message, max_size=3) | anything},
    optional={**common, "instructions": st.text(max_size=50) | anything,
              "previous_response_id": st.text(max_size=300) | anything, "request_id": st.text(max_size=300) | anything,
              "max_output_tokens": small_int | anything, "store": st.booleans() | anything})


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=responses_body)
def test_responses_bodies(served, body):
    well_formed(post_json(served[2], "/v1/responses", body))


def test_the_router_still_answers_and_replicas_saw_only_well_formed_requests_after_the_fuzzing(served):
    rt, sim, client = served
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "still there?", "max_tokens": 2})
    assert r.status_code == 200
    assert HTTP.get(rt.url + "/health", timeout=5).status_code == 200
    assert "Traceback" not in rt.log_tail(200_000)
    assert sim_state(sim)["received"] > 0
    # the raw cases were answered, mostly with a 4xx, not just dropped
    assert len(RAW_ANSWERS) >= 500 and sum(1 for n in RAW_ANSWERS if n) > 0.6 * len(RAW_ANSWERS), RAW_ANSWERS[:50]


# -- malformed HTTP, one case each ---------------------------------------------------------

REQ = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
BODY = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'


def refused_before_a_replica(served, data: bytes) -> list[int]:
    rt, sim, _ = served
    before = sim_state(sim)["received"]
    answer = exchange(rt, data)
    assert sim_state(sim)["received"] == before, answer[:300]
    return statuses(answer)


def test_conflicting_content_length_and_transfer_encoding_is_refused(served):
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    data = REQ + b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
    assert refused_before_a_replica(served, data) in ([400], [])


def test_two_different_content_lengths_are_refused(served):
    data = REQ + b"content-length: %d\r\ncontent-length: 3\r\n\r\n" % len(BODY) + BODY
    assert refused_before_a_replica(served, data) in ([400], [])


def test_an_invalid_chunk_size_is_refused(served):
    data = REQ + b"transfer-encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n"
    assert refused_before_a_replica(served, data) in ([400], [])


def test_a_chunk_longer_than_its_size_is_refused(served):
    data = REQ + b"transfer-encoding: chunked\r\n\r\n4\r\n" + BODY + b"\r\n0\r\n\r\n"
    assert refused_before_a_replica(served, data) in ([400], [])


def test_a_header_line_without_a_colon_is_refused(served):
    data = REQ + b"this is not a header\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
    assert refused_before_a_replica(served, data) in ([400], [])


def test_a_request_id_with_control_characters_is_refused(served):
    data = REQ + b"x-request-id: ab\x01cd\x1b[31m\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
    assert refused_before_a_replica(served, data) == [400]


def test_a_request_id_that_is_too_long_or_not_ascii_is_replaced_by_the_routers_own(served):
    rt, _, _ = served
    for rid in (b"\xe9t\xe9", b"a" * 129, b"x y\tz"):
        answer = exchange(rt, REQ + b"connection: close\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n"
                          % (rid, len(BODY)) + BODY)
        assert statuses(answer) == [200]
        sent = [line[14:] for line in answer.split(b"\r\n") if line.lower().startswith(b"x-request-id: ")][0]
        assert sent != rid and sent.isalnum() and len(sent) <= 128


def test_a_request_smuggled_behind_a_bogus_length_reaches_no_replica(served):
    smuggled = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
    data = REQ + b"content-length: 0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled
    assert refused_before_a_replica(served, data) in ([400], [])

