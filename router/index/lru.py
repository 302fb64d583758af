"""One replica's recorded blocks of one model (the in-process index's LRU tier), as a tree of chains.

A block's hash stands for its whole prefix, so the blocks recorded of every chain form a tree: each block has
one parent (the block before it in any chain that holds it). The least recently used block is always a leaf:
a record touches every block of its chain, so a block was used at least as recently as any block after it.
So only leaves need an order: a record sets the time of its chain's last block only, and a block whose last
child leaves takes the latest time of its children (the last record that went through it). Recording a chain
costs what it adds, not its length: a conversation's 20th turn touches its new blocks, not the 2,500 before.

Eviction takes the leaf with the oldest time: a chain's tail goes before its root, as vLLM frees a request's
blocks tail first. Ties cannot happen across records (one time per record).
"""

from __future__ import annotations

import heapq
from typing import Iterator, Optional, Sequence


# A block: (parent, children, time, added), a tuple of ints that the garbage collector stops tracking (a list per
# block made a full collection over a million blocks take 79 ms instead of 8). parent: the block before it (None for
# a chain's first); children: blocks recorded after it (a leaf at 0); time: the latest record that ended there, or
# went on through a child since evicted (0: none yet); added: the record that added it (what a withdrawal may take
# back).
Block = tuple[Optional[int], int, int, int]
_PARENT, _CHILDREN, _TIME, _ADDED = range(4)


class ChainLRU:
    """Blocks recorded for one (model, replica), least recently used out first."""

    __slots__ = ("_blocks", "_leaves", "_seq")

    def __init__(self) -> None:
        self._blocks: dict[int, Block] = {}
        # (time, seq, hash) of leaves, oldest first; an entry is stale where the block has gone, has children
        # now, or a newer time (checked when it comes up, and dropped)
        self._leaves: list[tuple[int, int, int]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)

    def leading(self, chain: Sequence[int]) -> int:
        """How many of ``chain``'s first blocks are held: they form a prefix of it (a tree holds a block only with
        its parent), so the count is found by galloping, then bisecting, O(log m) lookups for an m-block match."""
        blocks = self._blocks
        n = len(chain)
        lo, probe = 0, 1  # block lo (counted from 1) is held, 0: none looked at
        while probe <= n and chain[probe - 1] in blocks:
            lo = probe
            probe *= 2
        hi = probe if probe <= n else n + 1  # block hi is not held (n + 1: past the end)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if chain[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid
        return lo

    def record(self, chain: Sequence[int], stamp: int) -> int:
        """Record ``chain`` as used now (``stamp``: later than every earlier record's); returns how many of its
        first blocks were held before."""
        blocks = self._blocks
        kept = self.leading(chain)
        last = chain[-1]
        if kept < len(chain):
            if kept:
                self._children(chain[kept - 1], 1)
            # each new block the parent of the next (one child), the last a leaf
            blocks.update(zip(chain[kept:], [(p, 1, 0, stamp) for p in
                                             (chain[kept - 1:-1] if kept else [None, *chain[:-1]])]))
            blocks[last] = (blocks[last][_PARENT], 0, stamp, stamp)
        else:
            parent, children, _, added = blocks[last]
            blocks[last] = (parent, children, stamp, added)
        if not blocks[last][_CHILDREN]:
            self._push(stamp, last)
        return kept

    def evict(self, capacity: int) -> list[int]:
        """Drop the least recently used blocks until at most ``capacity`` are held; returns them."""
        blocks = self._blocks
        gone: list[int] = []
        leaves = self._leaves
        while len(blocks) > capacity:
            if not leaves:  # only where 64-bit hashes collided (a block recorded under two parents)
                self._rebuild(recount=True)
                if not leaves:  # they made a loop: no leaf at all; dropped as they come
                    while len(blocks) > capacity:
                        gone.append(blocks.popitem()[0])
                    break
            time, _, h = heapq.heappop(leaves)
            block = blocks.get(h)
            if block is None or block[_CHILDREN] or block[_TIME] != time:
                continue  # stale
            while True:  # up the chain while each parent is then the oldest leaf (a chain's tail, mostly)
                del blocks[h]
                gone.append(h)
                h = block[_PARENT]
                above = blocks.get(h) if h is not None else None
                if above is None:  # a chain's first (or, after a hash collision, one gone already)
                    break
                block = above = (above[_PARENT], above[_CHILDREN] - 1, max(above[_TIME], time), above[_ADDED])
                blocks[h] = above
                if above[_CHILDREN] > 0:
                    break
                if len(blocks) <= capacity or (leaves and leaves[0][0] < above[_TIME]):
                    self._push(above[_TIME], h)  # a leaf now, not the oldest
                    break
                time = above[_TIME]
        return gone

    def withdraw(self, chain: Sequence[int], kept: int, stamp: int) -> list[int]:
        """Take back the blocks the record ``stamp`` of ``chain`` added (past its first ``kept``), from its end,
        up to the first that a later record needs (it has children, or a later time) or did not add; returns them.
        The blocks before stay as recently used as that record made them."""
        blocks = self._blocks
        gone: list[int] = []
        last = chain[kept - 1] if kept else None  # the chain's deepest block left
        for i in range(len(chain) - 1, kept - 1, -1):
            h = chain[i]
            block = blocks.get(h)
            if block is None:
                continue  # evicted since
            if block[_ADDED] != stamp or block[_CHILDREN] or block[_TIME] > stamp:
                last = h
                break
            del blocks[h]
            gone.append(h)
            if block[_PARENT] is not None and block[_PARENT] in blocks and self._children(block[_PARENT], -1) <= 0:
                self._push(blocks[block[_PARENT]][_TIME], block[_PARENT])  # a leaf again
        block = blocks.get(last) if last is not None else None
        if block is not None and block[_TIME] < stamp:
            blocks[last] = (block[_PARENT], block[_CHILDREN], stamp, block[_ADDED])
            if not block[_CHILDREN]:
                self._push(stamp, last)  # its entry at the older time is stale now
        return gone

    def _children(self, h: int, change: int) -> int:
        """Add ``change`` to block ``h``'s children; returns how many it has now."""
        parent, children, time, added = self._blocks[h]
        self._blocks[h] = (parent, children + change, time, added)
        return children + change

    def _push(self, time: int, h: int) -> None:
        if len(self._leaves) > 2 * len(self._blocks) + 1024:  # mostly stale: rebuilt from the leaves there are
            self._rebuild()
        self._seq += 1
        heapq.heappush(self._leaves, (time, self._seq, h))

    def _rebuild(self, recount: bool = False) -> None:
        """The leaves' order made anew from the blocks; with ``recount``, every block's children counted again
        from the parents they name (what a hash collision may have left wrong)."""
        blocks = self._blocks
        if recount:
            counts: dict[int, int] = {}
            for parent, _, _, _ in blocks.values():
                if parent is not None and parent in blocks:
                    counts[parent] = counts.get(parent, 0) + 1
            for h, (parent, _, time, added) in blocks.items():
                blocks[h] = (parent, counts.get(h, 0), time, added)
        self._leaves[:] = [(b[_TIME], i, k) for i, (k, b) in enumerate(blocks.items()) if not b[_CHILDREN]]
        heapq.heapify(self._leaves)
        self._seq = len(self._leaves)
