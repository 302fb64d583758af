"""Every error the router produces has its status code and an OpenAI-shaped body."""

import threading
import time

import httpx
import pytest

from loadtest.cluster import HTTP
from support.waiting import wait_until
from loadtest.cluster import free_port


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture
def one(cluster):
    sim = cluster.sim()
    return sim, cluster.router([sim], "--set", "proxy.max_body_bytes=2048")


def test_malformed_json_is_400(one):
    _, rt = one
    r = HTTP.post(rt.url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "invalid_json")


def test_body_that_is_not_an_object_is_400(one):
    _, rt = one
    assert_openai_error(HTTP.post(rt.url + "/v1/completions", json=[1, 2]), 400, "invalid_json")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/embeddings", {"model": "tiny"}, "input"),
    ("/v1/completions", {"model": 7, "prompt": "x"}, "model"),
])
def test_missing_or_wrong_required_fields_are_400(one, path, body, param):
    _, rt = one
    err = assert_openai_error(HTTP.post(rt.url + path, json=body), 400)
    assert err["param"] == param


def test_unknown_model_is_404(one):
    _, rt = one
    err = assert_openai_error(HTTP.post(rt.url + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404,
                              "model_not_found")
    assert err["param"] == "model"


def test_body_over_the_limit_is_413(one):
    _, rt = one
    big = {"model": "tiny", "prompt": "x" * 5000}
    assert_openai_error(HTTP.post(rt.url + "/v1/completions", json=big), 413, "request_too_large")


def test_chunked_body_over_the_limit_is_413(one):
    _, rt = one
    def gen():
        for _ in range(10):
            yield b"x" * 1000
    assert_openai_error(HTTP.post(rt.url + "/v1/completions", content=gen()), 413, "request_too_large")


def test_no_ready_replica_is_503(cluster):
    rt = cluster.router([f"http://127.0.0.1:{free_port()}"], wait_ready=False)
    assert_openai_error(HTTP.get(rt.url + "/ready"), 503, "no_ready_replica")
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert_openai_error(r, 503, "no_ready_replica")
    assert r.headers["retry-after"] == "1"


def test_unknown_route_is_an_openai_shaped_404(one):
    _, rt = one
    assert_openai_error(HTTP.get(rt.url + "/v1/nothing"), 404)


def slow_request(url: str, out: list, max_tokens: int = 40) -> threading.Thread:
    def run():
        out.append(HTTP.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                           "max_tokens": max_tokens}, timeout=20))
    t = threading.Thread(target=run)
    t.start()
    return t


def queue_cluster(cluster, size: int, timeout: float):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "25")
    rt = cluster.router([], config={
        "replicas": [{"url": sim.url, "max_num_seqs": 1}],
        "queue": {"max_size": size, "timeout_s": timeout}})
    return sim, rt


def inflight_and_queue(rt):
    body = HTTP.get(rt.url + "/admin/replicas").json()
    return body["replicas"][0]["inflight"], body["queue_length"]


def test_full_queue_is_429_with_retry_after(cluster):
    sim, rt = queue_cluster(cluster, size=1, timeout=10)
    out: list = []
    first = slow_request(rt.url, out, max_tokens=200)  # 5 s: time to set the rest up on a loaded machine
    wait_until(lambda: inflight_and_queue(rt) == (1, 0), timeout=3)
    second = slow_request(rt.url, out)
    wait_until(lambda: inflight_and_queue(rt) == (1, 1), timeout=3)
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert_openai_error(r, 429, "router_queue_full")
    assert int(r.headers["retry-after"]) >= 1
    first.join()
    second.join()
    assert [x.status_code for x in out] == [200, 200], "the queued request ran once a slot was free"


def test_queue_wait_longer_than_the_timeout_is_429(cluster):
    sim, rt = queue_cluster(cluster, size=4, timeout=0.3)
    out: list = []
    first = slow_request(rt.url, out, max_tokens=200)
    wait_until(lambda: inflight_and_queue(rt) == (1, 0), timeout=3)
    start = time.monotonic()
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    waited = time.monotonic() - start
    assert_openai_error(r, 429, "router_queue_timeout")
    assert "retry-after" in r.headers
    assert 0.3 <= waited < 1.0
    first.join()


def test_queue_is_first_in_first_out(cluster):
    sim, rt = queue_cluster(cluster, size=8, timeout=10)
    out: list = []
    # the blocking request lasts 5 s (200 tokens x 25 ms): time to queue the others on a loaded machine
    threads = [slow_request(rt.url, out, max_tokens=200)]
    wait_until(lambda: inflight_and_queue(rt)[0] == 1, timeout=3)
    order = []
    def queued(i):
        r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                       timeout=20)
        order.append((i, r.status_code))
    for i in range(4):
        t = threading.Thread(target=queued, args=(i,))
        t.start()
        threads.append(t)
        wait_until(lambda: inflight_and_queue(rt)[1] == i + 1, timeout=3)
    for t in threads:
        t.join()
    assert order == [(0, 200), (1, 200), (2, 200), (3, 200)]
