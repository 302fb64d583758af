"""Replicas that join and leave at run time: the admin API, replicas_file, and Redis shared by routers."""

from __future__ import annotations

import json
import threading
import time


from loadtest.cluster import HTTP
from support.sse import sse_events
from support.state import replica_names as names, replicas_view, set_faults
from support.waiting import wait_until

ADMIN = "/admin/replicas"



def served_by(rt, n: int = 30) -> set[str]:
    out = set()
    for i in range(n):
        r = HTTP.post(rt.url + "/v1/completions", timeout=10,
                       json={"model": "tiny", "prompt": f"question {i} " * 40, "max_tokens": 2})
        assert r.status_code == 200, r.text
        out.add(r.headers["x-kvroute-replica"])
    return out


def test_a_replica_registered_through_the_admin_api_joins_and_takes_traffic(cluster):
    a, b = cluster.sim(), cluster.sim()
    rt = cluster.router([a])
    r = HTTP.post(rt.url + ADMIN, json={"name": "late", "url": b.url, "max_num_seqs": 8}, timeout=5)
    assert r.status_code == 201, r.text
    assert r.json()["source"] == "admin" and r.json()["max_num_seqs"] == 8
    wait_until(lambda: replicas_view(rt)[b.url]["state"] == "ready", timeout=10)
    assert "late" in served_by(rt)


def test_a_second_delete_of_a_draining_replica_continues_the_same_drain_and_a_third_after_it_left_is_404(cluster):
    a, b = cluster.sim("--ttft-ms", "5", "--itl-ms", "100"), cluster.sim()
    rt = cluster.router([a, b], "--set", "membership.drain_timeout_s=2")
    gone = f"127.0.0.1:{a.port}"
    HTTP.post(rt.url + f"{ADMIN}/127.0.0.1:{b.port}/drain", timeout=5)  # the long request goes to the leaving one
    t = threading.Thread(target=lambda: HTTP.post(rt.url + "/v1/completions", timeout=20, json={
        "model": "tiny", "prompt": "x", "max_tokens": 60}))
    t.start()
    wait_until(lambda: HTTP.get(a.url + "/sim/state").json()["counters"]["running"] == 1, timeout=5)
    first = HTTP.delete(rt.url + f"{ADMIN}/{gone}", timeout=5)
    time.sleep(1.0)
    second = HTTP.delete(rt.url + f"{ADMIN}/{gone}", timeout=5)
    assert first.status_code == second.status_code == 202
    assert second.json()["removing"] is True and second.json()["removing_for_s"] >= 0.9
    # removed at the first DELETE's drain timeout (2 s), not 2 s after the second
    took = wait_until(lambda: gone not in names(rt), timeout=5)
    assert took < 1.7
    assert HTTP.delete(rt.url + f"{ADMIN}/{gone}", timeout=5).status_code == 404
    t.join(20)


def test_a_registration_with_an_invalid_field_is_refused_naming_it(cluster):
    rt = cluster.router([cluster.sim()])
    r = HTTP.post(rt.url + ADMIN, json={"url": "http://127.0.0.1:9", "max_num_seqs": 0}, timeout=5)
    assert r.status_code == 400
    assert "replica.max_num_seqs" in r.json()["error"]["message"]
    r = HTTP.post(rt.url + ADMIN, json={"max_num_seqs": 4}, timeout=5)
    assert r.status_code == 400 and "replica.url" in r.json()["error"]["message"]


def test_names_that_could_not_be_deleted_or_would_grow_the_metrics_are_refused(cluster):
    rt = cluster.router([cluster.sim()])
    for name in ("a/b", "x" * 129, "tab\there", "ünï"):
        r = HTTP.post(rt.url + ADMIN, json={"name": name, "url": "http://127.0.0.1:9"}, timeout=5)
        assert r.status_code == 400 and "replica.name" in r.json()["error"]["message"], name
        assert len(r.content) < 2000
    r = HTTP.post(rt.url + ADMIN, json={"url": "http://127.0.0.1:9", "max_num_seqs": 10**12}, timeout=5)
    assert r.status_code == 400 and "replica.max_num_seqs" in r.json()["error"]["message"]
    ok = HTTP.post(rt.url + ADMIN, json={"name": "gaudi-node_7.rack:2", "url": "http://127.0.0.1:9"}, timeout=5)
    assert ok.status_code == 201
    assert HTTP.delete(rt.url + ADMIN + "/gaudi-node_7.rack:2", timeout=5).status_code == 202


