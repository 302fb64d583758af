"""The in-process LRU tier (router/index/lru.py) holds, evicts and takes back exactly what a block-by-block LRU
does, on chains as prompts produce them: a record touches every block of its chain, root last; eviction takes
the least recently used block; a withdrawal takes back the blocks a record added that no later record touched."""

import random
from collections import OrderedDict

import pytest

from router.index.lru import ChainLRU
from router.prefix import chain_bytes


class BlockLRU:
    """The reference: every block's stamp, in an order touched block by block."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, int] = OrderedDict()

    def record(self, chain, stamp):
        kept = 0
        while kept < len(chain) and chain[kept] in self.blocks:
            kept += 1
        for h in reversed(chain):  # the root ends up most recently used
            self.blocks[h] = stamp
            self.blocks.move_to_end(h)
        return kept

    def evict(self, capacity):
        gone = []
        while len(self.blocks) > capacity:
            gone.append(self.blocks.popitem(last=False)[0])
        return gone

    def withdraw(self, chain, kept, stamp):
        gone = []
        for h in chain[kept:]:
            if self.blocks.get(h) == stamp:
                del self.blocks[h]
                gone.append(h)
        return gone


def chains(rng, n):
    """Prompts from a few shared stems and conversations that grow, as block-hash chains."""
    stems = [bytes(rng.randrange(256) for _ in range(rng.randrange(8, 80))) for _ in range(5)]
    talks = [rng.choice(stems) for _ in range(6)]
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            i = rng.randrange(len(talks))
            talks[i] += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
            data = talks[i]
        else:
            data = rng.choice(stems)[: rng.randrange(0, 80)] + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 60)))
        out.append(chain_bytes(data, 8, 1))
    return [c for c in out if c]


@pytest.mark.parametrize("seed", range(20))
def test_records_evictions_and_withdrawals_leave_what_a_block_by_block_lru_leaves(seed):
    rng = random.Random(seed)
    capacity = rng.choice([5, 20, 60, 400])
    tree, reference = ChainLRU(), BlockLRU()
    receipts = []
    for stamp, chain in enumerate(chains(rng, 300), start=1):
        if receipts and rng.random() < 0.15:  # an attempt failed: its record is taken back
            c, kept, s = receipts.pop(rng.randrange(len(receipts)))
            assert sorted(tree.withdraw(c, kept, s)) == sorted(reference.withdraw(c, kept, s))
        kept = tree.record(chain, stamp)
        assert kept == reference.record(chain, stamp)
        receipts.append((chain, kept, stamp))
        assert tree.evict(capacity) == reference.evict(capacity)
        assert set(tree) == set(reference.blocks)
        probe = rng.choice(receipts)[0]
        assert tree.leading(probe) == next((i for i, h in enumerate(probe) if h not in reference.blocks), len(probe))


def test_blocks_whose_hashes_collide_never_keep_it_over_its_capacity():
    tree = ChainLRU()
    tree.record([1, 2, 3], 1)
    tree.record([7, 2], 2)  # block 2 again, after another parent: only a 64-bit collision does that
    tree.record([8, 9, 8], 3)  # and a loop
    for capacity in (4, 2, 0):
        tree.evict(capacity)
        assert len(tree) <= capacity


def test_a_full_garbage_collection_does_not_walk_the_blocks():
    import gc
    tree = ChainLRU()
    for stamp in range(1, 50):
        tree.record(list(range(stamp * 1000, stamp * 1000 + 200)), stamp)
    gc.collect()
    assert not any(gc.is_tracked(block) for block in tree._blocks.values())
