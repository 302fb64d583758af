"""The prefix index: which replica holds which prefix blocks, per model.

Two backends with one contract (tests/test_index_contract.py runs against both):

- ``memory`` (default): in this process;
- ``redis``: shared by every router instance pointed at the same Redis.

Per (model, replica) the index keeps at most ``capacity`` blocks (the replica's
``num_gpu_blocks``), least recently used out first, so it forgets roughly what the replica
evicts. Within one recorded chain the root block counts as the most recently used, as vLLM
frees a request's blocks tail first. Only 64-bit block hashes are stored, never prompt text.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class PrefixIndex(Protocol):
    name: str

    async def lookup(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """For each replica, how many leading blocks of ``chain`` it holds."""
        ...

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> dict[str, tuple[int, int]]:
        """For each replica: (leading blocks of ``chain`` it holds, blocks the index holds for it in all)."""
        ...

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> None:
        """``replica`` now holds the blocks of ``chain`` (most recently used first: the root)."""
        ...

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        """Drop everything the index holds for ``replica`` (it restarted or was removed)."""
        ...

    async def size(self, model: str, replica: str) -> int:
        ...

    async def warm(self) -> None:
        """Get ready to answer quickly (connect, load scripts)."""
        ...

    async def close(self) -> None:
        ...


def build_index(spec: str, namespace: str = "kvroute", timeout_s: float = 0.05) -> PrefixIndex:
    """``memory`` or ``redis://HOST:PORT/DB``."""
    if spec == "memory":
        from .memory import MemoryIndex
        return MemoryIndex()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis import RedisIndex
        return RedisIndex(spec, namespace=namespace, timeout_s=timeout_s)
    raise ValueError(f"unknown index {spec!r}: use 'memory' or 'redis://HOST:PORT/DB'")
