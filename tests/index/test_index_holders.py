"""Who holds a prefix, found without asking every replica: holders(), on both backends.

The in-process index knows every block's holders; the Redis index those of the blocks at positions 1, 2, 4,
... of the chains routed through it, so blocks known only from a replica's events are named only in process.
"""

import asyncio
import struct

import pytest

from router.index import CLEAR, REMOVE, STORE
from router.index.redis import RedisIndex
from support.indexes import Runner

CHAIN = list(range(1000, 1032))  # 32 blocks


@pytest.fixture
def run_memory():
    return Runner("memory", "holders")


def test_nobody_holds_a_prefix_of_an_empty_index(run):
    async def body(idx):
        return await idx.holders("m", CHAIN, 8)
    assert run(body) == []


def test_the_holders_of_the_longest_prefix_come_first(run):
    async def body(idx):
        await idx.record("m", "short", CHAIN[:4], 1000)
        await idx.record("m", "long", CHAIN[:20], 1000)
        await idx.record("m", "other-prompt", [1, 2, 3], 1000)
        return await idx.holders("m", CHAIN, 8)
    assert run(body) == ["long", "short"]


def test_at_most_limit_holders_are_named(run):
    async def body(idx):
        for i in range(50):
            await idx.record("m", f"r{i}", CHAIN[:8], 1000)
        return await idx.holders("m", CHAIN, 5)
    got = run(body)
    assert len(got) == 5 and len(set(got)) == 5


def test_among_equal_holders_none_is_always_first(run):
    async def body(idx):
        for i in range(8):
            await idx.record("m", f"r{i}", CHAIN[:8], 1000)
        return {(await idx.holders("m", CHAIN, 1))[0] for _ in range(200)}
    assert len(run(body)) == 8


def test_models_are_apart(run):
    async def body(idx):
        await idx.record("a", "r1", CHAIN, 1000)
        return await idx.holders("b", CHAIN, 8)
    assert run(body) == []


def test_a_replica_whose_blocks_were_evicted_no_longer_holds_them(run):
    async def body(idx):
        await idx.record("m", "r1", CHAIN[:8], 8)
        await idx.record("m", "r1", [1, 2, 3, 4, 5, 6, 7, 8], 8)  # capacity 8: the first chain is pushed out
        return await idx.holders("m", CHAIN, 8), await idx.holders("m", [1, 2, 3], 8)
    assert run(body) == ([], ["r1"])


def test_a_withdrawn_record_takes_its_replica_off_the_holders(run):
    async def body(idx):
        await idx.record("m", "r1", CHAIN[:4], 1000)
        receipt = await idx.record("m", "r2", CHAIN[:4], 1000)
        await idx.withdraw(receipt)
        return await idx.holders("m", CHAIN, 8)
    assert run(body) == ["r1"]


def test_a_forgotten_replica_holds_nothing_and_its_bit_goes_to_the_next_replica(run):
    async def body(idx):
        await idx.record("m", "gone", CHAIN[:4], 1000)
        await idx.forget("gone", ["m"])
        before = await idx.holders("m", CHAIN, 8)
        await idx.record("m", "new", CHAIN[:2], 1000)
        return before, await idx.holders("m", CHAIN, 8)
    assert run(body) == ([], ["new"])


def test_replica_events_add_and_remove_holders_in_process(run_memory):
    async def body(idx):
        await idx.apply("m", "exact", [(STORE, h, 1) for h in CHAIN[:6]])
        stored = await idx.holders("m", CHAIN, 8)
        await idx.apply("m", "exact", [(REMOVE, h, 1) for h in CHAIN[:6]])
        removed = await idx.holders("m", CHAIN, 8)
        await idx.apply("m", "exact", [(STORE, h, 1) for h in CHAIN[:6]] + [(CLEAR, 0, 0)])
        return stored, removed, await idx.holders("m", CHAIN, 8)
    assert run_memory(body) == (["exact"], [], [])


def test_a_block_held_in_both_tiers_stays_held_while_either_has_it(run_memory):
    async def body(idx):
        await idx.record("m", "r1", CHAIN[:4], 1000)
        await idx.apply("m", "r1", [(STORE, h, 1) for h in CHAIN[:4]] + [(CLEAR, 0, 0)])
        return await idx.holders("m", CHAIN, 8)
    assert run_memory(body) == ["r1"]


def test_provisional_entries_hold_until_withdrawn(run):
    async def body(idx):
        receipt = await idx.provisional("m", "r1", CHAIN[:4], 4e9)
        held = await idx.holders("m", CHAIN, 8)
        await idx.withdraw(receipt)
        return held, await idx.holders("m", CHAIN, 8)
    assert run(body) == (["r1"], [])


def test_a_replicas_events_that_remove_its_blocks_take_it_off_the_holders(run):
    async def body(idx):
        await idx.provisional("m", "exact", CHAIN[:6], 4e9)
        await idx.apply("m", "exact", [(STORE, h, 1) for h in CHAIN[:6]])
        held = await idx.holders("m", CHAIN, 8)
        await idx.apply("m", "exact", [(REMOVE, h, 1) for h in CHAIN[:6]])
        return held, await idx.holders("m", CHAIN, 8)
    assert run(body) == (["exact"], [])


def test_clearing_a_replicas_cache_takes_it_off_the_holders(run):
    async def body(idx):
        await idx.provisional("m", "exact", CHAIN[:6], 4e9)
        await idx.apply("m", "exact", [(STORE, h, 1) for h in CHAIN[:6]] + [(CLEAR, 0, 0)])
        return await idx.holders("m", CHAIN, 8)
    assert run(body) == []


def test_a_prefix_routed_again_stays_named_in_redis_past_its_first_hour(redis_proc):
    async def main():
        idx = RedisIndex.from_url(f"redis://127.0.0.1:{redis_proc.port}/0", namespace="holders-ttl")
        try:
            await idx.record("m", "r1", CHAIN[:4], 1000)
            key = idx._who("m").encode() + struct.pack(">Q", CHAIN[0])
            await idx.client.execute("EXPIRE", key, 5)  # as if its hour were nearly over
            await idx.record("m", "r1", CHAIN[:4], 1000)  # the same prefix, held already
            return await idx.client.execute("TTL", key)
        finally:
            await idx.close()
    assert asyncio.run(main()) > 3000
