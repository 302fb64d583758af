"""Replica failures: retries before the first byte, SSE errors after it, ejection and return."""

import json
import threading
import time

import httpx
import openai

from loadtest.cluster import HTTP
from support.sse import sse_events
from support.state import replicas_view, set_faults, sim_state
from support.waiting import wait_until


def complete(url: str, **extra) -> httpx.Response:
    return HTTP.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, **extra},
                      timeout=10)


def kill_under_load(cluster, *router_args: str):
    """12 clients stream 20-token chats through three replicas; one replica is killed mid-run and restarted."""
    sims = [cluster.sim("--ttft-ms", "5", "--itl-ms", "30") for _ in range(3)]
    victim = sims[0]
    rt = cluster.router(sims, *router_args)
    results: list[tuple[float, str, list[str]]] = []  # (sent_at, replica, events)
    lock = threading.Lock()
    stop = threading.Event()

    def client():
        while not stop.is_set():
            sent = time.monotonic()
            try:
                r = HTTP.post(rt.url + "/v1/chat/completions", timeout=10, json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                    "stream": True})
                events, replica = sse_events(r.content), r.headers.get("x-kvroute-replica", "")
            except httpx.HTTPError as e:
                events, replica = [f"client error {e!r}"], ""
            with lock:
                results.append((sent, replica, events))

    threads = [threading.Thread(target=client) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    wait_until(lambda: replicas_view(rt)[victim.url]["inflight"] >= 2, timeout=3)
    victim.kill()
    killed_at = time.monotonic()
    took = wait_until(lambda: not replicas_view(rt)[victim.url]["ready"], timeout=2.0)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(15)
    assert took < 2.0
    victim_name = "127.0.0.1:%d" % victim.port
    # every request sent after the kill went to the other replicas
    assert all(rep != victim_name for sent, rep, ev in results if sent > killed_at)
    # the replica comes back on the same port and is used again
    victim.start()
    victim.wait_http()
    wait_until(lambda: replicas_view(rt)[victim.url]["ready"], timeout=5.0)
    seen = {complete(rt.url).headers["x-kvroute-replica"] for _ in range(30)}
    assert victim_name in seen
    return rt, victim_name, results


def completed(events: list[str]) -> bool:
    return bool(events) and events[-1] == "[DONE]" and not any('"error"' in e for e in events)


def content_chunks(events: list[str]) -> int:
    return sum(1 for e in events[:-1] if json.loads(e)["choices"] and json.loads(e)["choices"][0]["delta"].get("content"))


def test_streams_on_a_killed_replica_continue_on_another_with_every_token(cluster):
    rt, victim, results = kill_under_load(cluster)
    assert results and all(completed(ev) for _, _, ev in results), [ev[-2:] for _, _, ev in results if not completed(ev)]
    assert all(content_chunks(ev) == 20 for _, _, ev in results)
    on_victim = [ev for _, rep, ev in results if rep == victim]
    ids = [{json.loads(e)["id"] for e in ev[:-1]} for ev in on_victim]
    assert all(len(i) == 1 for i in ids)  # one id through both parts
    metrics = HTTP.get(rt.url + "/metrics").text
    resumed = [line for line in metrics.splitlines() if line.startswith('kvroute_stream_failovers_total{outcome="completed"}')]
    assert resumed and float(resumed[0].split()[-1]) >= 1, "some streams must have been in flight on the killed replica"


def test_without_stream_failover_streams_on_a_killed_replica_end_with_an_error_event(cluster):
    rt, victim, results = kill_under_load(cluster, "--set", "proxy.stream_failover=false")
    broken = [ev for _, rep, ev in results if not completed(ev)]
    assert broken, "some streams must have been in flight on the killed replica"
    for ev in broken:
        assert json.loads(ev[-2])["error"]["code"] == "upstream_disconnected" and ev[-1] == "[DONE]"
    assert 'kvroute_stream_failovers_total{outcome="not_resumable"}' in HTTP.get(rt.url + "/metrics").text


def test_connection_refused_is_retried_on_another_replica(cluster):
    good = cluster.sim()
    dead = cluster.sim()
    rt = cluster.router([good, dead], "--policy", "round-robin")
    dead.kill()
    # until the health check notices, round robin still sends every other request to the dead one
    for _ in range(6):
        r = complete(rt.url)
        assert r.status_code == 200
        assert r.headers["x-kvroute-replica"] == "127.0.0.1:%d" % good.port


def test_server_error_before_the_first_byte_is_retried_elsewhere(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([a, b])
    set_faults(a, fail_status=500, fail_count=100)
    for _ in range(10):
        r = complete(rt.url)
        assert r.status_code == 200
        assert r.headers["x-kvroute-replica"] == "127.0.0.1:%d" % b.port
    failed = sim_state(a)["failed"]
    assert failed >= 1, "some requests were tried on the failing replica first"
    # one 5xx is retried, not a verdict; health.eject_after (5) in a row take the replica out
    assert replicas_view(rt)[a.url]["ready"] == (failed < 5)


def test_rate_limited_replica_is_retried_elsewhere(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([a, b])
    set_faults(a, fail_status=429, fail_count=100)
    for _ in range(6):
        assert complete(rt.url).status_code == 200


def test_last_replica_error_is_passed_through_when_every_attempt_fails(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([a, b])
    set_faults(a, fail_status=500, fail_count=1)
    set_faults(b, fail_status=500, fail_count=1)
    r = complete(rt.url)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "simulated failure"
    assert sim_state(a)["failed"] == 1 and sim_state(b)["failed"] == 1, "each replica tried once"


def test_attempts_are_bounded(cluster):
    sims = [cluster.sim() for _ in range(4)]
    rt = cluster.router(sims, "--set", "proxy.max_attempts=2")
    for s in sims:
        set_faults(s, fail_status=502, fail_count=100)
    r = complete(rt.url)
    assert r.status_code == 502
    assert sum(sim_state(s)["failed"] for s in sims) == 2


def test_client_errors_pass_through_unchanged_and_do_not_hurt_health(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim], "--set", "health.fail_threshold=1")
    direct = HTTP.post(sim.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 100000})
    for _ in range(5):
        r = complete(rt.url, max_tokens=100000)
        assert r.status_code == 400
        assert r.content == direct.content
    assert sim_state(sim)["received"] == 0
    view = replicas_view(rt)[sim.url]
    assert view["ready"] and view["consecutive_failures"] == 0
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="x", max_retries=0)
    try:
        client.completions.create(model="tiny", prompt="x", max_tokens=100000)
    except openai.BadRequestError as e:
        assert e.body["param"] == "max_tokens"
    else:
        raise AssertionError("expected a 400")


def test_unhealthy_replica_is_ejected_and_returns_after_consecutive_successes(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([a, b], "--set", "health.interval_s=0.2", "--set", "health.rise_threshold=3")
    set_faults(a, health_status=503)
    wait_until(lambda: not replicas_view(rt)[a.url]["ready"], timeout=2)
    assert {complete(rt.url).headers["x-kvroute-replica"] for _ in range(10)} == {"127.0.0.1:%d" % b.port}
    set_faults(a, health_status=200)
    took = wait_until(lambda: replicas_view(rt)[a.url]["ready"], timeout=3)
    assert took >= 0.2 * 2, "one good check is not enough to return"


def test_a_replica_on_its_way_back_keeps_the_reason_it_went_out_until_it_is_ready(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([a, b], "--set", "health.interval_s=0.2", "--set", "health.rise_threshold=8")
    set_faults(a, health_status=503)
    wait_until(lambda: not replicas_view(rt)[a.url]["ready"], timeout=2)
    set_faults(a, health_status=200)
    seen = []  # (good checks, last_error) while it is unready: 8 checks 0.2 s apart
    while len(seen) < 200:
        view = replicas_view(rt)[a.url]
        if view["ready"]:
            break
        seen.append((view["consecutive_good_checks"], view["last_error"]))
        time.sleep(0.05)
    assert view["ready"] and view["last_error"] is None
    assert any(good > 0 for good, _ in seen)  # seen on its way back, not only before
    assert all(error is not None and "503" in error for _, error in seen)


def test_a_replica_that_answers_its_health_check_after_the_timeout_is_not_ready(cluster):
    url = cluster.slow_link(cluster.sim(), delay_ms=600).url  # 600 ms each way between router and replica
    rt = cluster.router([url], "--set", "health.timeout_s=0.5", "--set", "health.interval_s=0.2", wait_ready=False)
    wait_until(lambda: replicas_view(rt)[url]["last_error"] is not None, timeout=5)
    time.sleep(2)  # several more checks, each cut at 0.5 s
    view = replicas_view(rt)[url]
    assert not view["ready"] and "health check failed" in view["last_error"] and "Timeout" in view["last_error"]


def test_replica_restart_is_detected_from_its_start_time(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim], "--set", "health.interval_s=0.2", "--set", "health.metrics_interval_s=0.2")
    wait_until(lambda: replicas_view(rt)[sim.url]["engine"] is not None, timeout=3)
    sim.stop()
    time.sleep(0.1)
    sim.start()
    sim.wait_http()
    wait_until(lambda: replicas_view(rt)[sim.url]["restarts"] == 1, timeout=5)
    metrics = HTTP.get(rt.url + "/metrics").text
    assert 'kvroute_replica_restarts_total{replica="127.0.0.1:%d"} 1.0' % sim.port in metrics


def test_a_json_answer_cut_short_is_answered_by_another_replica_and_not_logged_as_the_routers_error(cluster):
    cut, good = cluster.sim("--cut-bodies", "100"), cluster.sim()
    rt = cluster.router([cut, good])
    cut_name = f"127.0.0.1:{cut.port}"
    for i in range(8):
        r = HTTP.post(rt.url + "/v1/completions", timeout=10, headers={"x-session-id": f"s{i}"},
                       json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-kvroute-replica"] != cut_name
    assert HTTP.get(cut.url + "/sim/state").json()["counters"]["received"] >= 1  # it was tried
    log = rt.log_tail(100_000)
    assert "internal error" not in log and "Traceback" not in log
    assert "cut short before it reached the client" in log
    assert f'kvroute_upstream_errors_total{{kind="body_broken",replica="{cut_name}"}}' in HTTP.get(rt.url + "/metrics").text


def _stream(rt, i: int) -> tuple[str, list[str]]:
    r = HTTP.post(rt.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 8, "stream": True})
    return r.headers.get("x-kvroute-replica", ""), sse_events(r.content)


def test_a_replica_that_breaks_every_stream_is_taken_out_of_rotation_and_back_after_its_time(cluster):
    bad, good = cluster.sim("--die-after-chunks", "3"), cluster.sim()
    rt = cluster.router([bad, good], "--set", "health.eject_s=4", "--set", "health.interval_s=0.2")
    bad_name = f"127.0.0.1:{bad.port}"
    names = []
    while names.count(bad_name) < 5 and len(names) < 30:  # health.eject_after
        name, events = _stream(rt, len(names))
        assert completed(events) and content_chunks(events) == 8  # continued on the good replica
        names.append(name)
    assert names.count(bad_name) == 5
    # well inside the ejection (4 s; ten streams take under one): it gets nothing though /health answers
    assert all(_stream(rt, 50 + i)[0] != bad_name for i in range(10))
    view = replicas_view(rt)[bad.url]
    assert view["state"] == "unready" and "ejected" in view["last_error"]
    assert f'kvroute_replica_ejections_total{{replica="{bad_name}"}} 1.0' in HTTP.get(rt.url + "/metrics").text
    set_faults(bad, die_after_chunks=-1)  # mended: back once its time is over and /health answers
    wait_until(lambda: replicas_view(rt)[bad.url]["state"] == "ready", timeout=10, interval=0.2)
    assert bad_name in {_stream(rt, 100 + i)[0] for i in range(20)}


def test_a_replica_that_accepts_and_never_answers_costs_a_stream_only_the_headers_timeout_then_leaves(cluster):
    hung, good = cluster.sim("--hang"), cluster.sim()
    rt = cluster.router([hung, good], "--set", "proxy.stream_headers_timeout_s=0.5")
    slow = 0
    for i in range(20):
        start = time.monotonic()
        name, events = _stream(rt, i)
        took = time.monotonic() - start
        assert name == f"127.0.0.1:{good.port}" and events[-1] == "[DONE]"
        assert took < 2.0  # one headers timeout at most, then another replica
        slow += took > 0.4
    assert slow == 5  # then it was out of rotation
    assert replicas_view(rt)[hung.url]["state"] == "unready"


def out_while_waiting(rt, hung, clients, timeout):
    """Start the clients 0.2 s apart; seconds from the last start until ``hung`` is out of rotation (then they are
    joined)."""
    for t in clients:
        t.start()
        time.sleep(0.2)
    out_after = wait_until(lambda: replicas_view(rt)[hung.url]["state"] == "unready", timeout=timeout)
    for t in clients:
        t.join(timeout=20)
    return out_after


def test_a_replica_that_accepts_requests_and_answers_none_leaves_rotation_and_its_waiting_clients_move(cluster):
    """Its /health still answers 200. After health.stall_s without an answer and without engine progress it is
    out, and the requests waiting on it complete on the other replica: none waits for request_timeout_s."""
    hung, good = cluster.sim(), cluster.sim()
    rt = cluster.router([hung, good], "--policy", "round-robin", "--set", "health.stall_s=3")
    set_faults(hung, hang=True)
    took: list[tuple[float, int, str]] = []

    def client(i: int) -> None:
        t0 = time.monotonic()
        r = complete(rt.url, prompt=f"question {i}")
        took.append((time.monotonic() - t0, r.status_code, r.headers.get("x-kvroute-replica", "")))

    out_after = out_while_waiting(rt, hung, [threading.Thread(target=client, args=(i,)) for i in range(8)], 10)
    assert out_after < 6  # stall_s (3) plus a scrape or two
    assert all(status == 200 for _, status, _ in took) and len(took) == 8, took
    assert all(replica == f"127.0.0.1:{good.port}" for _, _, replica in took)
    assert max(t for t, _, _ in took) < 7, took
    assert "stalled" in replicas_view(rt)[hung.url]["last_error"]


def test_a_replica_that_answers_none_leaves_as_soon_where_the_control_budget_spaces_the_scrapes_out(cluster):
    """A budget of one control request in 10 s: each replica is checked and scraped about every 44 s, yet the
    replica whose requests wait unanswered is scraped at the configured interval and leaves within stall_s and
    a scrape or two."""
    hung, good = cluster.sim(), cluster.sim()
    rt = cluster.router([hung, good], "--policy", "round-robin", "--set", "health.stall_s=3",
                        "--set", "health.max_requests_per_s=0.1")
    assert HTTP.get(rt.url + "/admin/replicas", timeout=2).json()["health_checks"]["spacing"] > 40
    set_faults(hung, hang=True)
    out_after = out_while_waiting(rt, hung, [threading.Thread(
        target=complete, args=(rt.url,), kwargs={"prompt": f"question {i}"}) for i in range(4)], 12)
    assert out_after < 7  # stall_s (3), a look over the replicas (1 s) and a scrape or two
    assert "stalled" in replicas_view(rt)[hung.url]["last_error"]
