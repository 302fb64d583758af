"""The precise index: stand-in replicas publish KV-cache events as vLLM does; the router applies them.

Every stand-in here tokenizes with the tiny model's tokenizer (its folder is the model's ``root``),
so the router finds it by itself and keys prompts by the same token ids the events carry.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from loadtest.tiny_model import write_tokenizer
from support.processes import FAST
from loadtest.cluster import HTTP
from support.state import replicas_view, set_faults
from support.traffic import cached, chat, predicted, run_with_bypass, text
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return str(write_tokenizer(tmp_path_factory.mktemp("tiny")))


def events_sim(cluster, root, *extra):
    return cluster.sim(*FAST, "--root", root, "--block-size", "16", "--kv-events", *extra)


def sim_events(sim):
    return HTTP.get(sim.url + "/sim/state", timeout=2).json()


def index_of(rt, sim):
    return replicas_view(rt)[sim.url]["index"]


def source_of(rt, sim):
    return index_of(rt, sim)["events"]["sources"][0]


def wait_applied(rt, sims, timeout=5.0):
    """Until the router applied every batch each stand-in published (none pending there)."""
    def done():
        for s in sims:
            st = sim_events(s)["kv_events"]
            if st["pending"] or (st["next_seq"] and source_of(rt, s)["last_seq"] != st["next_seq"] - 1):
                return False
        return True
    wait_until(done, timeout)


def wait_precise(rt, sims, timeout=10.0):
    wait_until(lambda: all(index_of(rt, s)["mode"] == "precise" for s in sims), timeout)


def test_every_routed_prediction_equals_the_replicas_cached_tokens_despite_bypass_traffic(cluster, model_root):
    sims = [events_sim(cluster, model_root, "--num-gpu-blocks", "400") for _ in range(2)]
    rt = cluster.router(sims)
    wait_precise(rt, sims)
    # traffic the router never saw, known from the events alone
    pairs = run_with_bypass(rt, sims, seed=1, settle=lambda: wait_applied(rt, sims))
    assert len(pairs) > 10 and sum(a for _, a in pairs) > 0
    assert [p for p, _ in pairs] == [a for _, a in pairs]


def test_the_approximate_index_misses_what_bypass_traffic_cached(cluster, model_root):
    """The same workload with events ignored: the router cannot know what the direct requests cached."""
    sims = [events_sim(cluster, model_root, "--num-gpu-blocks", "400") for _ in range(2)]
    rt = cluster.router(sims, "--set", "kv_events.enabled=false")
    wait_until(lambda: index_of(rt, sims[0])["mode"] == "approximate", 5)
    pairs = run_with_bypass(rt, sims, seed=1, settle=lambda: time.sleep(0.05))
    wrong = sum(1 for p, a in pairs if p != a)
    assert wrong >= 3, pairs


def test_lost_batches_are_replayed_and_the_index_equals_the_replicas_cache(cluster, model_root):
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim])
    wait_precise(rt, [sim])
    rng = random.Random(2)
    prompts = [[{"role": "user", "content": text(rng, 80)}] for _ in range(8)]
    set_faults(sim, kv_drop_batches=5)
    with httpx.Client(timeout=10) as c:
        for p in prompts:  # straight to the replica: only its events tell the router
            chat(c, sim.url, p)
            wait_until(lambda: sim_events(sim)["kv_events"]["pending"] == 0, 2)
        wait_applied(rt, [sim])
        src = source_of(rt, sim)
        assert sim_events(sim)["kv_events"]["dropped"] == 5
        assert (src["gaps"], src["replays"], src["rebuilds"]) == (1, 1, 0)
        assert index_of(rt, sim)["event_blocks_held"] == sim_events(sim)["cached_blocks"]
        for p in prompts:
            r = chat(c, rt.url, p)
            assert predicted(r) == cached(r) > 0


def test_without_replay_lost_batches_lead_to_a_rebuild_that_never_over_predicts(cluster, model_root):
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim])
    wait_precise(rt, [sim])
    rng = random.Random(3)
    before = [[{"role": "user", "content": text(rng, 80)}] for _ in range(3)]
    lost = [[{"role": "user", "content": text(rng, 80)}] for _ in range(5)]
    after = [[{"role": "user", "content": text(rng, 80)}] for _ in range(3)]
    with httpx.Client(timeout=10) as c:
        for p in before:
            chat(c, sim.url, p)
        wait_applied(rt, [sim])
        set_faults(sim, kv_drop_batches=5, kv_replay=False)
        for p in lost + after:
            chat(c, sim.url, p)
            wait_until(lambda: sim_events(sim)["kv_events"]["pending"] == 0, 2)
        wait_applied(rt, [sim])
        src = source_of(rt, sim)
        assert (src["gaps"], src["rebuilds"]) == (1, 1)
        held = index_of(rt, sim)["event_blocks_held"]
        assert 0 < held < sim_events(sim)["cached_blocks"]
        results = [(predicted(r), cached(r)) for r in (chat(c, rt.url, p) for p in before + lost + after)]
    assert all(p <= a for p, a in results), results
    assert all(p == a > 0 for p, a in results[-3:]), results  # batches after the gap are exact


def test_a_replica_restart_empties_its_entries(cluster, model_root):
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim])
    wait_precise(rt, [sim])
    prompt = [{"role": "user", "content": text(random.Random(4), 80)}]
    with httpx.Client(timeout=10) as c:
        chat(c, sim.url, prompt)
        wait_applied(rt, [sim])
        assert index_of(rt, sim)["event_blocks_held"] > 0
        HTTP.post(sim.url + "/sim/restart", timeout=2).raise_for_status()
        wait_until(lambda: index_of(rt, sim)["event_blocks_held"] == 0, 5)
        r = chat(c, rt.url, prompt)
        assert predicted(r) == cached(r) == 0


def test_a_sequence_number_going_back_is_a_restart(cluster, model_root):
    """Seen in the stream before the replica's /metrics tells (scrapes every 30 s here)."""
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim], "--set", "health.metrics_interval_s=30")
    wait_precise(rt, [sim])
    rng = random.Random(5)
    old, new = ([{"role": "user", "content": text(rng, 80)}] for _ in range(2))
    with httpx.Client(timeout=10) as c:
        for _ in range(3):
            chat(c, sim.url, [{"role": "user", "content": text(rng, 80)}])
            wait_until(lambda: sim_events(sim)["kv_events"]["pending"] == 0, 2)
        chat(c, sim.url, old)
        wait_applied(rt, [sim])
        HTTP.post(sim.url + "/sim/restart", timeout=2).raise_for_status()
        chat(c, sim.url, new)
        wait_until(lambda: source_of(rt, sim)["restarts"] == 1, 5)
        wait_applied(rt, [sim])
        assert index_of(rt, sim)["event_blocks_held"] == sim_events(sim)["cached_blocks"]
        r_old, r_new = chat(c, rt.url, old), chat(c, rt.url, new)
    assert predicted(r_old) == cached(r_old) == 0
    assert predicted(r_new) == cached(r_new) > 0


