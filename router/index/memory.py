"""The in-process prefix index: one LRU of block hashes per (model, replica) (:mod:`router.index.lru`), and the
exact tier.

Beside them, per model, the replicas holding each block as a bit mask (one bit per replica), so that
:meth:`MemoryIndex.holders` finds the replicas that hold a prompt's prefix without asking each replica
of the fleet.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Collection, Sequence

from . import CLEAR, PROVISIONAL_FLOOR, REMOVE, STORE, Match, Op, Probe, Receipt
from .lru import ChainLRU

# Exact tier: block hash -> medium mask, or the expiry of a provisional entry (see router.index)
Exact = dict[int, float]


class MemoryIndex:
    name = "memory"

    def __init__(self) -> None:
        # the LRU tier: the blocks recorded per (model, replica), least recently used out first
        self._lru: dict[tuple[str, str], ChainLRU] = {}
        self._stamp = 0
        self._exact: dict[tuple[str, str], Exact] = {}
        # provisional entries by expiry, oldest first, so expired ones are swept without a scan
        self._expiries: dict[tuple[str, str], deque[tuple[float, Sequence[int]]]] = {}
        # per model: block hash -> bit mask of the replicas that hold it in either tier
        self._who: dict[str, dict[int, int]] = {}
        self._bit: dict[str, int] = {}  # replica -> its bit number
        self._names: list[str | None] = []  # bit number -> replica (None: free)
        self._free_bits: list[int] = []
        self._rng = random.Random()

    # -- who holds what ----------------------------------------------------------------------

    def _bit_of(self, replica: str) -> int:
        b = self._bit.get(replica)
        if b is None:
            if self._free_bits:
                b = self._free_bits.pop()
                self._names[b] = replica
            else:
                b = len(self._names)
                self._names.append(replica)
            self._bit[replica] = b
        return b

    def _held(self, model: str, replica: str, hashes: Sequence[int]) -> None:
        who = self._who.get(model)
        if who is None:
            who = self._who[model] = {}
        bit = 1 << self._bit_of(replica)
        get = who.get
        for h in hashes:
            who[h] = get(h, 0) | bit

    def _dropped(self, model: str, replica: str, hashes: Sequence[int]) -> None:
        """``replica`` no longer holds ``hashes`` in one tier: clear its bit where the other tier lacks them."""
        who = self._who.get(model)
        b = self._bit.get(replica)
        if not who or b is None:
            return
        bit = 1 << b
        lru = self._lru.get((model, replica)) or {}
        exact = self._exact.get((model, replica)) or {}
        for h in hashes:
            m = who.get(h)
            if m is None or not m & bit or h in lru or h in exact:
                continue
            m &= ~bit
            if m:
                who[h] = m
            else:
                del who[h]

    async def holders(self, model: str, chain: Sequence[int], limit: int) -> list[str] | None:
        """Up to ``limit`` replicas that hold a prefix of ``chain``, those of the longest prefix first."""
        who = self._who.get(model)
        if not who or not chain or limit <= 0:
            return []
        # the blocks held of a chain, over all replicas, form (about) a prefix of it: gallop, then bisect
        n = len(chain)
        if not who.get(chain[0]):
            return []
        lo, probe = 0, 1  # block lo is held; find the first that is not
        while probe < n and who.get(chain[probe]):
            lo, probe = probe, probe * 2
        hi = min(probe, n)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if who.get(chain[mid]):
                lo = mid
            else:
                hi = mid
        # the holders of the deepest block, then of ever shorter prefixes (halving), each level's in an
        # order that starts at random, so no replica is always first among equals
        out: list[str] = []
        seen = 0
        names = self._names
        pos = lo
        while True:
            mask = who.get(chain[pos], 0) & ~seen
            if mask:
                seen |= mask
                width = mask.bit_length()
                r = self._rng.randrange(width)
                for part, base in ((mask >> r, r), (mask & ((1 << r) - 1), 0)):
                    while part:
                        low = part & -part
                        name = names[base + low.bit_length() - 1]
                        part ^= low
                        if name is not None:
                            out.append(name)
                            if len(out) >= limit:
                                return out
            if pos == 0:
                return out
            pos //= 2

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str],
                    exact: Collection[str] = ()) -> Probe:
        out = {}
        lru = self._lru
        for r in replicas:
            if exact and r in exact:
                out[r] = self._probe_exact(self._exact.get((model, r)), chain)
                continue
            blocks = lru.get((model, r))
            if blocks:  # O(log m) lookups for an m-block match
                out[r] = Match(blocks.leading(chain), len(blocks))
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
            blocks = self._lru[(model, replica)] = ChainLRU()
        self._stamp += 1
        stamp = self._stamp
        kept = blocks.record(chain, stamp)
        self._held(model, replica, chain[kept:])
        if len(blocks) > capacity:
            self._dropped(model, replica, blocks.evict(capacity))
        return Receipt(model, replica, chain, kept, stamp)

    async def withdraw(self, receipt: Receipt) -> None:
        if receipt.exact:
            blocks = self._exact.get((receipt.model, receipt.replica))
            if blocks:
                self._dropped(receipt.model, receipt.replica,
                              self._drop_provisional(blocks, receipt.chain, receipt.stamp))
            return
        lru = self._lru.get((receipt.model, receipt.replica))
        if not lru:
            return
        self._dropped(receipt.model, receipt.replica, lru.withdraw(receipt.chain, receipt.kept, receipt.stamp))

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
        self._held(model, replica, added)
        self._expiries.setdefault(key, deque()).append((expires, added))
        return Receipt(model, replica, chain, kept, expires, exact=True)

    def _sweep(self, key: tuple[str, str], blocks: Exact) -> None:
        queue = self._expiries.get(key)
        if not queue:
            return
        now = time.time()
        while queue and queue[0][0] < now:
            expires, chain = queue.popleft()
            self._dropped(key[0], key[1], self._drop_provisional(blocks, chain, expires))

    @staticmethod
    def _drop_provisional(blocks: Exact, chain: Sequence[int], expires: float) -> list[int]:
        """Drop the entries of ``chain`` still provisional until ``expires``; returns their hashes."""
        gone = []
        for h in chain:
            if blocks.get(h) == expires:
                del blocks[h]
                gone.append(h)
        return gone

    async def apply(self, model: str, replica: str, ops: Sequence[Op]) -> None:
        key = (model, replica)
        blocks = self._exact.get(key)
        if blocks is None:
            blocks = self._exact[key] = {}
        get = blocks.get
        stored: list[int] = []
        gone: list[int] = []
        for op, h, bit in ops:
            if op == STORE:
                v = get(h)
                blocks[h] = (int(v) | bit) if v is not None and v < PROVISIONAL_FLOOR else bit
                if v is None:
                    stored.append(h)
            elif op == REMOVE:
                v = get(h)
                if v is not None:
                    left = int(v) & ~bit if v < PROVISIONAL_FLOOR else 0
                    if left:
                        blocks[h] = left
                    else:
                        del blocks[h]
                        gone.append(h)
            elif op == CLEAR:  # confirmed blocks go; provisional ones stay until they expire
                cleared = [h2 for h2, v in blocks.items() if v < PROVISIONAL_FLOOR]
                for h2 in cleared:
                    del blocks[h2]
                gone.extend(cleared)
        if stored:
            self._held(model, replica, stored)
        if gone:  # a block stored again after it went is held: _dropped reads the table as it is now
            self._dropped(model, replica, gone)

    # -- both tiers --------------------------------------------------------------------------

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        held: dict[str, list[int]] = {}
        for table in (self._lru, self._exact):
            for key in [k for k in table if k[1] == replica]:
                held.setdefault(key[0], []).extend(table[key])
        for table in (self._lru, self._exact, self._expiries):
            for key in [k for k in table if k[1] == replica]:
                del table[key]
        for model, hashes in held.items():
            self._dropped(model, replica, hashes)
        b = self._bit.pop(replica, None)
        if b is not None:  # no block carries its bit any more: the next replica may take it
            self._names[b] = None
            self._free_bits.append(b)

    async def size(self, model: str, replica: str) -> int:
        key = (model, replica)
        return len(self._lru.get(key, ())) + len(self._exact.get(key, ()))

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self._lru.clear()
        self._exact.clear()
        self._expiries.clear()
        self._who.clear()
