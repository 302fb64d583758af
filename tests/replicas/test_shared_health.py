"""Routers on one Redis share the health checks: each replica has one owner among them, which checks it at the
configured rate and whose verdict the others take; the others check it as many times less often as there are
routers."""

import time

import pytest

from loadtest.cluster import HTTP, free_ports
from support.processes import FAST
from support.state import replicas_view
from support.waiting import wait_until

pytestmark = pytest.mark.shared  # several routers on one Redis

N = 12


def fleet(cluster, n=N):
    """``n`` stand-in replicas served by one process: their URLs."""
    base = free_ports(n)
    cluster.sim("--replicas", str(n), *FAST, port=base)
    return [f"http://127.0.0.1:{base + i}" for i in range(n)]


def health_answers(url, status):
    HTTP.post(url + "/sim/faults", json={"health_status": status}, timeout=2).raise_for_status()


def sim_counters(url):
    return HTTP.get(url + "/sim/state", timeout=2).json()["counters"]


def checks(rt):
    return HTTP.get(rt.url + "/admin/replicas", timeout=2).json()["health_checks"]


def sharing(*routers):
    """Every router sees every other taking part in the checks."""
    return all(checks(rt)["routers"] == len(routers) for rt in routers)


def owned_by(rt):
    return {url for url, r in replicas_view(rt).items() if r["checked_here"]}


def two_routers(cluster, shared, n=N):
    """A fleet of ``n`` and two routers sharing its checks on ``shared``, once each sees the other."""
    urls = fleet(cluster, n)
    a = cluster.router(urls, "--index", shared)
    b = cluster.router(urls, "--index", shared)
    wait_until(lambda: sharing(a, b), timeout=5)
    return urls, a, b


def test_every_replica_has_one_owner_both_routers_agree_on(cluster, shared_url):
    urls, a, b = two_routers(cluster, shared_url)
    owners_a = {url: r["checked_by"] for url, r in replicas_view(a).items()}
    owners_b = {url: r["checked_by"] for url, r in replicas_view(b).items()}
    assert owners_a == owners_b
    assert owned_by(a) | owned_by(b) == set(owners_a) and not owned_by(a) & owned_by(b)


def test_two_routers_sharing_the_checks_send_a_replica_fewer_than_two_routers_alone(cluster, redis_proc):
    urls = fleet(cluster, 6)
    fast = ("--set", "health.interval_s=0.1", "--set", "health.metrics_interval_s=0.1")
    a = cluster.router(urls, "--index", f"redis://127.0.0.1:{redis_proc.port}/0", *fast)
    b = cluster.router(urls, "--index", f"redis://127.0.0.1:{redis_proc.port}/0", *fast)
    wait_until(lambda: sharing(a, b), timeout=5)
    time.sleep(1.0)  # each router's checks settled on their pace (the first comes at a random point)
    before = [sim_counters(u)["health_checks"] for u in urls]
    time.sleep(4.0)
    per_s = sum(sim_counters(u)["health_checks"] for u in urls) / 4.0 - sum(before) / 4.0
    alone = len(urls) / 0.1  # one router checking alone; two alone would send twice that
    assert per_s < 1.7 * alone  # the owner at the full rate, the other at half of it: 1.5x
    assert per_s > 1.0 * alone  # every replica still checked at the configured rate by its owner


def test_a_replica_its_owner_finds_failing_leaves_the_other_routers_rotation_within_seconds(cluster, redis_proc):
    urls = fleet(cluster, 16)
    shared = f"redis://127.0.0.1:{redis_proc.port}/0"
    a = cluster.router(urls, "--index", shared, "--set", "health.interval_s=0.2")
    # B's own checks come a minute apart: only A's word can take the replica out of B's rotation that soon
    b = cluster.router(urls, "--index", shared, "--set", "health.interval_s=30", "--set", "health.metrics_interval_s=30")
    wait_until(lambda: sharing(a, b), timeout=5)
    victim = sorted(owned_by(a))[0]  # 16 replicas: A owns none of them one time in 65,536
    health_answers(victim, 503)
    took = wait_until(lambda: not replicas_view(b)[victim]["ready"], timeout=6)
    assert took < 4.0
    assert "another router" in replicas_view(b)[victim]["last_error"]
    health_answers(victim, 200)
    wait_until(lambda: replicas_view(b)[victim]["ready"], timeout=6)


def test_the_replicas_of_a_router_that_dies_are_checked_by_the_others_within_seconds(cluster, redis_proc):
    urls, a, b = two_routers(cluster, f"redis://127.0.0.1:{redis_proc.port}/0")
    assert owned_by(b) != set(urls)
    a.kill()
    took = wait_until(lambda: owned_by(b) == set(urls), timeout=8)
    assert took < 5.0  # three shared rounds (1 s each) and one more


def test_a_router_checks_every_replica_itself_while_redis_does_not_answer(cluster, redis_proc):
    urls, a, b = two_routers(cluster, f"redis://127.0.0.1:{redis_proc.port}/0")
    redis_proc.stop()
    wait_until(lambda: owned_by(b) == set(urls), timeout=5)
    got = checks(b)
    assert {k: got[k] for k in ("shared", "routers", "router", "checked_here")} == {
        "shared": False, "routers": 1, "router": None, "checked_here": len(urls)}
