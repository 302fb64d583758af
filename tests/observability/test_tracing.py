"""OpenTelemetry spans per request, sent by OTLP/HTTP to a real receiver on loopback: one trace per request,
joined to the client's traceparent, with every stage (prompt key, index lookup, each decision with its
candidates and scores, each upstream attempt, the failover) and each replica given its attempt's span as parent."""

import json

from loadtest.cluster import HTTP
from support.sse import sse_events
from support.state import set_faults, sim_state
from support.waiting import wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def spans(receiver, n):
    wait_until(lambda: len(HTTP.get(receiver.url + "/spans").json()) >= n, timeout=10)
    return HTTP.get(receiver.url + "/spans").json()


def traced_router(cluster, replicas, **config):
    receiver = cluster.otlp_receiver()
    rt = cluster.router([], config={"tracing": {"otlp_endpoint": receiver.url + "/v1/traces"}, "replicas": replicas,
                                    **config}, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    return receiver, rt


def test_a_request_is_one_trace_under_the_clients_span_with_each_stage(cluster):
    sim = cluster.sim()
    receiver, rt = traced_router(cluster, [{"url": sim.url, "name": "r0"}])
    r = HTTP.post(rt.url + "/v1/completions", headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                  json={"model": "tiny", "prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 200
    got = spans(receiver, 5)
    by_name = {s["name"]: s for s in got}
    assert {s["trace_id"] for s in got} == {CLIENT_TRACE}
    root = by_name["kvroute.request"]
    assert root["parent_span_id"] == CLIENT_SPAN and root["resource"]["service.name"] == "kvroute"
    assert root["attributes"]["http.response.status_code"] == 200
    for name in ("kvroute.prompt_key", "kvroute.index_lookup", "kvroute.route", "kvroute.attempt"):
        assert by_name[name]["parent_span_id"] == root["span_id"], name
        assert root["start"] <= by_name[name]["start"] <= by_name[name]["end"] <= root["end"], name
    decision = by_name["kvroute.route"]["attributes"]
    assert decision["kvroute.replica"] == "r0" and decision["kvroute.candidates"] == 1
    assert decision["kvroute.scores"][0].startswith("r0=")


def test_the_replica_gets_its_attempts_span_as_traceparent(cluster):
    sim = cluster.sim()
    receiver, rt = traced_router(cluster, [{"url": sim.url, "name": "r0"}])
    HTTP.post(rt.url + "/v1/completions", headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
              json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    attempt = next(s for s in spans(receiver, 5) if s["name"] == "kvroute.attempt")
    seen = sim_state(sim)["last_headers"]
    assert seen.get("traceparent") == f"00-{CLIENT_TRACE}-{attempt['span_id']}-01"


def test_two_failed_attempts_and_a_failover_show_in_one_trace(cluster):
    # round robin in name order: a first (503), then c of the two left (its stream breaks), then b continues it
    a, b, c = cluster.sim(), cluster.sim(), cluster.sim()
    receiver, rt = traced_router(cluster, [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"},
                                           {"url": c.url, "name": "c"}], policy="round-robin",
                                 proxy={"retry_backoff_s": 0})
    set_faults(a, fail_status=503, fail_count=1)
    set_faults(c, die_after_chunks=3)
    r = HTTP.post(rt.url + "/v1/chat/completions", timeout=20, json={
        "model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 12, "stream": True,
        "temperature": 0})
    events = sse_events(r.content)
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    got = spans(receiver, 7)
    assert len({s["trace_id"] for s in got}) == 1
    root = next(s for s in got if s["name"] == "kvroute.request")
    attempts = sorted((s for s in got if s["name"] == "kvroute.attempt"), key=lambda s: s["start"])
    assert [s["attributes"]["kvroute.replica"] for s in attempts] == ["a", "c", "b"]
    assert attempts[0]["attributes"]["kvroute.failure"] == "status_5xx" and attempts[0]["status"] == 2
    assert attempts[1]["attributes"]["kvroute.failure"] == "stream_broken"
    assert attempts[2]["attributes"]["kvroute.continuation"] is True and attempts[2]["status"] == 0
    routes = [s for s in got if s["name"] == "kvroute.route"]
    assert len(routes) == 3 and all(s["parent_span_id"] == root["span_id"] for s in routes + attempts)
    assert root["attributes"]["kvroute.attempts"] == 3 and root["attributes"]["kvroute.outcome"] == "continued"


def test_without_an_endpoint_nothing_is_traced_and_the_clients_traceparent_passes_on(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    header = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    HTTP.post(rt.url + "/v1/completions", headers={"traceparent": header},
              json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert sim_state(sim)["last_headers"].get("traceparent") == header


def test_a_client_trace_that_is_not_sampled_is_not_recorded(cluster):
    sim = cluster.sim()
    receiver, rt = traced_router(cluster, [{"url": sim.url}])
    HTTP.post(rt.url + "/v1/completions", headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"},
              json={"model": "tiny", "prompt": "quiet", "max_tokens": 2})
    HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": "loud", "max_tokens": 2})
    got = spans(receiver, 5)
    assert CLIENT_TRACE not in {s["trace_id"] for s in got}
    assert len([s for s in got if s["name"] == "kvroute.request"]) == 1
    assert "loud" not in json.dumps(got)  # no prompt text on any span