def test_a_password_in_a_replica_url_is_shown_nowhere(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    url = f"http://user:s3cret-pw@127.0.0.1:{sim.port}"
    r = HTTP.post(rt.url + ADMIN, json={"name": "with-creds", "url": url}, timeout=5)
    assert r.status_code == 201 and "s3cret-pw" not in r.text and r.json()["url"].startswith("http://user:***@")
    assert "s3cret-pw" not in HTTP.get(rt.url + ADMIN, timeout=5).text
    assert "s3cret-pw" not in rt.log_tail(100_000)


def test_registering_a_name_twice_is_a_conflict(cluster):
    a = cluster.sim()
    rt = cluster.router([a])
    r = HTTP.post(rt.url + ADMIN, json={"url": a.url}, timeout=5)
    assert r.status_code == 409 and "already registered" in r.json()["error"]["message"]


def test_deleting_a_replica_drains_it_then_removes_it_with_its_metric_series(cluster):
    a, b = cluster.sim("--ttft-ms", "5", "--itl-ms", "50"), cluster.sim()
    rt = cluster.router([a, b])
    gone = f"127.0.0.1:{a.port}"
    out: list[list[str]] = []

    def stream() -> None:  # a request running on the replica when it is deleted
        r = HTTP.post(rt.url + "/v1/chat/completions", timeout=20, headers={"x-session-id": "s"}, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "stream": True})
        out.append([r.headers["x-kvroute-replica"], *sse_events(r.content)])

    # route the stream to the replica that will leave: drain the other one for a moment
    HTTP.post(rt.url + f"{ADMIN}/127.0.0.1:{b.port}/drain", timeout=5)
    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: HTTP.get(a.url + "/sim/state").json()["counters"]["running"] == 1, timeout=5)
    HTTP.post(rt.url + f"{ADMIN}/127.0.0.1:{b.port}/undrain", timeout=5)
    r = HTTP.delete(rt.url + f"{ADMIN}/{gone}", timeout=5)
    assert r.status_code == 202 and r.json()["removing"] is True
    assert gone not in served_by(rt, 10)  # no new requests while it drains
    assert gone in names(rt)  # still there: a request runs on it
    t.join(10)
    assert out[0][0] == gone and out[0][-1] == "[DONE]" and len(out[0]) == 1 + 1 + 30 + 1
    wait_until(lambda: gone not in names(rt), timeout=5)
    assert f'replica="{gone}"' not in HTTP.get(rt.url + "/metrics").text