def test_all_blocks_cleared_drops_the_replicas_blocks(cluster, model_root):
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim])
    wait_precise(rt, [sim])
    with httpx.Client(timeout=10) as c:
        chat(c, sim.url, [{"role": "user", "content": text(random.Random(6), 80)}])
        wait_applied(rt, [sim])
        assert index_of(rt, sim)["event_blocks_held"] > 0
        c.post(sim.url + "/reset_prefix_cache").raise_for_status()
        wait_applied(rt, [sim])
    assert index_of(rt, sim)["event_blocks_held"] == 0
    assert index_of(rt, sim)["events"]["events"]["AllBlocksCleared"] == 1


def test_a_replica_whose_events_never_remove_a_block_is_indexed_at_most_up_to_its_capacity(cluster, model_root):
    """Its events claim ever more blocks (removals lost, or a lying engine): the index keeps no more than its KV
    cache holds, evicting the oldest and counting them."""
    sim = events_sim(cluster, model_root, "--num-gpu-blocks", "64")
    rt = cluster.router([sim])
    wait_precise(rt, [sim])
    set_faults(sim, kv_drop_removals=True)
    HTTP.post(sim.url + "/sim/kv_flood", json={"blocks_per_s": 20_000, "seconds": 2}, timeout=5).raise_for_status()
    time.sleep(2.5)
    wait_applied(rt, [sim])
    index = index_of(rt, sim)
    stored = index["events"]["blocks"]["stored"]
    assert stored > 10 * 64, index  # the replica announced far more than it holds
    assert index["event_blocks_held"] <= 64
    assert index["events"]["blocks"]["evicted"] >= stored - 64

    def indexed() -> list[float]:  # refreshed every 5 s
        return [float(line.rsplit(" ", 1)[1]) for line in HTTP.get(rt.url + "/metrics").text.splitlines()
                if line.startswith("kvroute_index_blocks{")]
    wait_until(lambda: indexed() and indexed()[0] > 0, timeout=8)
    assert indexed()[0] <= 64


