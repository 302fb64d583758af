"""One contract, both backends: the in-process index and the Redis index (a real redis-server)."""

import asyncio
import time

import pytest



async def lookup(index, model, chain, replicas):
    """Leading blocks of ``chain`` held per replica."""
    return {r: m.blocks for r, m in (await index.probe(model, chain, replicas)).matches.items()}


def test_empty_index_matches_nothing(run):
    async def go(index):
        return await lookup(index, "m", [1, 2, 3], ["a", "b"])
    assert run(go) == {"a": 0, "b": 0}


def test_lookup_counts_leading_blocks_per_replica(run):
    async def go(index):
        await index.record("m", "a", [1, 2, 3, 4], 100)
        await index.record("m", "b", [1, 2], 100)
        return await lookup(index, "m", [1, 2, 3, 9, 4], ["a", "b", "c"])
    assert run(go) == {"a": 3, "b": 2, "c": 0}


def test_probe_gives_the_match_and_the_blocks_held_per_replica(run):
    async def go(index):
        await index.record("m", "a", [1, 2, 3, 4], 100)
        await index.record("m", "a", [7, 8], 100)
        await index.record("m", "b", [1], 100)
        def pairs(probe):
            return {r: (m.blocks, m.held) for r, m in probe.matches.items()}
        return (pairs(await index.probe("m", [1, 2, 5], ["a", "b", "c"])),
                pairs(await index.probe("m", [], ["a"])))
    assert run(go) == ({"a": (2, 6), "b": (1, 1), "c": (0, 0)}, {"a": (0, 6)})


def test_models_are_separate(run):
    async def go(index):
        await index.record("m1", "a", [1, 2], 100)
        return await lookup(index, "m2", [1, 2], ["a"])
    assert run(go) == {"a": 0}


def test_capacity_evicts_least_recently_used_tail_first(run):
    async def go(index):
        await index.record("m", "a", [1, 2, 3, 4], 4)
        await index.record("m", "a", [5, 6], 4)  # 2 blocks over: the oldest go, tail (4, 3) before root
        first = await lookup(index, "m", [1, 2, 3, 4], ["a"])
        second = await lookup(index, "m", [5, 6], ["a"])
        return first, second, await index.size("m", "a")
    assert run(go) == ({"a": 2}, {"a": 2}, 4)


def test_recording_again_refreshes_a_chain(run):
    async def go(index):
        await index.record("m", "a", [1, 2], 3)
        await index.record("m", "a", [7], 3)
        await index.record("m", "a", [1, 2], 3)  # refreshed: 7 is now the oldest
        await index.record("m", "a", [8], 3)
        return await lookup(index, "m", [1, 2], ["a"]), await lookup(index, "m", [7], ["a"])
    assert run(go) == ({"a": 2}, {"a": 0})


def test_forget_drops_only_that_replica(run):
    async def go(index):
        await index.record("m", "a", [1, 2], 10)
        await index.record("m", "b", [1, 2], 10)
        await index.forget("a", ["m"])
        return await lookup(index, "m", [1, 2], ["a", "b"])
    assert run(go) == {"a": 0, "b": 2}


def test_long_chains(run):
    chain = list(range(10_000, 12_000))
    async def go(index):
        await index.record("m", "a", chain, 5000)
        return await lookup(index, "m", chain + [1], ["a"]), await index.size("m", "a")
    assert run(go) == ({"a": 2000}, 2000)


def test_full_64_bit_hashes(run):
    chain = [2**64 - 1, 2**63, 0, 12345678901234567890]
    async def go(index):
        await index.record("m", "a", chain, 10)
        return await lookup(index, "m", chain, ["a"])
    assert run(go) == {"a": 4}


def real_chains(rng, n):
    """Hash chains as prompts produce them: a block's hash stands for its whole prefix."""
    from router.prefix import chain_bytes
    stems = [bytes(rng.randrange(256) for _ in range(64)) for _ in range(4)]
    out = []
    for _ in range(n):
        data = rng.choice(stems)[: rng.randrange(16, 65)] + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 96)))
        out.append(chain_bytes(data, 8, 1))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_held_blocks_of_any_chain_form_a_prefix_and_lookups_find_it(run, seed):
    """Random records with eviction; each lookup must equal a block-by-block count of the leading held blocks."""
    import random
    rng = random.Random(seed)
    chains = real_chains(rng, 40)

    async def go(index):
        for c in chains[:30]:
            await index.record("m", rng.choice("ab"), c, 25)
        mismatches = []
        for c in chains:
            found = await lookup(index, "m", c, ["a", "b"])
            for r in "ab":
                held = [(await lookup(index, "m", [h], [r]))[r] == 1 for h in c]
                leading = held.index(False) if False in held else len(held)
                if held[leading:].count(True) or found[r] != leading:
                    mismatches.append((r, held, found[r]))
        return mismatches
    assert run(go) == []


