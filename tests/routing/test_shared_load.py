"""One load picture across routers on one Redis: each router weighs the requests the others have in flight
at once, not a scrape later, and a router that dies leaves no phantom load behind."""

import threading
import time

import pytest

from loadtest.cluster import HTTP
from support.state import replicas_view
from support.waiting import wait_until

pytestmark = pytest.mark.shared  # several routers on one Redis

SLOW = ("--ttft-ms", "4000", "--itl-ms", "1")


def hold(rt, n, session=None):
    """Send ``n`` slow requests through ``rt`` without waiting for them (threads that end with the answers)."""
    def one(i):
        try:
            HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": f"held {i}", "max_tokens": 1},
                      timeout=15)
        except Exception:
            pass  # the router was killed under it
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def others(rt):
    return {url: r["other_routers_inflight"] for url, r in replicas_view(rt).items()}


def test_a_router_sees_the_requests_another_router_has_in_flight(cluster, shared_url):
    sims = [cluster.sim(*SLOW) for _ in range(2)]
    a = cluster.router(sims, "--index", shared_url)
    b = cluster.router(sims, "--index", shared_url)
    threads = hold(a, 4)
    took = wait_until(lambda: sum(others(b).values()) == 4, timeout=3)
    assert took < 1.0  # well under a scrape interval
    assert sum(others(a).values()) == 0  # its own are not counted twice
    time.sleep(1.5)  # a scrape of each replica: the engine's count of A's requests is not added to them again
    assert sum(r["load"] for r in replicas_view(b).values()) == 4
    for t in threads:
        t.join()
    wait_until(lambda: sum(others(b).values()) == 0, timeout=3)


def test_a_router_publishes_a_request_it_placed_at_once_not_an_interval_later(cluster, shared_url):
    sims = [cluster.sim(*SLOW) for _ in range(2)]
    a = cluster.router(sims, "--index", shared_url, "--set", "shared_load.interval_s=10")
    b = cluster.router(sims, "--index", shared_url)
    time.sleep(0.5)  # A's first round is behind it: its next is 10 s away unless its figures change
    threads = hold(a, 2)
    took = wait_until(lambda: sum(others(b).values()) == 2, timeout=3)
    assert took < 0.5
    for t in threads:
        t.join()


def test_a_router_places_requests_away_from_another_routers_load(cluster, shared_url):
    sims = [cluster.sim(*SLOW) for _ in range(2)]
    a = cluster.router([sims[0]], "--index", shared_url)  # A sends everything to the first
    b = cluster.router(sims, "--index", shared_url, "--policy", "least-loaded")
    threads = hold(a, 6)
    wait_until(lambda: sum(others(b).values()) == 6, timeout=3)
    placed = [HTTP.post(b.url + "/admin/explain/v1/completions",
                        json={"model": "tiny", "prompt": "new", "max_tokens": 1}, timeout=5).json()["best"]
              for _ in range(3)]
    assert placed == [[sims[1].url.removeprefix("http://")]] * 3  # named host:port
    for t in threads:
        t.join()


def test_a_decision_reads_the_other_routers_load_again_where_its_picture_is_stale(cluster, shared_url):
    sims = [cluster.sim(*SLOW) for _ in range(2)]
    a = cluster.router([sims[0]], "--index", shared_url)  # A sends everything to the first
    b = cluster.router(sims, "--index", shared_url, "--policy", "least-loaded", "--set", "shared_load.interval_s=10")
    time.sleep(0.5)  # B's first round is behind it: its next is 10 s away, and B itself places nothing
    threads = hold(a, 6)
    wait_until(lambda: sum(r["inflight"] for r in replicas_view(a).values()) == 6, timeout=3)
    time.sleep(0.1)  # A has published them
    placed = [HTTP.post(b.url + "/admin/explain/v1/completions",
                        json={"model": "tiny", "prompt": "new", "max_tokens": 1}, timeout=5).json()["best"]
              for _ in range(3)]
    assert placed == [[sims[1].url.removeprefix("http://")]] * 3
    for t in threads:
        t.join()


