"""Conversations between turns: requests each replica should expect back.

A chat's next turn resends its history, so its prompt extends the previous turn's. Every prompt is keyed
as a chain of block hashes; the last whole block of an answered prompt (its *tail*) that reappears inside
a later prompt marks that prompt as the same conversation's next turn. Per replica this keeps the tails
of answered requests that no later request has continued yet, for ``window_s``: conversations between
turns, whose next request will want the history cached there.

The requests in flight say how busy a replica is now; these say how busy it will be, and how much of its
cache their histories will need. Placing a new conversation by the first alone lets a burst of new
conversations pile on whichever replica is quickest at that moment, where their histories then outgrow
its cache. Not every workload comes back: the count is weighed by the share of tails that were continued
(learned, with a prior of :data:`PRIOR_ENDED` tails that were not), so one-shot prompts weigh nothing.

Only hashes are kept, never text; the table is bounded (``max_tracked``, oldest out). Each router process
(each worker) sees the requests it routes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

PRIOR_ENDED = 10.0  # until that many tails were continued, the share stays well below 1
DECAY = 0.999  # the share follows the last few thousand outcomes
SCAN_BLOCKS = 512  # a turn's previous tail is searched this far back from the end of the prompt


class Conversations:
    def __init__(self, window_s: float = 60.0, max_tracked: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.max_tracked = max_tracked
        self._clock = clock
        self._tails: OrderedDict[int, tuple[str, float]] = OrderedDict()  # tail -> (replica, left at), oldest first
        self._waiting: dict[str, int] = {}  # replica -> its tails
        self._continued = 0.0
        self._ended = 0.0

    # -- reading -----------------------------------------------------------------------------

    def continued_share(self) -> float:
        """The share of answered prompts whose conversation came back (decayed, with its prior)."""
        return self._continued / (self._continued + self._ended + PRIOR_ENDED)

    def find(self, chains: Iterable[Sequence[int]]) -> tuple[int, str] | None:
        """The waiting tail a prompt continues (the deepest found), and the replica it waits at."""
        self._expire()
        tails = self._tails
        if not tails:
            return None
        keys = tails.keys()
        for chain in chains:
            window = chain[-SCAN_BLOCKS:]
            if keys.isdisjoint(window):  # most prompts of a new conversation: one pass in C
                continue
            for h in reversed(window):
                got = tails.get(h)
                if got is not None:
                    return h, got[0]
        return None

    def expected(self, own: str | None = None) -> dict[str, float]:
        """Per replica, the requests its waiting conversations are expected to send (``own``: the replica
        where the asking request's own conversation waits, which does not count against it)."""
        share = self.continued_share()
        if share <= 0.0:
            return {}
        out = {}
        for r, n in self._waiting.items():
            n -= r == own
            if n > 0:
                out[r] = share * n
        return out

    def waiting(self) -> dict[str, int]:
        """Conversations waiting at each replica (tails not continued yet)."""
        self._expire()
        return {r: n for r, n in self._waiting.items() if n}

    # -- the lifecycle of a turn -----------------------------------------------------------------

    def resume(self, tail: int) -> None:
        """A routed request continues the conversation that waited at ``tail``."""
        got = self._tails.pop(tail, None)
        if got is None:
            return
        self._waiting[got[0]] -= 1
        self._learn(True)

    def answered(self, replica: str, tails: Iterable[int]) -> None:
        """``replica`` answered prompts ending in ``tails``: their conversations wait there now."""
        now = self._clock()
        for tail in tails:
            old = self._tails.pop(tail, None)
            if old is not None:
                self._waiting[old[0]] -= 1
            self._tails[tail] = (replica, now)
            self._waiting[replica] = self._waiting.get(replica, 0) + 1
        while len(self._tails) > self.max_tracked:  # out without teaching anything
            _, (r, _) = self._tails.popitem(last=False)
            self._waiting[r] -= 1

    def forget(self, replica: str) -> None:
        """``replica`` left the pool: its waiting conversations no longer weigh on it."""
        for tail in [t for t, (r, _) in self._tails.items() if r == replica]:
            del self._tails[tail]
        self._waiting.pop(replica, None)

    def _expire(self) -> None:
        tails = self._tails
        if not tails:
            return
        horizon = self._clock() - self.window_s
        while tails:
            tail, (r, at) = next(iter(tails.items()))
            if at >= horizon:
                break
            del tails[tail]
            self._waiting[r] -= 1
            self._learn(False)

    def _learn(self, continued: bool) -> None:
        self._continued *= DECAY
        self._ended *= DECAY
        if continued:
            self._continued += 1.0
        else:
            self._ended += 1.0
