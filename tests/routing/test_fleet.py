"""A large fleet: a decision weighs the replicas that hold the prompt's prefix, the least loaded and a few at
random, not every replica, and it places prompts as a decision among all of them does."""

import collections
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.processes import FAST
from loadtest.cluster import HTTP
from loadtest.cluster import free_ports

N = 40


def fleet(cluster, n=N, *args):
    base = free_ports(n)
    cluster.sim("--replicas", str(n), *(args or FAST), port=base)
    return [{"name": f"r{i}", "url": f"http://127.0.0.1:{base + i}", "block_size": 16} for i in range(n)]


def workload(groups=8, per_group=6, seed=3):
    rng = random.Random(seed)
    heads = [" ".join(f"g{g}w{rng.randrange(10**6)}" for _ in range(120)) for g in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    return [(g, heads[g] + f" question {i} {rng.random()}") for i, g in enumerate(order)]


def send(rt, prompt, **kw):
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                  timeout=20, **kw)
    assert r.status_code == 200, r.text
    return r.headers["x-kvroute-replica"], int(r.headers["x-kvroute-cached-tokens"])


def test_a_decision_on_a_large_fleet_weighs_a_few_replicas(cluster):
    replicas = fleet(cluster)
    rt = cluster.router([], config={"replicas": replicas, "candidates": {"scan_up_to": 8}})
    prompt = workload()[0][1]
    send(rt, prompt)
    out = HTTP.post(rt.url + "/admin/explain/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=10).json()
    assert isinstance(out["weighed"], int) and out["weighed"] < N
    assert len(out["candidates"]) == out["weighed"]


def test_a_fleet_within_scan_up_to_is_decided_among_all_its_replicas(cluster):
    replicas = fleet(cluster, 12)
    rt = cluster.router([], config={"replicas": replicas})  # scan_up_to defaults to 32
    out = HTTP.post(rt.url + "/admin/explain/v1/completions",
                    json={"model": "tiny", "prompt": "hello " * 100, "max_tokens": 2}, timeout=10).json()
    assert out["weighed"] == "all" and len(out["candidates"]) == 12


def test_a_few_candidates_find_every_cached_prefix_a_full_scan_finds(cluster):
    replicas = fleet(cluster)
    full = cluster.router([], config={"replicas": replicas, "candidates": {"scan_up_to": 1000}})
    few = cluster.router([], config={"replicas": replicas, "candidates": {"scan_up_to": 8}})
    cached = {"full": 0, "few": 0}
    placed: dict[int, set[str]] = collections.defaultdict(set)
    for g, prompt in workload():
        cached["full"] += send(full, prompt)[1]
        replica, tokens = send(few, prompt)
        cached["few"] += tokens
        placed[g].add(replica)
    assert cached["full"] > 0
    assert cached["few"] >= 0.99 * cached["full"], cached
    assert all(len(r) == 1 for r in placed.values()), placed  # each group stays where its prefix is


def test_when_the_few_candidates_are_full_another_replica_takes_the_request(cluster):
    replicas = [dict(r, max_num_seqs=1) for r in fleet(cluster, 12, "--ttft-ms", "600", "--itl-ms", "1")]
    rt = cluster.router([], config={"replicas": replicas, "queue": {"timeout_s": 0.2}, "candidates": {
        "scan_up_to": 2, "holders": 1, "least_loaded": 1, "sampled": 0, "ranking_s": 10}})
    prompt = workload()[0][1]
    with ThreadPoolExecutor(10) as pool:
        got = list(pool.map(lambda _: send(rt, prompt), range(10)))
    assert len({replica for replica, _ in got}) == 10  # one each: none waited in the queue for a slot


def pool_of(n, **health):
    from router.config import HealthConfig, ProxyConfig, ReplicaConfig
    from router.load import LoadTable
    from router.metrics import Metrics
    from router.replicas import ReplicaPool
    metrics = Metrics()
    configs = [ReplicaConfig(name=f"r{i}", url=f"http://127.0.0.1:{1000 + i}") for i in range(n)]
    return ReplicaPool(configs, HealthConfig(**health), ProxyConfig(), metrics,
                       LoadTable([c.name for c in configs], metrics))


def test_a_fleet_within_the_control_budget_is_checked_at_the_configured_intervals():
    assert pool_of(24).control.spacing() == 1.0  # 24 x 3 requests a second, within 80


def test_a_larger_fleet_is_checked_less_often_so_the_router_sends_at_most_its_budget():
    pool = pool_of(1024)
    rate = len(pool.replicas) * (1.2 / pool.health.config.interval_s + 1.0 / pool.health.config.metrics_interval_s)
    assert rate / pool.control.spacing() == pytest.approx(80.0)  # health checks (a fifth of them with /v1/models) and scrapes
    assert pool_of(1024, max_requests_per_s=1000).control.spacing() < pool.control.spacing()


def rankings_made(monkeypatch, ranking_cpu, seconds=0.3, n=256):
    """How many rankings a large fleet's candidates make while asked for them for ``seconds`` (ranking_s 0.01)."""
    from router.candidates import Candidates
    from router.config import CandidatesConfig
    pool = pool_of(n)
    made = []
    standings = pool.standings
    monkeypatch.setattr(pool, "standings", lambda: made.append(1) or standings())
    candidates = Candidates(pool, CandidatesConfig(ranking_s=0.01, ranking_cpu=ranking_cpu))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        candidates.eligible("tiny")
        time.sleep(0.002)
    return len(made)


def test_a_ranking_is_made_again_once_it_is_ranking_s_old(monkeypatch):
    assert 10 <= rankings_made(monkeypatch, ranking_cpu=1.0) <= 31  # 0.3 s / 0.01 s


def test_a_ranking_that_would_take_more_than_its_share_of_a_core_is_made_less_often(monkeypatch):
    # a ranking of 256 replicas takes well over 1 µs: at most a millionth of a core leaves one ranking in 0.3 s
    assert rankings_made(monkeypatch, ranking_cpu=1e-6) == 1


def least_named(standings, rankings=40, head=8):
    """How often each replica is among the ``head`` least loaded over ``rankings`` rankings of ``standings``."""
    from router.candidates import Ranking
    rng = random.Random(7)
    return collections.Counter(n for _ in range(rankings) for n in Ranking(standings, head, rng).least["tiny"])


def test_equally_loaded_replicas_are_named_least_loaded_in_turn_not_by_name():
    idle = [(0.0, 0, f"r{i:02d}", frozenset({"tiny"}), 16) for i in range(64)]
    named = least_named(idle)
    assert len(named) > 48  # a fixed order would name the same 8 every time
    assert max(named.values()) < 20


def test_the_least_loaded_are_named_before_any_busier_replica():
    standings = [(0.5 if i % 2 else 0.0, 0, f"r{i:02d}", frozenset({"tiny"}), 16) for i in range(64)]
    assert all(int(n[1:]) % 2 == 0 for n in least_named(standings))


def test_a_router_spaces_out_its_checks_to_keep_its_idle_cpu_within_max_idle_cpu(cluster):
    from support.waiting import wait_until
    replicas = fleet(cluster)  # 40 replicas: 88 control requests a second at the default intervals
    rt = cluster.router([], config={"replicas": replicas, "health": {"max_idle_cpu": 0.002}})

    def budget():
        return HTTP.get(rt.url + "/admin/replicas", timeout=2).json()["health_checks"]["budget"]

    wait_until(lambda: budget()["idle_windows_measured"] >= 1, timeout=20)
    measured = budget()
    # 0.2% of a core buys fewer than the floor of 10 a second at any cost a check has on this machine
    assert measured["cpu_ms_per_request"] > 0 and measured["requests_per_s"] == 10.0
    time.sleep(2.0)  # the pauses taken before the budget was measured run out

    def health_checks():
        return sum(HTTP.get(r["url"] + "/sim/state", timeout=2).json()["counters"]["health_checks"]
                   for r in replicas)
    before = health_checks()
    time.sleep(5.0)
    per_s = (health_checks() - before) / 5.0
    assert per_s < 12  # 10 control requests a second: ~4.5 health checks (at 80 a second: ~36)


def test_a_lower_control_budget_moves_the_checks_already_planned():
    import asyncio

    async def main():
        pool = pool_of(1024)  # 80 control requests a second: each replica every 28.16 pauses
        task = asyncio.create_task(pool.control.loop(pool.replicas["r0"]))
        await asyncio.sleep(0.3)  # its first check done (nothing listens there), the next planned within a pause
        before = pool.describe(pool.replicas["r0"])["next_check_in_s"]
        pool.control.budget.observe(cpu_s=0.4, requests=100, idle=True)  # 4 ms each: 10 a second buy 4% of a core
        after = pool.describe(pool.replicas["r0"])["next_check_in_s"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return before, after

    before, after = asyncio.run(main())
    assert 0 < before < 28.2
    assert after == pytest.approx(8 * before, abs=0.5)  # 225.28 pauses apart now, from now on
