"""Every streamed answer's time to first token against the one predicted for it: the ratio per replica and
platform, the recent error, and a line per replica (a fixed part, the model's prefill by a slope) that the
predictions (and the cost) then use."""

import json
import socket
import statistics
import time

from loadtest.cluster import HTTP
from prometheus_client.parser import text_string_to_metric_families


def stream(rt, i, max_tokens=4):
    r = HTTP.post(rt.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": f"question {i}: " + "tell me more " * 20, "max_tokens": max_tokens, "stream": True})
    assert r.status_code == 200
    return r


def samples(rt, name):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(HTTP.get(rt.url + "/metrics").text) for s in fam.samples
            if s.name.startswith(name)}


def replica(rt):
    return HTTP.get(rt.url + "/admin/replicas").json()["replicas"][0]


def test_the_prediction_converges_on_what_a_replica_measures(cluster):
    sim = cluster.sim("--ttft-ms", "200", "--itl-ms", "2")
    rt = cluster.router([sim], config={"prediction": {"min_samples": 10}})
    first = float(stream(rt, 0).headers["x-kvroute-predicted-ttft-ms"])
    assert first < 100  # the model alone knows nothing of the stand-in's fixed 200 ms
    for i in range(1, 25):
        stream(rt, i)
    predicted = [float(stream(rt, i).headers["x-kvroute-predicted-ttft-ms"]) for i in range(25, 30)]
    assert 160 < statistics.median(predicted) < 250
    assert replica(rt)["ttft_fixed_ms"] > 150  # the prompts alike: the fixed part takes it, the slope stays 1


def test_without_correction_the_error_is_reported_and_the_prediction_left_alone(cluster):
    sim = cluster.sim("--ttft-ms", "200", "--itl-ms", "2")
    rt = cluster.router([sim], config={"prediction": {"correct": False, "min_samples": 5}})
    for i in range(15):
        stream(rt, i)
    assert float(stream(rt, 99).headers["x-kvroute-predicted-ttft-ms"]) < 100
    name = replica(rt)["name"]
    m = samples(rt, "kvroute_ttft")
    assert m[("kvroute_ttft_prediction_error", (("replica", name),))] > 0.5
    assert ("kvroute_ttft_fixed_seconds", (("replica", name),)) not in m  # never set


def test_each_streamed_answer_is_compared_once_per_replica_and_platform(cluster):
    sim = cluster.sim("--ttft-ms", "20", "--itl-ms", "1")
    rt = cluster.router([], config={"replicas": [{"url": sim.url, "name": "g0", "platform": "gaudi2"}]})
    for i in range(6):
        stream(rt, i)
    for i in range(3):  # not streamed: its first byte is the whole answer, not its first token
        HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": f"plain {i}", "max_tokens": 4})
    m = samples(rt, "kvroute_ttft_prediction_ratio")
    assert m[("kvroute_ttft_prediction_ratio_count", (("platform", "gaudi2"), ("replica", "g0")))] == 6


def test_time_per_output_token_is_learned_from_the_streams(cluster):
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "30")
    rt = cluster.router([sim])
    for i in range(4):
        stream(rt, i, max_tokens=10)
    assert 25 < replica(rt)["tpot_ms"] < 45


def test_replicas_of_one_kind_short_of_samples_take_their_kinds_correction(cluster):
    a, b = cluster.sim("--ttft-ms", "200", "--itl-ms", "2"), cluster.sim("--ttft-ms", "200", "--itl-ms", "2")
    rt = cluster.router([a, b], config={"prediction": {"min_samples": 10}})
    for i in range(14):  # 14 between two: at least one of them has fewer than 10 of its own
        stream(rt, i)
    replicas = HTTP.get(rt.url + "/admin/replicas").json()["replicas"]
    assert min(r["ttft_answers_timed"] for r in replicas) < 10
    assert all(r["ttft_fixed_ms"] > 150 for r in replicas)


def test_the_predicted_time_counts_from_the_requests_arrival(cluster):
    """A client counts its time to first token from sending: the time the router spent before deciding (here a
    body that came 400 ms after its headers) is part of the prediction it is told."""
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "1")
    rt = cluster.router([sim])
    body = json.dumps({"model": "tiny", "prompt": "a slow client " * 10, "max_tokens": 2, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body))
        time.sleep(0.4)
        s.sendall(body)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            assert chunk, "the router closed the connection"
            head += chunk
    fields = dict(line.split(": ", 1) for line in head.split(b"\r\n\r\n")[0].decode().split("\r\n")[1:])
    assert float(fields["x-kvroute-predicted-ttft-ms"]) >= 400