def test_a_silent_source_is_reconnected_and_caught_up_while_the_replica_serves(cluster, model_root):
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim], "--set", "kv_events.silence_s=1")
    wait_precise(rt, [sim])
    set_faults(sim, kv_drop_batches=10_000)  # published and buffered, never delivered: a dead connection
    rng = random.Random(7)
    with httpx.Client(timeout=10) as c:
        until = time.monotonic() + 8  # new prompts, whose blocks it publishes, over more than two silences
        while time.monotonic() < until and source_of(rt, sim)["reconnects"] == 0:
            chat(c, rt.url, [{"role": "user", "content": text(rng, 80)}])
            time.sleep(0.2)
        assert source_of(rt, sim)["reconnects"] >= 1
        set_faults(sim, kv_drop_batches=0)  # batches dropped since the catch-up show as a gap at the next one
        chat(c, rt.url, [{"role": "user", "content": text(rng, 80)}])
        wait_applied(rt, [sim])
    assert index_of(rt, sim)["event_blocks_held"] == sim_events(sim)["cached_blocks"]


def test_a_replica_serving_only_prompts_it_holds_whole_is_quiet_not_silent(cluster, model_root):
    sim = events_sim(cluster, model_root)
    rt = cluster.router([sim], "--set", "kv_events.silence_s=1")
    wait_precise(rt, [sim])
    prompt = [{"role": "user", "content": text(random.Random(9), 80)}]
    with httpx.Client(timeout=10) as c:
        chat(c, rt.url, prompt)  # its blocks are computed and published once
        wait_applied(rt, [sim])
        until = time.monotonic() + 4  # four silences, each with requests that compute no new block
        while time.monotonic() < until:
            chat(c, rt.url, prompt)
            time.sleep(0.1)
    assert source_of(rt, sim)["reconnects"] == 0
    assert "no batch for" not in rt.log_tail(200_000)


def test_a_mixed_fleet_keeps_the_approximate_index_for_replicas_without_events(cluster, model_root):
    with_events = events_sim(cluster, model_root)
    without = cluster.sim(*FAST, "--root", model_root, "--block-size", "16")
    rt = cluster.router([with_events, without])
    wait_precise(rt, [with_events])
    idx = index_of(rt, without)
    assert idx["mode"] == "approximate" and "lists no publisher" in idx["events"]["reason"]
    prompt = [{"role": "user", "content": text(random.Random(8), 80)}]
    with httpx.Client(timeout=10) as c:
        served = [chat(c, rt.url, prompt) for _ in range(3)]
    assert predicted(served[-1]) == cached(served[-1]) > 0


def test_a_model_keyed_in_byte_mode_cannot_use_events_and_the_log_says_what_to_set(cluster):
    sim = cluster.sim(*FAST, "--block-size", "16", "--kv-events")  # its root is no folder on this host
    rt = cluster.router([sim])
    wait_until(lambda: "byte mode" in (index_of(rt, sim)["events"] or {}).get("reason", ""), 10)
    assert index_of(rt, sim)["mode"] == "approximate"
    wait_until(lambda: "prefix.tokenizers.tiny" in rt.log_tail(), 5)  # written by the logging thread


# -- one consumer per replica for every router on a shared Redis index ------------------------------


def lease_holders(routers, sim):
    out = []
    for rt in routers:
        try:
            if index_of(rt, sim)["events"]["lease_held"]:
                out.append(rt)
        except httpx.HTTPError:
            pass  # a router that was killed
    return out


