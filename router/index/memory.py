"""The in-process prefix index: one LRU of block hashes per (model, replica)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class MemoryIndex:
    name = "memory"

    def __init__(self) -> None:
        self._lru: dict[tuple[str, str], OrderedDict[int, None]] = {}

    async def lookup(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        return self.lookup_now(model, chain, replicas)

    def lookup_now(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        out = {}
        for r in replicas:
            blocks = self._lru.get((model, r))
            n = 0
            if blocks:
                for h in chain:  # stops at the first miss: work grows with the match, not the prompt
                    if h not in blocks:
                        break
                    n += 1
            out[r] = n
        return out

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> dict[str, tuple[int, int]]:
        return self.probe_now(model, chain, replicas)

    def probe_now(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> dict[str, tuple[int, int]]:
        found = self.lookup_now(model, chain, replicas)
        return {r: (found[r], self.size_now(model, r)) for r in replicas}

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> None:
        self.record_now(model, replica, chain, capacity)

    def record_now(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> None:
        blocks = self._lru.get((model, replica))
        if blocks is None:
            blocks = self._lru[(model, replica)] = OrderedDict()
        for h in reversed(chain):  # the root ends up most recently used
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > capacity:
            blocks.popitem(last=False)

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        for key in [k for k in self._lru if k[1] == replica]:
            del self._lru[key]

    async def size(self, model: str, replica: str) -> int:
        return self.size_now(model, replica)

    def size_now(self, model: str, replica: str) -> int:
        return len(self._lru.get((model, replica), ()))

    async def warm(self) -> None:
        pass

    async def close(self) -> None:
        self._lru.clear()
