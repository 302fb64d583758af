"""Which replicas a decision weighs: all of a small fleet, a few of a large one.

A model served by at most ``candidates.scan_up_to`` ready replicas is decided among all of them, as
before. On a larger fleet, looking every replica up in the prefix index and scoring each one would
make a decision cost grow with the fleet (about 5 times more per request at 1,024 replicas than at
8). There a request is decided among:

- the replicas that hold its prefix, those of the longest first (``candidates.holders``), as the
  prefix index finds them without asking each replica;
- the least loaded for their capacity (``candidates.least_loaded``), from a ranking of the ready
  replicas made again when it is ``candidates.ranking_s`` old, not per request (and less often where
  making one at that pace would take more than ``candidates.ranking_cpu`` of a core);
- a few drawn at random (``candidates.sampled``), so that a stale ranking cannot send a burst to
  one replica;
- the replica that served the request's session last, and the one its conversation waits at.

The decision then reads the live load of just these, so its cost no longer depends on the size of
the fleet. When none of them can take the request (all full, drained or tried), the caller weighs
every replica. An index that cannot name the holders of a prefix (``holders`` answers None) gets
every replica weighed too.
"""

from __future__ import annotations

import heapq
import random
import time
from typing import Iterable, Sequence

from .config import CandidatesConfig
from .index import PrefixIndex
from .replicas import ReplicaPool
from .view import ReplicaView


class Ranking:
    """The ready, undrained replicas of each model, and the ``head`` least loaded for their capacity of them.

    Replicas equally loaded are ranked in an order drawn at random for each ranking: on a fleet mostly idle
    between bursts, a fixed order (by name) would name the same few idle replicas to every decision for as
    long as they stay idle, and new conversations would gather there."""

    __slots__ = ("made_at", "names", "least", "blocks")

    def __init__(self, standings: Iterable[tuple[float, int, str, frozenset[str], int]], head: int,
                 rng: random.Random) -> None:
        self.made_at = time.monotonic()
        by_model: dict[str, list[tuple[float, int, str, frozenset[str], int]]] = {}
        for entry in standings:
            for m in entry[3]:
                by_model.setdefault(m, []).append(entry)
        # every ready replica, in the pool's order (for counting and drawing at random); the least loaded sorted
        self.names = {m: [e[2] for e in entries] for m, entries in by_model.items()}
        self.least = {m: _least(entries, head, rng) for m, entries in by_model.items()}
        self.blocks = {m: sorted({e[4] for e in entries}) for m, entries in by_model.items()}


def _least(entries: list[tuple[float, int, str, frozenset[str], int]], head: int, rng: random.Random) -> list[str]:
    """The names of the ``head`` least loaded of ``entries`` (load for capacity, then pending prefill), least first;
    ties in an order drawn at random."""
    tie = [rng.random() for _ in entries]
    best = heapq.nsmallest(head, range(len(entries)), key=lambda i: (entries[i][0], entries[i][1], tie[i]))
    return [entries[i][2] for i in best]


class Candidates:
    def __init__(self, pool: ReplicaPool, cfg: CandidatesConfig, index: PrefixIndex | None = None,
                 rng: random.Random | None = None) -> None:
        self.pool = pool
        self.cfg = cfg
        self.index = index
        self._rng = rng or random.Random()
        self._ranking: Ranking | None = None
        self._next_at = 0.0  # when the ranking is made again

    def _current(self) -> Ranking:
        """The ranking, made again once it is ``ranking_s`` old, or less often where making one takes more than
        ``ranking_cpu`` of a core at that pace (each ranking reads every replica; a decision does not)."""
        r = self._ranking
        if r is None or time.monotonic() >= self._next_at:
            cpu = time.thread_time()
            r = self._ranking = Ranking(self.pool.standings(), self.cfg.least_loaded, self._rng)
            cost = time.thread_time() - cpu
            self._next_at = r.made_at + max(self.cfg.ranking_s, cost / self.cfg.ranking_cpu)
        return r

    def eligible(self, model: str) -> list[str]:
        """The ready, undrained replicas serving ``model`` (at most ``ranking_s`` old)."""
        return self._current().names.get(model, [])

    def least_loaded(self, model: str) -> list[str]:
        """The ``least_loaded`` of :meth:`eligible` with the least load for their capacity, least first."""
        return self._current().least.get(model, [])

    def block_sizes(self, model: str) -> list[int]:
        """The KV block sizes of the ready replicas serving ``model`` (one on most fleets)."""
        return self._current().blocks.get(model, [])

    def is_large(self, model: str) -> bool:
        """Whether decisions for ``model`` weigh a few replicas rather than all of them."""
        return len(self.eligible(model)) > self.cfg.scan_up_to

    async def select(self, model: str, chains: Sequence[Sequence[int]], also: Iterable[str | None] = ()
                     ) -> list[ReplicaView] | None:
        """The views of the replicas to weigh for a prompt of ``model`` whose hash chains (one per block size in
        use) are ``chains``, or None: weigh every replica. ``also`` names replicas weighed whatever else holds
        (its session's, its conversation's)."""
        eligible = self.eligible(model)
        cfg = self.cfg
        if len(eligible) <= cfg.scan_up_to:
            return None
        names: dict[str, None] = {}
        if self.index is not None and cfg.holders:
            for chain in chains:
                if not chain:
                    continue
                found = await self.index.holders(model, chain, cfg.holders)
                if found is None:
                    return None
                names.update(dict.fromkeys(found))
        names.update(dict.fromkeys(self.least_loaded(model)))
        if cfg.sampled:
            names.update(dict.fromkeys(self._rng.sample(eligible, min(cfg.sampled, len(eligible)))))
        for name in also:
            if name is not None:
                names[name] = None
        views = []
        get = self.pool.get
        for name in names:
            r = get(name)
            if r is not None and r.ready and model in r.models:
                views.append(r.view)
        return views