def test_one_router_consumes_a_replicas_events_and_another_takes_over_when_it_dies(cluster, model_root, shared_url):
    sim = events_sim(cluster, model_root)
    shared = ("--index", shared_url, "--set", "kv_events.lease_s=1")
    routers = [cluster.router([sim], *shared) for _ in range(2)]
    wait_until(lambda: len(lease_holders(routers, sim)) == 1, 10)
    holder = lease_holders(routers, sim)[0]
    other = next(rt for rt in routers if rt is not holder)
    wait_until(lambda: index_of(other, sim)["mode"] == "precise", 5)
    rng = random.Random(9)
    early, during = ([[{"role": "user", "content": text(rng, 80)}] for _ in range(4)] for _ in range(2))
    with httpx.Client(timeout=10) as c:
        for p in early:
            chat(c, sim.url, p)
        wait_applied(holder, [sim])
        for p in early[:2]:  # the other router reads what the holder applied
            r = chat(c, other.url, p)
            assert predicted(r) == cached(r) > 0
        holder.kill()
        killed = time.monotonic()
        for p in during:  # published while nobody consumes
            chat(c, sim.url, p)
        wait_until(lambda: lease_holders([other], sim) == [other], 5)
        took = time.monotonic() - killed
        wait_applied(other, [sim])
        assert took < 2 * 1.0, took
        assert index_of(other, sim)["event_blocks_held"] == sim_events(sim)["cached_blocks"]
        for p in early[2:] + during:
            r = chat(c, other.url, p)
            assert predicted(r) == cached(r) > 0


@pytest.mark.shared
def test_routers_that_join_later_take_their_share_of_the_event_leases(cluster, model_root, redis_proc):
    sims = [events_sim(cluster, model_root) for _ in range(4)]
    shared = ("--index", f"redis://127.0.0.1:{redis_proc.port}/0", "--set", "kv_events.lease_s=1")
    first = cluster.router(sims, *shared)
    wait_until(lambda: all(lease_holders([first], s) == [first] for s in sims), 10)  # alone: every lease
    routers = [first] + [cluster.router(sims, *shared) for _ in range(3)]

    def held():
        return [sum(lease_holders([rt], s) == [rt] for s in sims) for rt in routers]
    wait_until(lambda: held() == [1, 1, 1, 1], 15)
    time.sleep(2.0)  # and it stays so: no lease goes back and forth
    assert held() == [1, 1, 1, 1]
    assert all(len(lease_holders(routers, s)) == 1 for s in sims)


# -- the subscriber against a real ZMQ publisher --------------------------------------------------


def test_garbage_truncated_frames_and_unknown_events_are_counted_and_skipped_and_the_stream_goes_on():
    import asyncio

    import msgspec
    import zmq
    import zmq.asyncio

    from router.kv_events.subscriber import Endpoints, Subscriber

    def message(seq, events, ts=None):
        return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([ts or time.time(), events, 0])]

    removed = [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        applied = []

        async def sink(batch):
            applied.append((batch.seq, len(batch.events)))

        async def reset(kind):
            applied.append(kind)

        sub = Subscriber(ctx, "r", Endpoints(f"tcp://127.0.0.1:{port}"), sink, reset, lambda: False)
        task = asyncio.create_task(sub.run())
        try:
            for _ in range(100):  # a SUB socket joins a moment after it connects
                await pub.send_multipart(message(0, removed, ts=1.0))  # repeats are duplicates: same stamp
                await asyncio.sleep(0.02)
                if applied:
                    break
            for frames in ([b"kv", b"\x00\x01", b"payload"],  # a sequence frame of 2 bytes
                           [b"kv"],  # one frame
                           [b"kv", (1).to_bytes(8, "big"), b"\xc1\xc1\xc1"],  # not msgpack
                           message(1, [{"type": "Mystery", "x": 1}, ["BlockStored", "no", "fields"], *removed]),
                           message(2, removed)):
                await pub.send_multipart(frames)
            for _ in range(100):
                if applied and applied[-1] == (2, 1):
                    break
                await asyncio.sleep(0.02)
            return applied, sub.stats
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.destroy(linger=0)

    applied, stats = asyncio.run(main())
    assert applied == [(0, 1), (1, 1), (2, 1)]
    assert (stats.decode.bad_messages, stats.decode.bad_events, stats.decode.unknown) == (3, 1, {"Mystery": 1})
    assert (stats.gaps, stats.restarts) == (0, 0)
