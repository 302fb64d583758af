"""Conversations between turns: requests each replica should expect back.

A chat's next turn resends its history, so its prompt extends the previous turn's. Every prompt is keyed
as a chain of block hashes; the last whole block of an answered prompt (its *tail*) that reappears inside
a later prompt marks that prompt as the same conversation's next turn. Per replica this keeps the tails
of answered requests that no later request has continued yet, for ``window_s``: conversations between
turns, whose next request will want the history cached there.

The requests in flight say how busy a replica is now; these say how busy it will be, and how much of its
cache their histories will need. Placing a new conversation by the first alone lets a burst of new
conversations pile on whichever replica is quickest at that moment, where their histories then outgrow
its cache.

Not every tail is a conversation's. The count is weighed by the share of tails whose next turn came and
grew the history by a whole block or more (learned, with a prior of :data:`PRIOR_ENDED` tails that did
not): one-shot prompts never come back, and the prompts of a group under one system prompt come back to
the same last whole block (the question fits in the block after it) without growing it; the cache term
already draws those to their prefix.

Apart from the table, the tails of prompts *routed* in the last ``window_s`` (answered or not) are kept too:
a prompt holding one of them (:meth:`Conversations.extends`) shares its history with an earlier prompt of its
own (a later turn, asked while the last one may still be streaming; a document asked about again), not just
a prefix that many prompts share (a system prompt, where every replica computing a copy once is how load
spreads). Only the first tells the cost that computing it elsewhere is computing it twice.

Only hashes are kept, never text; the tables are bounded (``max_tracked``, oldest out). Each router process
(each worker) sees the requests it routes; with ``journal`` it also keeps what changed, for
:mod:`router.shared_conversations` to tell the other routers, and hears what they answered and continued.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable, Iterable, NamedTuple, Sequence, Union

# the share starts at 0 and is 0.5 after two next turns: a burst of new conversations is known as one soon (with 10,
# the first dozen of a burst started before the router counted them as conversations, and piled up)
PRIOR_ENDED = 2.0
DECAY = 0.999  # the share follows the last few thousand outcomes
SCAN_BLOCKS = 512  # a turn's previous tail is searched this far back from the end of the prompt


class Continuation(NamedTuple):
    """A prompt holds the tail of an answered one."""

    tail: int
    replica: str  # where that tail waits
    grows: bool  # the prompt goes on for a whole block or more past it: a conversation's next turn


class Answered(NamedTuple):
    replica: str
    tails: tuple[int, ...]
    at: float  # wall-clock time (s)


class Resumed(NamedTuple):
    tail: int
    grows: bool


Change = Union[Answered, Resumed]
JOURNAL_MAX = 4096  # changes kept for the other routers between two syncs; older ones are not told


class Conversations:
    def __init__(self, window_s: float = 60.0, max_tracked: int = 100_000,
                 clock: Callable[[], float] = time.monotonic, journal: bool = False) -> None:
        self.window_s = window_s
        self.max_tracked = max_tracked
        self._clock = clock
        self._tails: OrderedDict[int, tuple[str, float]] = OrderedDict()  # tail -> (replica, left at), oldest first
        self._waiting: dict[str, int] = {}  # replica -> its tails
        self._grew = 0.0  # tails whose next turn grew the history (decayed)
        self._ended = 0.0  # tails that ended, or came back without growing (decayed)
        self._journal: deque[Change] | None = deque(maxlen=JOURNAL_MAX) if journal else None
        self._routed: OrderedDict[int, float] = OrderedDict()  # tail of a routed prompt -> routed at, oldest first

    # -- reading -----------------------------------------------------------------------------

    def continued_share(self) -> float:
        """The share of answered prompts whose next turn came and grew the history (decayed, with its
        prior)."""
        return self._grew / (self._grew + self._ended + PRIOR_ENDED)

    def turns_ahead(self) -> float:
        """The further turns a prompt that starts a conversation is expected to send: each answered prompt's next
        turn comes with the continued share s, so s + s^2 + ... = s / (1 - s) (finite: the prior keeps s below 1)."""
        share = self.continued_share()
        return share / (1.0 - share)

    def find(self, chains: Iterable[Sequence[int]]) -> Continuation | None:
        """The waiting tail a prompt continues (the deepest found), the replica it waits at, and whether the
        prompt extends it by a whole block."""
        self._expire()
        tails = self._tails
        if not tails:
            return None
        keys = tails.keys()
        for chain in chains:
            window = chain[-SCAN_BLOCKS:]
            if keys.isdisjoint(window):  # most prompts of a new conversation: one pass in C
                continue
            for back, h in enumerate(reversed(window)):
                got = tails.get(h)
                if got is not None:
                    return Continuation(h, got[0], back > 0)
        return None

    def extends(self, chains: Iterable[Sequence[int]]) -> bool:
        """Whether a prompt holds the tail of a prompt routed in the last ``window_s`` (answered or not)."""
        routed = self._routed
        if not routed:
            return False
        horizon = self._clock() - self.window_s
        while routed and next(iter(routed.values())) < horizon:
            routed.popitem(last=False)
        keys = routed.keys()
        return any(not keys.isdisjoint(chain[-SCAN_BLOCKS:]) for chain in chains)

    def routed(self, tails: Iterable[int]) -> None:
        """Prompts ending in ``tails`` were routed now (their own chains are searched before this is told)."""
        routed = self._routed
        now = self._clock()
        for tail in tails:
            routed.pop(tail, None)
            routed[tail] = now
        while len(routed) > self.max_tracked:
            routed.popitem(last=False)

    def expected(self, own: str | None = None, among: Iterable[str] | None = None) -> dict[str, float]:
        """Per replica, the requests its waiting conversations are expected to send (``own``: the replica
        where the asking request's own conversation waits, which does not count against it; ``among``: only
        these replicas, the few a decision on a large fleet weighs)."""
        share = self.continued_share()
        if share <= 0.0:
            return {}
        out = {}
        waiting = self._waiting
        pairs = waiting.items() if among is None else ((r, waiting.get(r, 0)) for r in among)
        for r, n in pairs:
            n -= r == own
            if n > 0:
                out[r] = share * n
        return out

    def waiting(self) -> dict[str, int]:
        """Conversations waiting at each replica (tails not continued yet)."""
        self._expire()
        return {r: n for r, n in self._waiting.items() if n}

    def describe(self) -> dict[str, object]:
        """For ``/admin/replicas``: the tails waiting at each replica, what became of earlier ones (decayed
        counts: a next turn that grew the history; ended, or came back without growing) and the share."""
        return {"waiting": self.waiting(), "next_turns": round(self._grew, 2), "ended": round(self._ended, 2),
                "continued_share": round(self.continued_share(), 4)}

    # -- the lifecycle of a turn -----------------------------------------------------------------

    def resume(self, found: Continuation) -> None:
        """A routed request continues what waited at ``found.tail``: a conversation if it grows."""
        if self._journal is not None:
            self._journal.append(Resumed(found.tail, found.grows))
        self._resumed(found.tail, found.grows)

    def _resumed(self, tail: int, grows: bool) -> None:
        got = self._tails.pop(tail, None)
        if got is None:
            return
        self._waiting[got[0]] -= 1
        self._learn(grows)

    def answered(self, replica: str, tails: Iterable[int]) -> None:
        """``replica`` answered prompts ending in ``tails``: their conversations wait there now."""
        tails = tuple(tails)
        if self._journal is not None and tails:
            self._journal.append(Answered(replica, tails, time.time()))
        self._add(replica, tails, self._clock())

    # -- what the other routers did (router.shared_conversations) --------------------------------

    def take_journal(self) -> list[Change]:
        """What this router answered and continued since the last call, oldest first."""
        if not self._journal:
            return []
        out = list(self._journal)
        self._journal.clear()
        return out

    def heard(self, change: Change) -> None:
        """Another router answered (a conversation waits now) or continued (it waits no longer)."""
        if isinstance(change, Resumed):
            self._resumed(change.tail, change.grows)
            return
        age = max(0.0, time.time() - change.at)  # hosts' clocks differ a little: not in the future
        if age < self.window_s:
            self._add(change.replica, change.tails, self._clock() - age)

    def _add(self, replica: str, tails: Iterable[int], now: float) -> None:
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

    def _learn(self, grew: bool) -> None:
        self._grew = self._grew * DECAY + grew
        self._ended = self._ended * DECAY + (not grew)