def test_withdrawing_a_record_removes_the_blocks_it_added(run):
    async def go(index):
        await index.record("m", "a", [1, 2], 100)
        receipt = await index.record("m", "a", [1, 2, 3, 4], 100)
        await index.withdraw(receipt)
        return await lookup(index, "m", [1, 2, 3, 4], ["a"]), await index.size("m", "a")
    assert run(go) == ({"a": 2}, 2)


def test_withdrawing_keeps_blocks_a_later_record_touched(run):
    async def go(index):
        first = await index.record("m", "a", [1, 2, 3], 100)
        await index.record("m", "a", [1, 2, 3, 4], 100)
        await index.withdraw(first)
        return await lookup(index, "m", [1, 2, 3, 4], ["a"])
    assert run(go) == {"a": 4}


def test_withdrawing_one_replica_leaves_the_others(run):
    async def go(index):
        await index.record("m", "b", [1, 2, 3], 100)
        receipt = await index.record("m", "a", [1, 2, 3], 100)
        await index.withdraw(receipt)
        return await lookup(index, "m", [1, 2, 3], ["a", "b"])
    assert run(go) == {"a": 0, "b": 3}


# -- the exact tier (replicas whose KV-cache events feed the index) ------------------------------

from router.index import CLEAR, GPU, REMOVE, SLOW, STORE  # noqa: E402


async def exact(index, chain, replica="a", model="m"):
    m = (await index.probe(model, chain, [replica], exact={replica})).matches[replica]
    return m.blocks, m.slow


def test_stored_blocks_match_in_order_and_removed_ones_end_the_match(run):
    async def go(index):
        await index.apply("m", "a", [(STORE, h, GPU) for h in (1, 2, 3, 4)])
        before = await exact(index, [1, 2, 3, 4, 9])
        await index.apply("m", "a", [(REMOVE, 3, GPU)])
        return before, await exact(index, [1, 2, 3, 4])
    assert run(go) == ((4, 0), (2, 0))


def test_a_block_only_on_the_slower_medium_counts_as_slow_until_the_device_holds_it_too(run):
    async def go(index):
        await index.apply("m", "a", [(STORE, 1, GPU), (STORE, 2, SLOW)])
        slow = await exact(index, [1, 2])
        await index.apply("m", "a", [(STORE, 2, GPU)])
        both = await exact(index, [1, 2])
        await index.apply("m", "a", [(REMOVE, 2, GPU)])
        return slow, both, await exact(index, [1, 2])
    assert run(go) == ((2, 1), (2, 0), (2, 1))


def test_provisional_entries_match_until_they_expire_unless_an_event_confirms_them(run):
    async def go(index):
        now = time.time()
        await index.provisional("m", "a", [1, 2, 3], now + 0.3)
        await index.apply("m", "a", [(STORE, 1, GPU)])
        fresh = await exact(index, [1, 2, 3])
        await asyncio.sleep(0.4)
        return fresh, await exact(index, [1, 2, 3])
    assert run(go) == ((3, 0), (1, 0))


def test_clearing_drops_confirmed_blocks_and_keeps_provisional_ones(run):
    async def go(index):
        await index.apply("m", "a", [(STORE, 1, GPU), (STORE, 2, GPU)])
        await index.provisional("m", "b", [1, 2], time.time() + 5)
        await index.apply("m", "b", [(STORE, 1, GPU), (CLEAR, 0, 0)])
        await index.apply("m", "a", [(CLEAR, 0, 0)])
        return await exact(index, [1, 2], "a"), await exact(index, [1], "b"), await exact(index, [2], "b")
    assert run(go) == ((0, 0), (0, 0), (1, 0))


def test_withdrawing_a_decision_takes_back_its_provisional_entries_but_not_confirmed_blocks(run):
    async def go(index):
        await index.apply("m", "a", [(STORE, 1, GPU)])
        receipt = await index.provisional("m", "a", [1, 2, 3], time.time() + 5)
        await index.apply("m", "a", [(STORE, 2, GPU)])
        await index.withdraw(receipt)
        return receipt.kept, await exact(index, [1, 2, 3])
    assert run(go) == (1, (2, 0))


def test_the_exact_and_recorded_tiers_of_a_replica_are_apart_and_forget_drops_both(run):
    async def go(index):
        await index.record("m", "a", [1, 2], 100)
        recorded_only = await exact(index, [1, 2])
        await index.apply("m", "a", [(STORE, 5, GPU)])
        plain = await lookup(index, "m", [1, 2], ["a"])
        await index.forget("a", ["m"])
        return recorded_only, plain, await exact(index, [5]), await lookup(index, "m", [1, 2], ["a"])
    assert run(go) == ((0, 0), {"a": 2}, (0, 0), {"a": 0})