def test_deleting_an_unknown_replica_is_not_found(cluster):
    rt = cluster.router([cluster.sim()])
    r = HTTP.delete(rt.url + f"{ADMIN}/nobody", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_replicas_file_adds_and_removes_replicas_as_it_changes(cluster, tmp_path):
    a, b = cluster.sim(), cluster.sim()
    listed = tmp_path / "replicas.yaml"
    listed.write_text(json.dumps({"replicas": [{"name": "from-file", "url": b.url}]}))
    rt = cluster.router([a], "--set", f"replicas_file={listed}", "--set", "membership.sync_interval_s=0.2")
    wait_until(lambda: "from-file" in names(rt), timeout=5)
    wait_until(lambda: replicas_view(rt)[b.url]["state"] == "ready", timeout=10)
    assert "from-file" in served_by(rt)
    listed.write_text("replicas: []\n")
    wait_until(lambda: "from-file" not in names(rt), timeout=5)
    listed.write_text("replicas: [{url: 42}]\n")  # a broken file changes nothing, and says why
    time.sleep(0.6)
    assert names(rt) == {f"127.0.0.1:{a.port}"}
    wait_until(lambda: "replicas[0].url" in rt.log_tail(), timeout=5)  # written by the logging thread


def test_with_redis_a_replica_registered_on_one_router_is_used_by_all_and_survives_a_restart(cluster, shared_url):
    a, b = cluster.sim(), cluster.sim()
    index = ["--index", shared_url, "--set", "membership.sync_interval_s=0.2"]
    one, two = cluster.router([a], *index), cluster.router([a], *index)
    r = HTTP.post(one.url + ADMIN, json={"name": "shared", "url": b.url}, timeout=5)
    assert r.status_code == 201, r.text
    wait_until(lambda: "shared" in names(two), timeout=5)
    wait_until(lambda: replicas_view(two)[b.url]["state"] == "ready", timeout=10)
    assert "shared" in served_by(two)
    two.restart()
    two.wait_http("/ready", timeout=15)
    assert "shared" in names(two)  # read from Redis at start
    assert HTTP.delete(two.url + f"{ADMIN}/shared", timeout=5).status_code == 202
    wait_until(lambda: "shared" not in names(one) and "shared" not in names(two), timeout=5)


def test_a_replicas_key_is_not_written_to_redis(cluster, redis_proc):
    import subprocess

    b = cluster.sim("--api-key", "replica-secret-1")
    rt = cluster.router([cluster.sim()], "--index", f"redis://127.0.0.1:{redis_proc.port}/0")
    r = HTTP.post(rt.url + ADMIN, json={"name": "keyed", "url": b.url, "api_key": "replica-secret-1"}, timeout=5)
    assert r.status_code == 201, r.text
    assert "replica-secret-1" not in r.text
    wait_until(lambda: replicas_view(rt)[b.url]["state"] == "ready", timeout=10)  # this router uses the key
    dump = subprocess.run(["redis-cli", "-p", str(redis_proc.port), "--no-raw", "HGETALL", "kvroute:replicas"],
                          capture_output=True, text=True, timeout=10).stdout
    assert "keyed" in dump and "replica-secret-1" not in dump


def test_a_replica_registered_while_it_warms_up_is_starting_then_joins_without_a_warning(cluster):
    warming = cluster.sim("--warmup-s", "3", wait=False)
    rt = cluster.router([cluster.sim()], "--set", "health.interval_s=0.2")
    before = rt.log_tail(100_000)
    assert HTTP.post(rt.url + ADMIN, json={"name": "warming", "url": warming.url}, timeout=5).status_code == 201
    assert replicas_view(rt)[warming.url]["state"] == "starting"
    wait_until(lambda: replicas_view(rt)[warming.url]["state"] == "ready", timeout=15, interval=0.2)
    assert "WARNING" not in rt.log_tail(100_000)[len(before):]


def _sizes(rt) -> tuple[int, int, int]:
    return (len(HTTP.get(rt.url + ADMIN, timeout=10).content), len(HTTP.get(rt.url + "/metrics", timeout=10).content),
            len(HTTP.get(rt.url + "/v1/models", timeout=10).content))


def test_model_ids_a_replica_lists_are_bounded_and_forgotten_with_it(cluster):
    from router.replicas.models import MAX_MODELS
    sim, other = cluster.sim(), cluster.sim()
    rt = cluster.router([other, sim], "--set", "health.interval_s=0.2")
    for i in range(5):  # per-model metric series, as traffic makes them
        HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": f"x {i}", "max_tokens": 1}, timeout=5)
    before = _sizes(rt)
    set_faults(sim, extra_models=5000)
    wait_until(lambda: len(HTTP.get(rt.url + "/v1/models").json()["data"]) == MAX_MODELS, timeout=10)
    # log records are written by the logging thread, a moment after the state they describe
    wait_until(lambda: "lists more than" in rt.log_tail(1_000_000), timeout=5)
    for tag in "bcdefghij":  # adapters churning at every health check
        set_faults(sim, models_tag=tag)
        time.sleep(0.3)
    log = rt.log_tail(1_000_000)
    assert log.count("lists more than") == 1 and log.count("no tokenizer on this host") <= 2
    set_faults(sim, extra_models=0)
    wait_until(lambda: len(HTTP.get(rt.url + "/v1/models").json()["data"]) == 1, timeout=10)
    keys = HTTP.get(rt.url + ADMIN).json()["prompt_keys"]
    assert set(keys) == {"tiny"}
    after = _sizes(rt)
    assert all(a <= 1.1 * b for a, b in zip(after, before)), (before, after)


def test_a_router_refuses_to_register_itself(cluster):
    rt = cluster.router([cluster.sim()])
    r = HTTP.post(rt.url + ADMIN, json={"name": "me", "url": rt.url}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "replica_is_this_router"
    assert "me" not in names(rt)


def test_a_configured_replica_that_is_the_router_itself_never_takes_traffic(cluster):
    """Given its own address among the replicas (a config written for another host), the router finds itself
    at the first health check and keeps it out; /ready counts only the real replica."""
    from loadtest.cluster import free_port
    port = free_port()
    sim = cluster.sim()
    rt = cluster.router([sim, f"http://127.0.0.1:{port}"], port=port)
    wait_until(lambda: "this router itself" in rt.log_tail(), timeout=10)
    assert HTTP.get(rt.url + "/ready").json()["ready_replicas"] == 1
    assert served_by(rt, 10) == {f"127.0.0.1:{sim.port}"}
    set_faults(sim, health_status=503)
    wait_until(lambda: HTTP.get(rt.url + "/ready").status_code == 503, timeout=10)


def test_two_routers_pointing_at_each_other_cut_the_loop_at_the_first_repeated_hop(cluster):
    from loadtest.cluster import free_port
    port_a, port_b = free_port(), free_port()
    a = cluster.router([], config={"replicas": [{"url": f"http://127.0.0.1:{port_b}", "models": ["tiny"]}]},
                       port=port_a, wait_ready=False)
    b = cluster.router([], config={"replicas": [{"url": f"http://127.0.0.1:{port_a}", "models": ["tiny"]}]},
                       port=port_b, wait_ready=False)
    wait_until(lambda: HTTP.get(a.url + "/ready").status_code == 200, timeout=10)  # each sees the other ready
    wait_until(lambda: HTTP.get(b.url + "/ready").status_code == 200, timeout=10)
    r = HTTP.post(a.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 508 and r.json()["error"]["code"] == "request_loop", r.text
    counted = {}
    for name, rt in (("a", a), ("b", b)):  # a -> b -> a, cut there: a counts the client's and the looped one
        m = HTTP.get(rt.url + "/metrics").text
        counted[name] = sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines()
                            if line.startswith("kvroute_requests_total"))
    assert counted == {"a": 2, "b": 1}
