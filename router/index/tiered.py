"""The precise index: what each replica's KV-cache events say it holds, with provisional entries between.

A :class:`TieredIndex` is the :class:`~router.index.PrefixIndex` the router uses. Replicas whose
events are being applied (the event feed, :mod:`router.kv_events.feed`, says which) are read from
the backend's exact tier; the others keep the recorded tier (the routing decisions, trimmed
least recently used first), so a mixed fleet works replica by replica.

For an exact replica a routing decision adds provisional entries (the blocks of the prompt not held
yet, expiring after ``kv_events.provisional_ttl_s``), so that a burst of one prefix sticks together
in the milliseconds before the replica's events arrive; the events confirm them, a failed attempt
withdraws them.

Events name blocks by the replica's own hashes; the index keys blocks by the router's chain keys
(:func:`router.prefix.chain_tokens` over the event's ``token_ids``, seeded by the parent block's
key), the same keys a request's prompt gets in token mode. Per event source a bounded map from the
replica's hash to the router's key (and the parent's hash) lets ``BlockRemoved`` be applied. A
``BlockStored`` whose parent is known but not held re-confirms the parent and its ancestors: vLLM
only stores a block after its parent, so the parent is cached at that moment. That is how the
index heals after a rebuild (lost events it could not replay) from the live stream alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from ..block_events import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored
from ..prefix import chain_tokens, root_seed
from . import CLEAR, GPU, REMOVE, SLOW, STORE, Match, Op, PrefixIndex, Probe, Receipt

# (replica, lora_name) -> the served model whose prompt keys the blocks get, or None when that model's
# prompts are not keyed by tokens here (no tokenizer): its events cannot be matched to requests
ModelOf = Callable[[str, "str | None"], "str | None"]


_OFFLOAD_FACTOR = 5  # a replica that offloads may hold this many times its KV blocks (GPU and slower)


@dataclass
class Applied:
    """What one batch did, for the feed's counters."""

    stored: int = 0  # blocks
    removed: int = 0
    cleared: int = 0  # AllBlocksCleared events
    reconfirmed: int = 0  # ancestors of stored blocks, held again
    orphans: int = 0  # stored blocks whose parent this index never saw: events were missed
    unknown_removed: int = 0  # removed blocks the map does not know
    unkeyed: int = 0  # stored blocks of a model keyed in byte mode here
    evicted: int = 0  # held blocks dropped because the replica cannot hold that many: removals were lost
    block_sizes: set[int] = field(default_factory=set)


class _Entry:
    __slots__ = ("model", "key", "parent", "mask")

    def __init__(self, model: str, key: int, parent: BlockHash | None, mask: int) -> None:
        self.model = model
        self.key = key
        self.parent = parent
        self.mask = mask

    def dump(self) -> list:
        return [self.model, self.key, self.parent, self.mask]


class SourceMap:
    """One event source's blocks: the replica's hash -> the router's key, held or known.

    ``held`` has the blocks the replica holds (on some medium); ``known`` the ones it held before
    (removed, or unconfirmed since a rebuild), least recently seen first, kept so that a later
    child can still be keyed. Both are bounded. With ``journal`` on, the hashes changed since the
    last :meth:`take_changes` are kept, for a router that stores the map for others (the lease).
    """

    def __init__(self, limit: int, journal: bool = False, capacity: int | None = None) -> None:
        self.limit = limit
        self.capacity = capacity or limit  # the replica's KV blocks
        self.offloads = False  # it stores blocks on a slower medium too (CPU offloading): it may hold more
        self.held: dict[BlockHash, _Entry] = {}
        self.known: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self.dropped = 0  # held entries dropped by the bound: their removals cannot be applied
        self.journal = journal
        self._changed: set[BlockHash] = set()
        self._gone: set[BlockHash] = set()

    def find(self, h: BlockHash) -> _Entry | None:
        e = self.held.get(h)
        return e if e is not None else self.known.get(h)

    def hold(self, h: BlockHash, e: _Entry) -> _Entry | None:
        """``h`` is held (now the most recently stored); returns the entry dropped to make room, if any.

        The replica cannot hold more blocks than its KV cache has (times ``_OFFLOAD_FACTOR`` once it offloads):
        past that, its events lost removals (or lie), and the oldest held block goes.
        """
        self.known.pop(h, None)
        self.held.pop(h, None)
        self.held[h] = e
        self.touched(h)
        if len(self.held) > self.capacity * (_OFFLOAD_FACTOR if self.offloads else 1):
            old = next(iter(self.held))
            dropped = self.held[old]
            self.forget_held(old)
            self.dropped += 1
            return dropped
        return None

    def touched(self, h: BlockHash) -> None:
        if self.journal:
            self._changed.add(h)

    def forget_held(self, h: BlockHash) -> None:
        e = self.held.pop(h)
        e.mask = 0
        self.known[h] = e
        self.known.move_to_end(h)
        self.touched(h)
        while len(self.known) > self.limit:
            old, _ = self.known.popitem(last=False)
            if self.journal:
                self._changed.discard(old)
                self._gone.add(old)

    def release_all(self) -> None:
        """Nothing is held any more (the replica cleared its cache, or the index was rebuilt)."""
        for h in list(self.held):
            self.forget_held(h)

    def models(self) -> set[str]:
        return {e.model for e in self.held.values()}

    def take_changes(self) -> tuple[list[tuple[BlockHash, list]], list[BlockHash]]:
        """(hash, entry) changed and hashes dropped since the last call."""
        changed = [(h, e.dump()) for h in self._changed if (e := self.find(h)) is not None]
        gone = list(self._gone)
        self._changed.clear()
        self._gone.clear()
        return changed, gone

    def restore(self, entries: list[tuple[BlockHash, list]]) -> None:
        """Load a map another router stored (see :meth:`take_changes`)."""
        for h, (model, key, parent, mask) in entries:
            if isinstance(h, (list, tuple)):
                continue
            e = _Entry(model, key, parent, mask)
            if mask:
                self.held[h] = e
            else:
                self.known[h] = e
        while len(self.known) > self.limit:
            self.known.popitem(last=False)


