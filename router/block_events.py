"""What a replica's KV cache reports about its blocks: stored (with their tokens), removed, all cleared, in
numbered batches. vLLM's KV-cache event types as :mod:`router.kv_events.decode` reads them off the wire and
the precise index (:mod:`router.index.tiered`) applies them; neither side owns the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

BlockHash = Union[int, bytes]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # "GPU", or a slower tier ("CPU") with KV offloading
    lora_name: str | None = None
    # per block, what else vLLM's hash covered (cache_salt, multimodal hashes); None entries when nothing
    extra_keys: tuple[Any, ...] | None = None

    @property
    def salted(self) -> bool:
        """Some block's hash covers more than its tokens and LoRA adapter (a ``cache_salt``, images):
        the router keys such blocks differently, so they cannot be matched."""
        if not self.extra_keys:
            return False
        for k in self.extra_keys:
            if k is None:
                continue
            items = k if isinstance(k, (list, tuple)) else (k,)
            if any(x != self.lora_name for x in items):
                return True
        return False


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int  # per publisher, from 0; one number per batch, not per event
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
