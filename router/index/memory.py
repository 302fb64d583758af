"""The in-process prefix index: one LRU of block hashes per (model, replica)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from . import Match, Probe, Receipt


class MemoryIndex:
    name = "memory"

    def __init__(self) -> None:
        # block hash -> stamp of the record that touched it last, least recently used first
        self._lru: dict[tuple[str, str], OrderedDict[int, int]] = {}
        self._stamp = 0

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> Probe:
        out = {}
        lru = self._lru
        for r in replicas:
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
        blocks = self._lru.get((receipt.model, receipt.replica))
        if not blocks:
            return
        for h in receipt.chain[receipt.kept:]:
            if blocks.get(h) == receipt.stamp:
                del blocks[h]

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        for key in [k for k in self._lru if k[1] == replica]:
            del self._lru[key]

    async def size(self, model: str, replica: str) -> int:
        return len(self._lru.get((model, replica), ()))

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self._lru.clear()