def test_without_the_shared_picture_another_routers_requests_are_not_seen_at_once(cluster, shared_url):
    sims = [cluster.sim(*SLOW) for _ in range(2)]
    a = cluster.router(sims, "--index", shared_url)
    b = cluster.router(sims, "--index", shared_url, "--set", "shared_load.enabled=false")
    threads = hold(a, 4)
    wait_until(lambda: sum(r["inflight"] for r in replicas_view(a).values()) == 4, timeout=3)
    time.sleep(0.3)
    assert sum(others(b).values()) == 0
    for t in threads:
        t.join()


def test_a_killed_routers_requests_leave_the_picture_within_its_ttl(cluster, shared_url):
    sims = [cluster.sim("--ttft-ms", "10000", "--itl-ms", "1") for _ in range(2)]
    a = cluster.router(sims, "--index", shared_url, "--set", "shared_load.ttl_s=1")
    b = cluster.router(sims, "--index", shared_url, "--set", "shared_load.ttl_s=1")
    hold(a, 4)
    wait_until(lambda: sum(others(b).values()) == 4, timeout=3)
    a.kill()
    gone = wait_until(lambda: sum(others(b).values()) == 0, timeout=5)
    assert gone < 2.5  # its figures expire a second after its last publication


def hold_long(rt, tags):
    """A long prompt (thousands of uncached tokens) per tag through ``rt``, held by slow replicas (threads)."""
    def one(tag):
        prompt = " ".join(f"{tag}{i} words of its own" for i in range(400))
        try:
            HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                      timeout=15)
        except Exception:
            pass
    threads = [threading.Thread(target=one, args=(tag,), daemon=True) for tag in tags]
    for t in threads:
        t.start()
    return threads


STALE = ("--set", "shared_load.interval_s=10", "--set", "shared_load.min_interval_s=10",
         "--set", "shared_load.max_age_s=10")  # its picture read once at start: only a claim tells it more


def place_behind_a_stale_picture(cluster, shared_url, *b_args):
    """A places 4 long prompts on the first replica; B, whose picture predates them, then places 3 (one at a
    time). Returns B's requests per replica (URL)."""
    sims = [cluster.sim(*SLOW) for _ in range(2)]
    a = cluster.router([sims[0]], "--index", shared_url)
    time.sleep(0.3)  # A is in the picture B reads at its start
    b = cluster.router(sims, "--index", shared_url, *STALE, *b_args)
    time.sleep(0.3)
    threads = hold_long(a, "abcd")
    wait_until(lambda: replicas_view(a)[sims[0].url]["inflight"] == 4, timeout=3)
    time.sleep(0.1)  # A has published them
    for n, tag in enumerate("xyz", 1):
        threads += hold_long(b, [tag])
        wait_until(lambda: sum(r["inflight"] for r in replicas_view(b).values()) == n, timeout=3)
    placed = {url: r["inflight"] for url, r in replicas_view(b).items()}
    for t in threads:
        t.join()
    return sims, b, placed


# One Redis only: the claim's script is checked on Redis Cluster too in test_shared_load_claims.py
def test_a_long_prefill_placed_unseen_by_another_router_moves_its_next_placement_elsewhere(cluster, redis_proc):
    sims, b, placed = place_behind_a_stale_picture(cluster, f"redis://127.0.0.1:{redis_proc.port}/0")
    assert placed == {sims[0].url: 0, sims[1].url: 3}
    metrics = HTTP.get(b.url + "/metrics", timeout=2).text
    assert 'kvroute_shared_load_claims_total{outcome="moved"}' in metrics


def test_without_claims_a_stale_picture_places_onto_another_routers_prefill(cluster, redis_proc):
    sims, _, placed = place_behind_a_stale_picture(cluster, f"redis://127.0.0.1:{redis_proc.port}/0",
                                                   "--set", "shared_load.claim_min_tokens=null")
    assert placed[sims[0].url] >= 1
