"""The prefix index: which replica holds which prefix blocks, per model.

Implementations of one contract (tests/index/test_index_contract.py runs it against each):

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

Replicas that publish KV-cache events are held exactly instead (the ``exact`` tier, fed by
:mod:`router.index.tiered`): per block a medium mask (``GPU``, ``SLOW`` for an offloaded copy,
both) set and cleared by the replica's own events, never trimmed by the index; and, for the
moments before an event arrives, provisional entries that a routing decision adds and that
expire at a wall-clock time unless an event confirms them first. The same probe reads both
tiers; the caller says which replicas are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, NamedTuple, Protocol, Sequence


class Match(NamedTuple):
    blocks: int  # leading blocks of the chain the replica holds
    held: int  # blocks the index holds for the replica in all
    slow: int = 0  # of the leading blocks, those held only on a slower medium (exact tier)


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
    exact: bool = False  # provisional entries of the exact tier (the stamp is their expiry)


# Exact tier: what a block's value means. 1..3 is a medium mask; a larger value is the wall-clock
# expiry (seconds since the epoch) of a provisional entry.
GPU = 1
SLOW = 2  # an offloaded copy (vLLM's medium "CPU"): cheaper than recomputing, dearer than the GPU
PROVISIONAL_FLOOR = 4.0

# Exact-tier operations, applied in order: (STORE, key, medium bit), (REMOVE, key, medium bit), (CLEAR, 0, 0)
STORE, REMOVE, CLEAR = 1, 2, 3
Op = tuple[int, int, int]


class PrefixIndex(Protocol):
    name: str

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str],
                    exact: Collection[str] = ()) -> Probe:
        """For each replica: leading blocks of ``chain`` it holds, and blocks held in all.

        Replicas in ``exact`` are read from the exact tier (confirmed blocks, and provisional ones
        not yet expired); the others from the recorded tier.
        """
        ...

    async def holders(self, model: str, chain: Sequence[int], limit: int) -> list[str] | None:
        """Up to ``limit`` replicas that hold a prefix of ``chain``, those of the longest prefix first, found
        without asking every replica; None when this index cannot tell (every replica must be probed)."""
        ...

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        """``replica`` now holds the blocks of ``chain`` (most recently used first: the root)."""
        ...

    async def withdraw(self, receipt: Receipt) -> None:
        """Take back the blocks a record added, unless a later record touched them since."""
        ...

    async def provisional(self, model: str, replica: str, chain: Sequence[int], expires: float) -> Receipt | None:
        """Exact tier: the blocks of ``chain`` not held yet are held until ``expires`` (epoch seconds),
        unless an event confirms (STORE) or removes them first."""
        ...

    async def apply(self, model: str, replica: str, ops: Sequence[Op]) -> None:
        """Exact tier: the replica's events, in order (see STORE, REMOVE, CLEAR)."""
        ...

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        """Drop everything the index holds for ``replica`` in both tiers (it restarted or was removed)."""
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
        return RedisIndex.from_url(spec, namespace=namespace, timeout_s=timeout_s)
    raise ValueError(f"unknown index {spec!r}: use 'memory' or 'redis://HOST:PORT/DB'")
