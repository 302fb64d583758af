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
from typing import Iterator, Sequence


class _Block:
    __slots__ = ("parent", "children", "time", "added")

    def __init__(self, parent: int | None, added: int) -> None:
        self.parent = parent  # the block before it, None for a chain's first
        self.children = 0  # blocks recorded after it (it is a leaf at 0)
        self.time = 0  # latest record that ended here, or went on through a child since gone (0: none yet)
        self.added = added  # the record that added it (what a withdrawal may take back)


class ChainLRU:
    """Blocks recorded for one (model, replica), least recently used out first."""

    __slots__ = ("_blocks", "_leaves", "_seq")

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
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
        parent = chain[kept - 1] if kept else None
        for i in range(kept, len(chain)):
            h = chain[i]
            if parent is not None:
                blocks[parent].children += 1
            blocks[h] = _Block(parent, stamp)
            parent = h
        last = blocks[chain[-1]]
        last.time = stamp
        if not last.children:
            self._push(last.time, chain[-1])
        return kept

    def evict(self, capacity: int) -> list[int]:
        """Drop the least recently used blocks until at most ``capacity`` are held; returns them."""
        blocks = self._blocks
        gone: list[int] = []
        leaves = self._leaves
        while len(blocks) > capacity and leaves:
            time, _, h = heapq.heappop(leaves)
            block = blocks.get(h)
            if block is None or block.children or block.time != time:
                continue  # stale
            del blocks[h]
            gone.append(h)
            self._left(block)
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
            if block.added != stamp or block.children or block.time > stamp:
                last = h
                break
            del blocks[h]
            gone.append(h)
            parent = blocks.get(block.parent) if block.parent is not None else None
            if parent is not None:
                parent.children -= 1
                if not parent.children:
                    self._push(parent.time, block.parent)  # a leaf again
        block = blocks.get(last) if last is not None else None
        if block is not None and block.time < stamp:
            block.time = stamp
            if not block.children:
                self._push(stamp, last)  # its entry at the older time is stale now
        return gone

    def _left(self, block: _Block) -> None:
        """``block`` was evicted: its parent takes its time if later, and is a leaf when it was the last child."""
        if block.parent is None:
            return
        parent = self._blocks[block.parent]
        parent.children -= 1
        if block.time > parent.time:
            parent.time = block.time
        if not parent.children:
            self._push(parent.time, block.parent)

    def _push(self, time: int, h: int) -> None:
        leaves = self._leaves
        if len(leaves) > 2 * len(self._blocks) + 1024:  # mostly stale: rebuilt from the leaves there are
            leaves[:] = [(b.time, i, k) for i, (k, b) in enumerate(self._blocks.items()) if not b.children]
            heapq.heapify(leaves)
            self._seq = len(leaves)
        self._seq += 1
        heapq.heappush(leaves, (time, self._seq, h))
