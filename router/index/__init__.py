"""The prefix index: which replica holds which prefix blocks, per model.

Implementations of one contract (tests/test_index_contract.py runs it against each):

- ``memory`` (default): in this process;
- ``redis``: shared by every router instance pointed at the same Redis;
- ``fallback`` wraps the two: Redis while it answers in time, the local index when it does not.

Per (model, replica) the index keeps at most ``capacity`` blocks (the replica's
``num_gpu_blocks``), least recently used out first, so it forgets roughly what the replica
evicts. Within one recorded chain the root block counts as the most recently used, as vLLM
frees a request's blocks tail first. Only 64-bit block hashes are stored, never prompt text.

A record returns a :class:`Receipt`. If the attempt it was made for fails before the replica
answered, :meth:`PrefixIndex.withdraw` takes back the blocks that record added (those still
carrying its stamp), so a replica that never served the prompt does not attract its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence


class Match(NamedTuple):
    blocks: int  # leading blocks of the chain the replica holds
    held: int  # blocks the index holds for the replica in all


class Probe(NamedTuple):
    matches: dict[str, Match]
    degraded: bool = False  # the shared index did not answer: this is the local view


@dataclass(frozen=True, slots=True)
class Receipt:
    """What one record added, so that it can be withdrawn."""

    model: str
    replica: str
    chain: Sequence[int]
    kept: int  # leading blocks of the chain the replica held before the record
    stamp: Any  # the record's mark on the blocks it touched


class PrefixIndex(Protocol):
    name: str

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str]) -> Probe:
        """For each replica: leading blocks of ``chain`` it holds, and blocks held in all."""
        ...

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        """``replica`` now holds the blocks of ``chain`` (most recently used first: the root)."""
        ...

    async def withdraw(self, receipt: Receipt) -> None:
        """Take back the blocks a record added, unless a later record touched them since."""
        ...

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        """Drop everything the index holds for ``replica`` (it restarted or was removed)."""
        ...

    async def size(self, model: str, replica: str) -> int:
        ...

    async def start(self) -> None:
        """Get ready to answer quickly (connect, load scripts)."""
        ...

    async def close(self) -> None:
        ...


def build_index(spec: str, namespace: str = "kvroute", timeout_s: float = 0.05) -> PrefixIndex:
    """``memory`` or ``redis://HOST:PORT/DB`` (a bare Redis index: the gateway wraps it in a fallback)."""
    if spec == "memory":
        from .memory import MemoryIndex
        return MemoryIndex()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis import RedisIndex
        return RedisIndex(spec, namespace=namespace, timeout_s=timeout_s)
    raise ValueError(f"unknown index {spec!r}: use 'memory' or 'redis://HOST:PORT/DB'")
