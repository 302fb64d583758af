"""Replaying a production trace: Mooncake's conversation trace, and the hit rate an ideal placement gets on it.

The trace (``loadtest/traces/mooncake_conversation.jsonl.gz``; source and license in
``loadtest/traces/README.md``) is one hour of a production chat service: 12,031 requests, each with its
arrival time (ms), its prompt and output lengths in tokens and the chained hashes of its prompt's 512-token
blocks (``hash_ids``: two requests whose first k ids agree share their first k x 512 tokens). Prompts average
12,000 tokens (median 6,900, up to 126,000); a conversation's next turn comes minutes after the last one
(median two), in bursts of requests arriving together.

Mooncake hashed a prompt's last, partial block on its own: the next turn of a conversation, which resends the
whole prompt, shows another id at that position (3,825 of the 3,947 next turns that hold every whole block of
the turn before). ``read`` gives that partial block the id of the block the conversation's next turn has there
(that turn's text begins with it), so a replayed turn resends its predecessor whole, as a chat client does;
otherwise up to 511 tokens a turn would be new that are not, and no turn would hold the end of the one before.

Replayed here as chats of one user message: block id ``h`` is 512 words of the tiny model's vocabulary drawn
from a generator seeded with ``h`` (one token each), the last block cut to the request's length, so requests
share exactly the prefixes the trace says they share. ``sample`` keeps one conversation in ``sample`` (by
its first own block: whole conversations, over the whole hour), ``requests`` the first that many of those.
Arrival times keep their order and bursts and are scaled to an offered rate.

The reference, ``ideal_hit_rate``: the same prompts, in arrival order, on one LRU cache of blocks as large as
the whole fleet's KV memory, counted as vLLM counts its prefix-cache hits (whole blocks, at least one token
computed). No placement on separate replicas does better than that pooled cache (apart from LRU's own
oddities), and a router that keeps conversations together comes close.
"""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

TRACE = Path(__file__).parent / "traces" / "mooncake_conversation.jsonl.gz"
TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces


@dataclass(frozen=True)
class Entry:
    at_s: float  # arrival, seconds from the trace's start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    @property
    def conversation(self) -> int:
        """Its first own block (the first is the service's system prompt, shared by all); -1 if it has none."""
        return self.hash_ids[1] if len(self.hash_ids) > 1 else -1


def read(path: Path = TRACE) -> list[Entry]:
    """The trace's requests in arrival order, each turn's partial last block carried by its next turn (``resent``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(Entry(r["timestamp"] / 1e3, int(r["input_length"]), int(r["output_length"]),
                                 tuple(r["hash_ids"])))
    return resent(out)


def resent(entries: Sequence[Entry]) -> list[Entry]:
    """``entries`` (in arrival order) with a request's partial last block given the id that the next request of
    its conversation has at that position, where that request holds every whole block of it (and goes on past
    it): the text that next turn resends. Later turns first, so a chain of such turns carries one id."""
    out = list(entries)
    after: dict[int, Entry] = {}  # conversation -> its next request (already carried)
    for i in range(len(out) - 1, -1, -1):
        e = out[i]
        nxt = after.get(e.conversation) if e.conversation >= 0 else None
        whole = e.input_tokens // TRACE_BLOCK
        if (nxt is not None and whole < len(e.hash_ids) and len(nxt.hash_ids) > whole
                and nxt.hash_ids[:whole] == e.hash_ids[:whole] and nxt.hash_ids[whole] != e.hash_ids[whole]):
            e = out[i] = Entry(e.at_s, e.input_tokens, e.output_tokens, e.hash_ids[:whole] + (nxt.hash_ids[whole],))
        if e.conversation >= 0:
            after[e.conversation] = e
    return out


def sample(entries: Sequence[Entry], every: int, limit: int = 0) -> list[Entry]:
    """One conversation in ``every`` (a request without its own block stands alone), the first ``limit`` of them."""
    out = [e for i, e in enumerate(entries)
           if zlib.crc32(str(e.conversation if e.conversation >= 0 else -1 - i).encode()) % max(1, every) == 0]
    return out[:limit] if limit else out


class Texts:
    """Each block id's text: ``TRACE_BLOCK`` words of ``vocabulary`` (one token each), the same for every run."""

    def __init__(self, vocabulary: Sequence[str], seed: int = 0) -> None:
        self.vocabulary = list(vocabulary)
        self.seed = seed
        self._blocks: dict[int, list[str]] = {}

    def block(self, h: int) -> list[str]:
        words = self._blocks.get(h)
        if words is None:
            rng = random.Random(self.seed * 1_000_003 + h)
            words = self._blocks[h] = [rng.choice(self.vocabulary) for _ in range(TRACE_BLOCK)]
        return words

    def prompt(self, e: Entry) -> str:
        """``e.input_tokens`` words: its blocks in order, the last one cut."""
        out: list[str] = []
        for h in e.hash_ids:
            out += self.block(h)
        return "".join(out[:e.input_tokens])


def ideal_hit_rate(prompts: Iterable[Sequence[int]], capacity_blocks: int, block_size: int) -> float:
    """Prefix-cache hits / prompt tokens of ``prompts`` (token ids, in arrival order) on one LRU cache of
    ``capacity_blocks`` blocks: vLLM's counting (whole blocks, the last token always computed)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = queries = 0
    for ids in prompts:
        chain, parent = [], 0
        for i in range(len(ids) // block_size):
            parent = hash((parent, tuple(ids[i * block_size:(i + 1) * block_size])))
            chain.append(parent)
        usable = (len(ids) - 1) // block_size
        cached = 0
        while cached < usable and chain[cached] in lru:
            cached += 1
        hits += cached * block_size
        queries += len(ids)
        for h in chain:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits / queries if queries else 0.0


def reference(entries: Sequence[Entry], texts: Texts, token_ids: Callable[[str], Sequence[int]],
              capacity_blocks: int, block_size: int) -> float:
    """``ideal_hit_rate`` of the replayed prompts, rendered to token ids as the replicas render them."""
    return ideal_hit_rate((token_ids(texts.prompt(e)) for e in entries), capacity_blocks, block_size)