class TieredIndex:
    def __init__(self, base: PrefixIndex, provisional_ttl_s: float = 2.0, slow_weight: float = 0.5) -> None:
        self.base = base
        self.name = base.name
        self.ttl = provisional_ttl_s
        self.slow_weight = slow_weight
        self._exact: set[str] = set()
        self._sources: dict[tuple[str, int], SourceMap] = {}
        self._decisions: dict[str, int] = {}  # provisional records per exact replica (the feed's silence check)

    # -- which replicas are exact (the event feed decides) -----------------------------------

    def set_exact(self, replica: str, exact: bool) -> None:
        if exact:
            self._exact.add(replica)
        else:
            self._exact.discard(replica)

    def is_exact(self, replica: str) -> bool:
        return replica in self._exact

    def decisions(self, replica: str) -> int:
        """Routing decisions recorded for ``replica`` as provisional entries so far."""
        return self._decisions.get(replica, 0)

    # -- the PrefixIndex contract ------------------------------------------------------------

    async def probe(self, model: str, chain: Sequence[int], replicas: Sequence[str],
                    exact: Collection[str] = ()) -> Probe:
        exact = self._exact
        found = await self.base.probe(model, chain, replicas, exact)
        if exact and self.slow_weight < 1.0:
            cost = 1.0 - self.slow_weight
            matches = {r: Match(m.blocks - round(m.slow * cost), m.held) if m.slow else m
                       for r, m in found.matches.items()}
            return Probe(matches, found.degraded)
        return found

    async def holders(self, model: str, chain: Sequence[int], limit: int) -> list[str] | None:
        return await self.base.holders(model, chain, limit)

    async def record(self, model: str, replica: str, chain: Sequence[int], capacity: int) -> Receipt | None:
        if replica in self._exact:
            self._decisions[replica] = self._decisions.get(replica, 0) + 1
            return await self.base.provisional(model, replica, chain, time.time() + self.ttl)
        return await self.base.record(model, replica, chain, capacity)

    async def withdraw(self, receipt: Receipt) -> None:
        await self.base.withdraw(receipt)

    async def provisional(self, model: str, replica: str, chain: Sequence[int], expires: float) -> Receipt | None:
        return await self.base.provisional(model, replica, chain, expires)

    async def apply(self, model: str, replica: str, ops: Sequence[Op]) -> None:
        await self.base.apply(model, replica, ops)

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        """Everything about ``replica``: both tiers and its sources' maps (it restarted or left)."""
        for key in [k for k in self._sources if k[0] == replica]:
            del self._sources[key]
        await self.base.forget(replica, models)

    async def size(self, model: str, replica: str) -> int:
        return await self.base.size(model, replica)

    async def start(self) -> None:
        await self.base.start()

    async def close(self) -> None:
        self._sources.clear()
        await self.base.close()

    # -- events --------------------------------------------------------------------------------

    def source(self, replica: str, rank: int, limit: int = 1024, journal: bool = False,
               capacity: int | None = None) -> SourceMap:
        key = (replica, rank)
        src = self._sources.get(key)
        if src is None:
            src = self._sources[key] = SourceMap(limit, journal, capacity)
        else:
            src.limit = limit
            if capacity:
                src.capacity = capacity
        return src

    def drop_sources(self, replica: str) -> None:
        """Forget the maps of ``replica`` (another router consumes its events now)."""
        for key in [k for k in self._sources if k[0] == replica]:
            del self._sources[key]

    def held_blocks(self, replica: str) -> int:
        """Blocks the replica's events say it holds (all its sources)."""
        return sum(len(s.held) for k, s in self._sources.items() if k[0] == replica)

    async def apply_batch(self, replica: str, rank: int, batch: Batch, model_of: ModelOf, limit: int,
                          capacity: int | None = None) -> Applied:
        """Apply one batch of the replica's events, in order; ``capacity`` is the replica's KV blocks."""
        src = self.source(replica, rank, limit, capacity=capacity)
        out = Applied()
        ops: dict[str, list[Op]] = {}
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(replica, src, event, model_of, ops, out)
            elif isinstance(event, BlockRemoved):
                bit = GPU if event.medium in (None, "GPU", "gpu") else SLOW
                for h in event.block_hashes:
                    e = src.held.get(h)
                    if e is None or not e.mask & bit:
                        out.unknown_removed += 1
                        continue
                    e.mask &= ~bit
                    ops.setdefault(e.model, []).append((REMOVE, e.key, bit))
                    if e.mask:
                        src.touched(h)
                    else:
                        src.forget_held(h)
                    out.removed += 1
            elif isinstance(event, AllBlocksCleared):
                for model in src.models():
                    ops.setdefault(model, []).append((CLEAR, 0, 0))
                src.release_all()
                out.cleared += 1
        for model, model_ops in ops.items():
            await self.base.apply(model, replica, model_ops)
        return out

    def _stored(self, replica: str, src: SourceMap, event: BlockStored, model_of: ModelOf,
                ops: dict[str, list[Op]], out: Applied) -> None:
        model = model_of(replica, event.lora_name)
        if model is None or event.salted:
            out.unkeyed += len(event.block_hashes)
            return
        out.block_sizes.add(event.block_size)
        bit = GPU if event.medium in (None, "GPU", "gpu") else SLOW
        if bit == SLOW:
            src.offloads = True
        model_ops = ops.setdefault(model, [])
        parent = event.parent_block_hash
        if parent is None:
            seed = root_seed(model)
        else:
            p = src.find(parent)
            if p is None:
                out.orphans += len(event.block_hashes)
                return
            seed = p.key
            out.reconfirmed += self._reconfirm(src, parent, p, bit, ops, out)
        keys = chain_tokens(event.token_ids, event.block_size, seed)
        for h, k in zip(event.block_hashes, keys):
            e = src.find(h)
            if e is None or e.key != k:
                e = _Entry(model, k, parent, 0)
            e.mask |= bit
            model_ops.append((STORE, k, bit))
            self._hold(src, h, e, ops, out)
            parent = h
            out.stored += 1

    @staticmethod
    def _hold(src: SourceMap, h: BlockHash, e: _Entry, ops: dict[str, list[Op]], out: Applied) -> None:
        dropped = src.hold(h, e)
        if dropped is not None:
            ops.setdefault(dropped.model, []).append((REMOVE, dropped.key, GPU | SLOW))
            out.evicted += 1

    def _reconfirm(self, src: SourceMap, h: BlockHash, e: _Entry, bit: int, ops: dict[str, list[Op]],
                   out: Applied) -> int:
        """The parent of a block just stored on ``bit`` is held there too, and so are its ancestors."""
        if bit != GPU:  # an offloaded block says nothing about where its parent is
            return 0
        n = 0
        current: _Entry | None = e
        while current is not None and not current.mask & GPU:
            current.mask |= GPU
            ops.setdefault(current.model, []).append((STORE, current.key, GPU))
            self._hold(src, h, current, ops, out)
            n += 1
            if current.parent is None:
                break
            h = current.parent
            current = src.find(h)
        return n

    async def rebuild(self, replica: str, models: Collection[str]) -> None:
        """Events were lost for good: drop what the events said, keep provisional entries and the
        maps' keys (the live stream re-confirms blocks as their children arrive)."""
        for key, src in self._sources.items():
            if key[0] == replica:
                src.release_all()
        for model in models:
            await self.base.apply(model, replica, [(CLEAR, 0, 0)])

    async def restart(self, replica: str, models: Collection[str]) -> None:
        """The replica restarted (its cache is empty, its hashes new): drop its events' blocks and maps."""
        for key in [k for k in self._sources if k[0] == replica]:
            del self._sources[key]
        for model in models:
            await self.base.apply(model, replica, [(CLEAR, 0, 0)])
