"""The fault and load suite: kvroute under steady concurrent load while something breaks.

Stand-in replicas, one router, clients on threads (``helpers.Load``: streaming and non-streaming chat
and completions, every answer checked whole, every stream for all its tokens), all on 127.0.0.1 and
bounded in time. Each case reports its figures (printed at the end of the run).
"""

from __future__ import annotations

import random
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

from loadtest.cluster import HTTP
from support.state import set_faults, replicas_view, sim_state
from support.traffic import Load, openai_streams_through_a_kill
from support.waiting import wait_until
from loadtest.bad_replica import MODES
from loadtest.cluster import Proc, RedisCluster, free_port, redis_server, wait_redis
from loadtest.tiny_model import write_tokenizer
from router.store.client import slot

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

PACED = ("--ttft-ms", "5", "--itl-ms", "10")


def metric(rt: Proc, line_start: str) -> float:
    for line in HTTP.get(rt.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


def steady(seconds: float) -> None:
    time.sleep(seconds)


def all_ready(rt: Proc) -> None:
    """Wait until every replica of ``rt`` is in rotation: /ready needs only one, and a replica whose first check
    comes after the first requests finds every prefix of the load cached elsewhere, and may get no request."""
    wait_until(lambda: all(v["state"] == "ready" for v in replicas_view(rt).values()), timeout=15, interval=0.1)


def test_a_replica_killed_at_a_random_moment_loses_no_request(cluster, figure):
    sims = [cluster.sim(*PACED) for _ in range(3)]
    rt = cluster.router(sims)
    with Load(rt.url, clients=16, max_tokens=16) as load:
        steady(1.0)
        killed = time.monotonic() + random.Random(1).uniform(0.2, 1.5)
        steady(killed - time.monotonic())
        # a moment when a stream is under way there: with none, there would be nothing to continue
        wait_until(lambda: sim_state(sims[0])["streaming"] > 0, 5.0)
        killed = time.monotonic()
        sims[0].kill()
        steady(3.0)
    s = load.summary()
    figure({**s, "continued": metric(rt, 'kvroute_stream_failovers_total{outcome="completed"}'),
            "after_kill": load.summary(since=killed)})
    assert s["requests"] > 100 and s["failed"] == 0, s
    assert metric(rt, 'kvroute_stream_failovers_total{outcome="completed"}') >= 1


def test_streams_on_a_killed_replica_complete_through_the_openai_client_with_every_token(cluster, figure):
    sims = [cluster.sim(*PACED) for _ in range(2)]
    rt = cluster.router(sims)
    results, killed = openai_streams_through_a_kill(rt, sims[0], clients=16, max_tokens=32)
    failed = [(round(s - killed, 2), rep, err) for s, rep, _, _, err in results if err is not None]
    short = [(rep, chunks, tokens) for _, rep, chunks, tokens, _ in results if (chunks, tokens) != (32, 32)]
    figure({"streams": len(results), "failed": len(failed), "short": len(short),
            "continued": metric(rt, 'kvroute_stream_failovers_total{outcome="completed"}')})
    assert not failed and not short, (failed, short)
    assert metric(rt, 'kvroute_stream_failovers_total{outcome="completed"}') >= 1


@pytest.mark.parametrize("mode", MODES)
def test_a_broken_replica_costs_no_request_and_is_taken_out(cluster, figure, mode):
    good = [cluster.sim(*PACED) for _ in range(2)]
    port = free_port()
    bad = Proc(f"bad-{mode}", [sys.executable, "-m", "loadtest.bad_replica", "--port", str(port), "--mode", mode],
               port, log_path=cluster.log_dir / f"bad-{port}.log")
    cluster.procs.append(bad.start())
    bad.wait_http("/health")
    rt = cluster.router([*good, bad], config={"proxy": {"stream_headers_timeout_s": 1.5, "request_timeout_s": 3,
                                                       "stream_idle_timeout_s": 2}})
    all_ready(rt)
    with Load(rt.url, clients=8, max_tokens=8) as load:
        wait_until(lambda: replicas_view(rt)[bad.url]["state"] != "ready", timeout=60, interval=0.2)
        out_at = time.monotonic()
        steady(1.0)
    s = load.summary()
    view = replicas_view(rt)
    figure({**s, "taken_out_after_s": round(out_at - load.outcomes[0][0], 1), "bad_state": view[bad.url]["state"]})
    # no request fails; an invalid stream that already started ends with a clean SSE error event
    allowed = {"error event", "invalid event"} if mode == "invalid_sse" else set()
    assert set(s["failures"]) <= allowed, s
    assert s["failed_before_streaming"] == 0
    wait_until(lambda: all(r["inflight"] == 0 for r in replicas_view(rt).values()), timeout=10)
    wait_until(lambda: metric(rt, "kvroute_event_loop_tasks") < 30, timeout=10)  # nothing stuck


def test_a_replica_that_accepts_requests_and_answers_none_is_out_within_10_s_and_costs_no_request(cluster, figure):
    """A hung engine behind a live API server (its /health 200), with every timeout at its default."""
    good = [cluster.sim(*PACED) for _ in range(2)]
    hung = cluster.sim(*PACED)
    rt = cluster.router([*good, hung])
    all_ready(rt)
    set_faults(hung, hang=True)
    with Load(rt.url, clients=8, max_tokens=8) as load:
        out_after = wait_until(lambda: replicas_view(rt)[hung.url]["state"] != "ready", timeout=30, interval=0.1)
        steady(2.0)
    s = load.summary()
    slowest = max(seconds for _, seconds, _, _, _ in load.outcomes)
    figure({**s, "out_after_s": round(out_after, 1), "slowest_s": round(slowest, 1),
            "hung_got": sim_state(hung)["received"]})
    assert out_after < 10  # from the first request on, which went to it at once
    assert not s["failures"] and s["failed_before_streaming"] == 0, s
    assert slowest < 12  # the requests it held were moved, not left to request_timeout_s (600 s)
    assert "stalled" in replicas_view(rt)[hung.url]["last_error"]


def test_a_replica_whose_events_claim_ever_more_blocks_is_held_to_its_capacity_under_load(cluster, figure, tmp_path):
    """Its events announce 20,000 new blocks a second for 20 s and never a removal (lost removals, or a lying
    engine); it reports 4,096 KV blocks. The router's index for it stays within that, and its memory flat."""
    root = str(write_tokenizer(tmp_path / "tiny"))
    events = ("--root", root, "--block-size", "16", "--kv-events", "--num-gpu-blocks", "4096")
    honest, lying = cluster.sim(*PACED, *events), cluster.sim(*PACED, *events)
    rt = cluster.router([honest, lying])
    wait_until(lambda: all(v["index"]["mode"] == "precise" for v in replicas_view(rt).values()), timeout=15)
    set_faults(lying, kv_drop_removals=True)
    rss = lambda: round(metric(rt, "process_resident_memory_bytes") / 2**20, 1)  # noqa: E731
    with Load(rt.url, clients=6, max_tokens=8) as load:
        steady(2.0)
        before, peak = rss(), 0.0
        HTTP.post(lying.url + "/sim/kv_flood", json={"blocks_per_s": 20_000, "seconds": 20},
                  timeout=5).raise_for_status()
        for _ in range(22):
            steady(1.0)
            peak = max(peak, rss())
    s = load.summary()
    index = replicas_view(rt)[lying.url]["index"]
    figure({**s, "rss_before_mb": before, "rss_peak_mb": peak, "announced": index["events"]["blocks"]["stored"],
            "held": index["event_blocks_held"], "evicted": index["events"]["blocks"]["evicted"]})
    assert not s["failures"], s
    assert index["events"]["blocks"]["stored"] > 100_000
    assert index["event_blocks_held"] <= 4096
    assert peak <= 1.1 * before + 5, (before, peak)


def test_model_ids_churning_at_every_health_check_leave_memory_and_answers_as_they_were(cluster, figure):
    """A replica listing 5,000 ids that change at every check (LoRA adapters loading and unloading), under load:
    per-model state stays bounded while it churns and goes once it stops."""
    good = cluster.sim(*PACED)
    churning = cluster.sim(*PACED)
    rt = cluster.router([good, churning], "--set", "health.interval_s=0.2")

    def sizes() -> dict:
        return {"rss_mb": round(metric(rt, "process_resident_memory_bytes") / 2**20, 1),
                "admin_kb": len(HTTP.get(rt.url + "/admin/replicas", timeout=10).content) // 1024,
                "metrics_kb": len(HTTP.get(rt.url + "/metrics", timeout=10).content) // 1024}

    with Load(rt.url, clients=6, max_tokens=8) as load:
        steady(2.0)
        before = sizes()
        started = time.monotonic()
        tags = iter(range(10**6))
        peak = before
        while time.monotonic() - started < 15:
            set_faults(churning, extra_models=5000, models_tag=f"t{next(tags)}")
            steady(0.25)
            now = sizes()
            peak = {k: max(peak[k], now[k]) for k in now}
        set_faults(churning, extra_models=0)
        wait_until(lambda: len(HTTP.get(rt.url + "/v1/models", timeout=10).json()["data"]) == 1, timeout=10)
        steady(2.0)
        after = sizes()
    s = load.summary()
    warnings = rt.log_tail(10_000_000).count("WARNING")
    figure({**s, "before": before, "peak": peak, "after": after, "tag_changes": next(tags), "warnings": warnings})
    assert not s["failures"], s
    assert after["admin_kb"] <= 1.1 * before["admin_kb"] and after["metrics_kb"] <= 1.1 * before["metrics_kb"]
    # what was freed goes back to the system (malloc_trim); what stays (about 4 MB here) is Python allocator
    # arenas that a few long-lived objects still occupy, not the churned state
    assert after["rss_mb"] <= 1.1 * before["rss_mb"], (before, after)
    assert peak["rss_mb"] < before["rss_mb"] + 25, (before, peak)
    assert warnings < 20


def test_redis_killed_and_restarted_under_load_fails_no_request(cluster, figure, tmp_path):
    redis = redis_server(log_dir=tmp_path).start()
    cluster.procs.append(redis)
    wait_redis(redis)
    sims = [cluster.sim(*PACED) for _ in range(2)]
    rt = cluster.router(sims, "--index", f"redis://127.0.0.1:{redis.port}/0")
    with Load(rt.url, clients=12, max_tokens=8) as load:
        steady(1.0)
        redis.kill()
        down = time.monotonic()
        steady(2.0)
        redis.start()
        wait_redis(redis)
        steady(2.0)
    s = load.summary()
    figure({**s, "while_down": load.summary(since=down, until=down + 2),
            "fallback_lookups": metric(rt, "kvroute_index_fallback_lookups_total")})
    assert s["failed"] == 0 and metric(rt, "kvroute_index_fallback_lookups_total") > 0, s


def test_a_redis_cluster_master_killed_under_load_fails_no_request(cluster, figure, tmp_path):
    rc = RedisCluster(tmp_path).start()
    cluster.procs.extend(rc.procs)
    sims = [cluster.sim(*PACED) for _ in range(2)]
    # a lone Redis answer slower than index.timeout_s is answered locally by design; on this busy 2-core machine
    # (six Redis processes, two routers, two replicas, sixteen clients) the default 50 ms is missed now and then,
    # which is not what this test is about: whether lookups go back to Redis once the slot has a master again
    routers = [cluster.router(sims, "--index", rc.url, "--set", "index.timeout_s=0.25") for _ in range(2)]
    index_slot = slot("{tiny}")  # every index key of the model "tiny" (router.store.layout)
    victim = next(port for port, ranges in rc.masters().items() if any(a <= index_slot <= b for a, b in ranges))
    with Load(routers[0].url, clients=8, max_tokens=8) as a, Load(routers[1].url, clients=8, max_tokens=8) as b:
        steady(1.0)
        rc.proc(victim).kill()
        down = time.monotonic()
        rc.wait_ok(timeout=20)  # a replica promoted in its place
        promoted = time.monotonic() - down
        steady(1.0)
        fallback_after = metric(routers[0], "kvroute_index_fallback_lookups_total")
        back = time.monotonic()
        steady(2.0)
        fallback_later = metric(routers[0], "kvroute_index_fallback_lookups_total")
        back_until = time.monotonic()
    sa, sb = a.summary(), b.summary()
    figure({"requests": sa["requests"] + sb["requests"], "failed": sa["failed"] + sb["failed"],
            "promoted_after_s": round(promoted, 2), "fallback_lookups": fallback_later,
            "while_down": a.summary(since=down, until=down + promoted)})
    assert sa["failed"] == 0 and sb["failed"] == 0, (sa, sb)
    assert fallback_after > 0  # routed on the local index while the slot had no master
    # and on the promoted replica again once it had one: still in the fallback, every lookup would count
    sent_back = a.summary(since=back, until=back_until)["requests"]
    assert sent_back > 0 and fallback_later - fallback_after <= 0.02 * sent_back, \
        (fallback_after, fallback_later, sent_back)


def test_a_router_killed_among_four_costs_the_others_no_request_and_leaves_no_load_or_lease_behind(
        cluster, figure, shared_url, tmp_path):
    root = str(write_tokenizer(tmp_path / "tiny"))
    sims = [cluster.sim(*PACED, "--root", root, "--block-size", "16", "--kv-events") for _ in range(4)]
    shared = ("--index", shared_url, "--set", "kv_events.lease_s=1", "--set", "shared_load.ttl_s=1")
    routers = [cluster.router(sims, *shared) for _ in range(4)]

    def holders(sim):
        out = []
        for rt in routers:
            try:
                if replicas_view(rt)[sim.url]["index"]["events"]["lease_held"]:
                    out.append(rt)
            except httpx.HTTPError:
                pass  # the router killed
        return out

    wait_until(lambda: all(len(holders(s)) == 1 for s in sims), timeout=15)
    victim = max(routers, key=lambda rt: sum(holders(s) == [rt] for s in sims))
    its_sims = [s for s in sims if holders(s) == [victim]]
    others = [rt for rt in routers if rt is not victim]

    def phantom():  # requests the survivors see on other routers, summed over every replica
        return sum(r["other_routers_inflight"] for rt in others for r in replicas_view(rt).values())

    loads = [Load(rt.url, clients=4, max_tokens=8, seed=i) for i, rt in enumerate(others)]
    for load in loads:
        load.__enter__()
    with Load(victim.url, clients=4, max_tokens=8, seed=9) as doomed:
        steady(1.5)
        victim.kill()
        killed = time.monotonic()
        doomed.stop()  # its clients saw their router die
    wait_until(lambda: all(len(holders(s)) == 1 for s in its_sims), timeout=5)
    leases_moved = time.monotonic() - killed
    steady(max(0.0, 1.5 - (time.monotonic() - killed)))  # past shared_load.ttl_s
    for load in loads:
        load.stop()
    left = wait_until(lambda: phantom() == 0, timeout=3)
    summaries = [load.summary() for load in loads]
    figure({"requests": sum(s["requests"] for s in summaries), "failed": sum(s["failed"] for s in summaries),
            "leases_held_by_the_killed": len(its_sims), "leases_moved_after_s": round(leases_moved, 2),
            "phantom_gone_after_stop_s": round(left, 2)})
    assert all(s["failed"] == 0 for s in summaries), summaries
    # expiry (a lease period), a poll (a third), half a period free when the others hold their share (rounded up
    # to polls): 2 periods, and a second of slack for this machine's 2 busy cores (measured 1.4-2.6 s)
    assert its_sims and leases_moved < 2 * 1.0 + 1.0 + 1.0, leases_moved


def test_redis_slowed_by_100_ms_under_load_fails_no_request(cluster, figure, tmp_path):
    redis = redis_server(log_dir=tmp_path).start()
    cluster.procs.append(redis)
    wait_redis(redis)
    slow = cluster.slow_link(redis, delay_ms=100)
    sims = [cluster.sim(*PACED) for _ in range(2)]
    rt = cluster.router(sims, "--index", f"redis://127.0.0.1:{slow.port}/0")
    with Load(rt.url, clients=12, max_tokens=8) as load:
        steady(4.0)
    s = load.summary()
    figure(s)
    assert s["requests"] > 50 and s["failed"] == 0, s


def test_hostile_clients_leave_other_clients_served(cluster, figure):
    """2,000 idle connections, 100 sending headers one byte a second and 20 that stop reading long streams,
    beside 6 ordinary clients."""
    sim = cluster.sim("--ttft-ms", "5", "--itl-ms", "0", "--max-model-len", "200000")
    rt = cluster.router([sim], config={"client": {"send_timeout_s": 2, "header_timeout_s": 3}})
    rss = lambda: metric(rt, "process_resident_memory_bytes")  # noqa: E731
    with Load(rt.url, clients=6, max_tokens=8) as load:
        steady(1.5)
        calm = load.summary()
        rss_before = rss()
        socks: list[socket.socket] = []
        try:
            for _ in range(2000):
                socks.append(socket.create_connection(("127.0.0.1", rt.port)))
            slow = [socket.create_connection(("127.0.0.1", rt.port)) for _ in range(100)]
            socks += slow
            body = b'{"model": "tiny", "prompt": "x", "max_tokens": 150000, "stream": true}'
            for _ in range(20):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", rt.port))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(body), body))
                socks.append(s)
            hostile = time.monotonic()
            for i in range(4):
                for s in slow:
                    try:
                        s.send(b"POST /v1/completions HTTP/1.1\r\n"[i:i + 1])
                    except OSError:
                        pass
                steady(1.0)
            rss_during = rss()
            wait_until(lambda: sim_state(sim)["aborted"] >= 20, timeout=30, interval=0.5)
            steady(1.0)
        finally:
            for s in socks:
                s.close()
    during = load.summary(since=hostile)
    figure({"calm": calm, "during": during, "rss_mb_before": round(rss_before / 2**20, 1),
            "rss_mb_during": round(rss_during / 2**20, 1), "aborted_on_replica": sim_state(sim)["aborted"],
            "refused": {r: metric(rt, f'kvroute_client_refused_total{{reason="{r}"}}')
                        for r in ("header_timeout", "send_timeout")}})
    assert during["requests"] > 20 and during["failed"] == 0, during
    assert rss_during - rss_before < 100 * 2**20
    assert metric(rt, 'kvroute_client_refused_total{reason="send_timeout"}') == 20
    assert metric(rt, 'kvroute_client_refused_total{reason="header_timeout"}') >= 2000


def test_a_burst_far_above_capacity_is_queued_or_refused_with_429_and_nothing_else_fails(cluster, figure):
    sims = [cluster.sim("--ttft-ms", "50", "--itl-ms", "10") for _ in range(2)]
    rt = cluster.router([], config={"replicas": [{"url": s.url, "max_num_seqs": 4} for s in sims],
                                    "queue": {"max_size": 8, "timeout_s": 5}})
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            r = HTTP.post(rt.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": f"burst {i}", "max_tokens": 8})
            code = r.json()["error"]["code"] if r.status_code != 200 else ""
            with lock:
                results.append((r.status_code, code))
        except httpx.HTTPError as e:
            with lock:
                results.append((-1, repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    by_status = {s: sum(1 for r in results if r[0] == s) for s in {r[0] for r in results}}
    figure({"sent": 64, "capacity": 8, "queue": 8, "by_status": by_status,
            "peak_in_flight_per_replica": [sim_state(s)["peak_in_flight"] for s in sims]})
    assert set(by_status) <= {200, 429}
    assert by_status.get(200, 0) >= 16  # capacity and queue
    assert {code for status, code in results if status == 429} == {"router_queue_full"}
    assert all(sim_state(s)["peak_in_flight"] <= 4 for s in sims)


def test_sigterm_under_load_turns_ready_503_first_and_lets_streams_finish(cluster, figure):
    sims = [cluster.sim(*PACED) for _ in range(2)]
    rt = cluster.router(sims, "--set", "shutdown_grace_s=10")
    ready: list[tuple[float, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                ready.append((time.monotonic(), HTTP.get(rt.url + "/ready", timeout=1).status_code))
            except httpx.HTTPError:
                ready.append((time.monotonic(), -1))
            time.sleep(0.1)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with Load(rt.url, clients=8, max_tokens=40) as load:
            steady(1.5)
            rt.signal(signal.SIGTERM)
            term = time.monotonic()
            assert rt.popen is not None
            rt.popen.wait(20)
            exited = time.monotonic()
    finally:
        stop.set()
        poller.join()
    first_503 = min((t for t, s in ready if s == 503 and t > term), default=None)
    first_refused = min((t for t, s in ready if s == -1 and t > term), default=None)
    started_before = [o for o in load.outcomes if o[0] < term]
    figure({"in_flight_at_sigterm_finished": sum(1 for o in started_before if o[2]),
            "of": len(started_before), "ready_503_after_s": first_503 and round(first_503 - term, 2),
            "refused_after_s": first_refused and round(first_refused - term, 2), "exited_after_s": round(exited - term, 2),
            "exit_code": rt.popen.returncode})
    assert rt.popen.returncode == 0
    assert first_503 is not None and (first_refused is None or first_503 < first_refused)
    assert all(o[2] for o in started_before), [o for o in started_before if not o[2]]
