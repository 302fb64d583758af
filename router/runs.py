"""Chained block hashes, found run by run.

A sequence (a prompt's bytes or token ids, a long text) is cut into blocks, each hashed with xxh3_64 seeded by
the hash of the block before. Runs of blocks are named too: one hash over a whole run, chained over the runs
before it, names everything up to the run's end, so a run named before gives its blocks' hashes at once and only
what is new is hashed block by block (a conversation's earlier turns, a shared document, a shared system prompt).
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash


class Runs:
    """Runs named before -> the hashes of their blocks (the int objects a chain is a list of: extending a list by
    them copies references, where an array's would be made anew), at most ``kept`` of them, the first kept out
    first."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._table: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def clear(self) -> None:
        self._table.clear()

    def chain(self, data: memoryview | bytes | str, block: int, per_run: int, seed: int, name: int) -> list[int]:
        """Hashes of the full ``block``-long blocks of ``data``, the first seeded by ``seed``, each next by the one
        before; by runs of ``per_run`` blocks (0: none), named from ``name``. A str is hashed as UTF-8, block by
        block of its characters."""
        hasher = xxhash.xxh3_64_intdigest
        text = isinstance(data, str)
        table = self._table
        out: list[int] = []
        h = seed
        run = max(1, per_run * block)
        runs_end = len(data) // run * run if per_run else 0
        for start in range(0, runs_end, run):
            piece = data[start:start + run]
            name = hasher(piece.encode("utf-8", "surrogatepass") if text else piece, seed=name)  # type: ignore[union-attr]
            got = table.get(name)
            if got is None:
                fresh = []
                for at in range(start, start + run, block):
                    piece = data[at:at + block]
                    h = hasher(piece.encode("utf-8", "surrogatepass") if text else piece, seed=h)  # type: ignore[union-attr]
                    fresh.append(h)
                got = tuple(fresh)
                if len(table) >= self.kept:
                    table.popitem(last=False)
                table[name] = got
            out.extend(got)
            h = got[-1]
        for start in range(runs_end, len(data) - block + 1, block):
            piece = data[start:start + block]
            h = hasher(piece.encode("utf-8", "surrogatepass") if text else piece, seed=h)  # type: ignore[union-attr]
            out.append(h)
        return out
