"""The in-process prefix index: one LRU of block hashes per (model, replica), and the exact tier."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Collection, Sequence

from . import CLEAR, PROVISIONAL_FLOOR, REMOVE, STORE, Match, Op, Probe, Receipt

# Exact tier: block hash -> medium mask, or the expiry of a provisional entry (see router.index)
Exact = dict[int, float]


class MemoryIndex:
    name = "memory"

    def __init__(self) -> None:
        # block hash -> stamp of the record that touched it last, least recently used first
        self._lru: dict[tuple[str, str], OrderedDict[int, int]] = {}
        self._stamp = 0
        self._exact: dict[tuple[str, str], Exact] = {}
        # provisional entries by expiry, oldest first, so expired ones are swept without a scan
        self._expiries: dict[tuple[str, str], deque[tuple[float, Sequence[int]]]] = {}

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str],
                    exact: Collection[str] = ()) -> Probe:
        out = {}
        lru = self._lru
        for r in replicas:
            if exact and r in exact:
                out[r] = self._probe_exact(self._exact.get((model, r)), chain)
                continue
            blocks = lru.get((model, r))
            n = 0
            if blocks:
                for h in chain:  # stops at the first miss: work grows with the match, not the prompt
                    if h not in blocks:
                        break
                    n += 1
                out[r] = Match(n, len(blocks))
            else:
                out[r] = Match(0, 0)
        return Probe(out)

    @staticmethod
    def _probe_exact(blocks: Exact | None, chain: Sequence[int]) -> Match:
        if not blocks:
            return Match(0, 0)
        now = time.time()
        n = slow = 0
        for h in chain:
            v = blocks.get(h)
            if v is None:
                break
            if v >= PROVISIONAL_FLOOR:
                if v < now:
                    break
            elif not int(v) & 1:  # held only on the slower medium
                slow += 1
            n += 1
        return Match(n, len(blocks), slow)

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        if not chain:
            return None
        blocks = self._lru.get((model, replica))
        if blocks is None:
            blocks = self._lru[(model, replica)] = OrderedDict()
        kept = 0
        for h in chain:
            if h not in blocks:
                break
            kept += 1
        self._stamp += 1
        stamp = self._stamp
        for h in reversed(chain):  # the root ends up most recently used
            blocks[h] = stamp
            blocks.move_to_end(h)
        while len(blocks) > capacity:
            blocks.popitem(last=False)
        return Receipt(model, replica, chain, kept, stamp)

    async def withdraw(self, receipt: Receipt) -> None:
        if receipt.exact:
            blocks = self._exact.get((receipt.model, receipt.replica))
            if blocks:
                self._drop_provisional(blocks, receipt.chain, receipt.stamp)
            return
        lru = self._lru.get((receipt.model, receipt.replica))
        if not lru:
            return
        for h in receipt.chain[receipt.kept:]:
            if lru.get(h) == receipt.stamp:
                del lru[h]

    # -- the exact tier ----------------------------------------------------------------------

    async def provisional(self, model: str, replica: str, chain: Sequence[int], expires: float) -> Receipt | None:
        if not chain:
            return None
        key = (model, replica)
        blocks = self._exact.get(key)
        if blocks is None:
            blocks = self._exact[key] = {}
        self._sweep(key, blocks)
        now = time.time()
        kept = 0
        for h in chain:
            v = blocks.get(h)
            if v is None or PROVISIONAL_FLOOR <= v < now:
                break
            kept += 1
        added = []
        for h in chain[kept:]:
            v = blocks.get(h)
            if v is None or v >= PROVISIONAL_FLOOR:  # never over a confirmed block; a later expiry wins
                blocks[h] = expires
                added.append(h)
        if not added:
            return None
        self._expiries.setdefault(key, deque()).append((expires, added))
        return Receipt(model, replica, chain, kept, expires, exact=True)

    def _sweep(self, key: tuple[str, str], blocks: Exact) -> None:
        queue = self._expiries.get(key)
        if not queue:
            return
        now = time.time()
        while queue and queue[0][0] < now:
            expires, chain = queue.popleft()
            self._drop_provisional(blocks, chain, expires)

    @staticmethod
    def _drop_provisional(blocks: Exact, chain: Sequence[int], expires: float) -> None:
        for h in chain:
            if blocks.get(h) == expires:
                del blocks[h]

    async def apply(self, model: str, replica: str, ops: Sequence[Op]) -> None:
        key = (model, replica)
        blocks = self._exact.get(key)
        if blocks is None:
            blocks = self._exact[key] = {}
        get = blocks.get
        for op, h, bit in ops:
            if op == STORE:
                v = get(h)
                blocks[h] = (int(v) | bit) if v is not None and v < PROVISIONAL_FLOOR else bit
            elif op == REMOVE:
                v = get(h)
                if v is not None:
                    left = int(v) & ~bit if v < PROVISIONAL_FLOOR else 0
                    if left:
                        blocks[h] = left
                    else:
                        del blocks[h]
            elif op == CLEAR:  # confirmed blocks go; provisional ones stay until they expire
                for h2 in [h2 for h2, v in blocks.items() if v < PROVISIONAL_FLOOR]:
                    del blocks[h2]

    # -- both tiers --------------------------------------------------------------------------

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        for table in (self._lru, self._exact, self._expiries):
            for key in [k for k in table if k[1] == replica]:
                del table[key]

    async def size(self, model: str, replica: str) -> int:
        key = (model, replica)
        return len(self._lru.get(key, ())) + len(self._exact.get(key, ()))

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self._lru.clear()
        self._exact.clear()
        self._expiries.clear()
