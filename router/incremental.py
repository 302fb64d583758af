"""Incremental encoding: a text that begins with text encoded before encodes only what is new.

A long text is cut into blocks of ``BLOCK_CHARS`` characters, each named by a hash chained over the
blocks before it, so that a block's name stands for the whole text up to its end. For each block the
ids of the tokens that start in it are kept, with where they start. A text whose first k blocks are
known takes their ids, drops the tokens that start in the last ``MARGIN_CHARS`` of the known text (the
tokenizer may join them with what follows, as when a new block begins inside a word), and encodes the
rest from ``OVERLAP`` tokens before that point on. It joins the fresh ids to the kept ones only where
both agree on those overlapping tokens, ids and places; where they do not, the text is encoded whole.

A first-seen text is encoded the same way, window after window of ``WINDOW_CHARS``: the tokenizer
library releases the interpreter while it encodes, but building the lists of ids and offsets does not (nor
does encoding word by word), so no step holds it long, the interpreter is handed on between windows, and a
100,000-token prompt does not stall the requests beside it.

Whether a tokenizer really encodes this way is checked against the whole-text encode on its first
encodes and now and then after, as :class:`router.tokenizer.Segments` is: one difference turns
incremental encoding off for that tokenizer, with a warning. Kept ids are bounded (``CACHE_TOKENS``,
least recently used out first).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from bisect import bisect_left
from collections import OrderedDict, deque
from functools import partial
from operator import itemgetter
from typing import Any, Callable, Union

import xxhash

from .runs import Runs

log = logging.getLogger("kvroute.tokenizer")

MIN_CHARS = 4096  # shorter texts are encoded whole (or by pieces): cheap
BLOCK_CHARS = 1024  # a known text is known up to its last full block: what follows is encoded again (from the margin)
MARGIN_CHARS = 256  # tokens starting this close to the end of known text are encoded again
OVERLAP = 8  # tokens both encodes must agree on where they join
WINDOW_CHARS = 8192  # characters encoded per step (building ~2,000 ids and offsets holds the interpreter ~1 ms)
CACHE_TOKENS = 2_000_000  # token ids kept per tokenizer (8 bytes each with their places; ~18 MB in all when full)
_VERIFY_FIRST = 32  # encodes checked against the whole-text encode before trusting a reusing encoder ...
_VERIFY_FIRST_CHARS = 160_000  # ... or fewer, once this many characters were checked (four 12,000-token texts) ...
_VERIFY_EVERY = 256  # ... and after, one each time the characters encoded since reach this many times its length
_VERIFY_MAX_CHARS = 262_144  # the first encodes checked are those up to this long (a check holds the interpreter)
_RELEASE_CHARS = 2048  # texts from this long are encoded where other threads can run beside


Ids = Union[list[int], array]  # token ids: a list, or an array("I") where they were put together as one


class OverBudget(Exception):
    """Encoding the text would compute more than the caller allowed (``budget`` characters, or a check against
    encoding it whole): the caller encodes it where a long encode holds up no one (a worker thread).

    ``rest``, where given, computes what was asked from the work already done (a chat rendered into its text):
    the caller runs it there instead of starting over."""

    def __init__(self, chars: int, rest: "Callable[[], Any] | None" = None) -> None:
        super().__init__(chars)
        self.chars = chars
        self.rest = rest

    def then(self, after: "Callable[[Any], Any]") -> "OverBudget":
        """The same, with what its ``rest`` computes passed on through ``after`` (no rest where it has none)."""
        rest = self.rest
        return OverBudget(self.chars, None if rest is None else lambda: after(rest()))


def encode_whole(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``text`` encoded in one go. A long text goes through ``encode_batch``, which lets other threads run while
    it encodes (``encode`` holds the interpreter throughout: 0.4 s for a 60,000-token text here)."""
    if len(text) < _RELEASE_CHARS:
        return tok.encode(text, add_special_tokens=add_special_tokens).ids
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class WholeCheck:
    """Checks a reusing encoder's ids against encoding the whole text: its first 32 encodes (fewer where they
    reach 160,000 characters: a check of a long text costs what encoding it whole does), then one whenever the
    characters encoded since the last check reach 256 times the length of the text at hand.

    That is one encode in 256 where each computes its whole text, and as many times fewer as a text is mostly
    reused: a check encodes all of it, so checking one 12,000-token prompt in 256 that each encode 1,000 new
    tokens cost more than encoding them did (about 20 ms each, against 0.35 ms per prompt).

    One difference turns the encoder off (``enabled``) with a warning naming what it did (``doing``), and
    that text's whole ids are used.
    """

    def __init__(self, tok: Any, name: str, doing: str, first_max_chars: int | None = None) -> None:
        self._tok, self._name, self._doing, self._first_max = tok, name, doing, first_max_chars
        self._lock = threading.Lock()
        self.enabled = True
        self.encodes = self.checked = 0
        self._first_left = _VERIFY_FIRST  # first encodes still to check
        self._first_chars = 0  # characters of the first encodes checked
        self._since = 0  # characters encoded since the last check

    def _due(self, length: int, encoded: int) -> tuple[bool, bool]:
        """(among the first checks, a check due) for an encode of a text of ``length`` that computed ``encoded``."""
        first = (self._first_left > 0 and self._first_chars < _VERIFY_FIRST_CHARS
                 and (self._first_max is None or length <= self._first_max))
        return first, first or self._since + encoded >= _VERIFY_EVERY * length

    def due(self, length: int, encoded: int) -> bool:
        """Whether such an encode would be checked (encoding the whole text): a caller that cannot afford that
        here asks first."""
        with self._lock:
            return self._due(length, encoded)[1]

    def __call__(self, text: str, add_special_tokens: bool, ids: Ids, encoded: int | None = None,
                 may_check: bool = True) -> Ids:
        """``ids`` for ``text``, or its whole encode where this one is checked; ``encoded``: the characters this
        encode computed (the rest reused), all of them unless given. With ``may_check`` false a check due is left
        to the next encode (this one runs where encoding the whole text would hold up others)."""
        encoded = len(text) if encoded is None else encoded
        with self._lock:
            self.encodes += 1
            first, due = self._due(len(text), encoded)
            if due and may_check:
                self._since = 0
                if first:
                    self._first_left -= 1
                    self._first_chars += len(text)
            else:
                self._since += encoded
        if not due or not may_check:
            return ids
        whole = encode_whole(self._tok, text, add_special_tokens)
        with self._lock:
            self.checked += 1
        if whole != (ids.tolist() if isinstance(ids, array) else ids):
            self.enabled = False
            log.warning("tokenizer %s: %s differs from encoding the text whole; such texts are encoded whole from "
                        "now on", self._name, self._doing)
        return whole


RUN_BLOCKS = 8  # blocks named together: a run named before gives its blocks' hashes without hashing each
_runs = Runs(4096)  # texts' runs (about 3 MB when full)
_RUN_SEED = xxhash.xxh3_64_intdigest(b"runs of text blocks")


def block_hashes(text: str) -> list[int]:
    """The chained hashes of the full blocks of ``text``, found run by run (:mod:`router.runs`): a run named before
    (a conversation's earlier turns, a shared document) gives its blocks' hashes at once."""
    data = memoryview(text.encode("ascii")) if text.isascii() else text  # ASCII: blocks are byte slices
    return _runs.chain(data, BLOCK_CHARS, RUN_BLOCKS, 0, _RUN_SEED)


_IDS, _STARTS = itemgetter(0), itemgetter(1)  # of a kept block


# (text, where it begins in the whole) -> (its ids, where each token starts in the whole), or None
Window = Callable[[str, int], "tuple[Ids, Ids] | None"]


def library_window(tok: Any) -> Window:
    """Windows encoded by the tokenizer library (its tokens' offsets as their places)."""
    def encode(text: str, at: int) -> tuple[list[int], list[int]]:
        enc = tok.encode_batch([text], add_special_tokens=False)[0]
        return enc.ids, [o[0] + at for o in enc.offsets]
    return encode


class Incremental:
    """Incremental encoding for one tokenizer (``tok``: a ``tokenizers.Tokenizer``).

    ``frame`` is what ``add_special_tokens`` puts around a text (ids before, ids after), or None when
    that is not known: texts with special tokens added are then encoded whole. ``window`` encodes the new
    text (:func:`library_window` unless given; :class:`router.word_encoder.WordEncoder` gives a faster one);
    every window of a text and every kept block must come from the same one, as places are its own.
    """

    def __init__(self, tok: Any, name: str, frame: tuple[list[int], list[int]] | None,
                 window: Window | None = None) -> None:
        self._tok = tok
        self._window = window or library_window(tok)
        self._name = name
        self._frame = frame
        # hash -> (ids, starts) of the tokens starting in the block, as the bytes of arrays of "I" (joined at once)
        self._blocks: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # encodes run in worker threads side by side
        self._check = WholeCheck(tok, name, "encoding a long text from where an earlier one left off",
                                 _VERIFY_MAX_CHARS)
        self.reused = self.fresh = self.unjoined = 0

    def encode(self, text: str, add_special_tokens: bool, budget: int | None = None) -> array | None:
        """The ids of ``text`` (an ``array("I")``), or None where it must be encoded another way; raises
        :class:`OverBudget` before encoding more than ``budget`` characters where one is given, its ``rest`` going
        on from the blocks found here."""
        if not self._check.enabled or len(text) < MIN_CHARS or (add_special_tokens and self._frame is None):
            return None
        hashes = block_hashes(text)
        with self._lock:
            found = list(map(self._blocks.get, hashes))
            known = found.index(None) if None in found else len(found)
            deque(map(self._blocks.move_to_end, hashes[:known]), maxlen=0)  # used: last out
        encoded = len(text) - max(0, known * BLOCK_CHARS - MARGIN_CHARS)  # what the windows compute (about)
        if budget is not None and (encoded > budget or self._check.due(len(text), encoded)):
            # before the kept ids are joined: the thread that takes it over joins them
            raise OverBudget(encoded, partial(self._finish, text, add_special_tokens, hashes, found, known, encoded))
        return self._finish(text, add_special_tokens, hashes, found, known, encoded, may_check=budget is None)

    def _finish(self, text: str, add_special_tokens: bool, hashes: list[int], found: list[Any], known: int,
                encoded: int, may_check: bool = True) -> array | None:
        """:meth:`encode` from the kept blocks found: their ids joined, the rest of the text encoded."""
        ids, starts = array("I"), array("I")
        kept = found[:known]
        ids.frombytes(b"".join(map(_IDS, kept)))
        starts.frombytes(b"".join(map(_STARTS, kept)))
        reused = len(ids)
        joined = self._extend(text, ids, starts, known * BLOCK_CHARS)
        if not joined:
            if joined is False:
                with self._lock:
                    self.unjoined += 1
            return None
        self._keep(hashes, known, ids, starts)
        with self._lock:
            self.reused += min(reused, len(ids))
            self.fresh += max(0, len(ids) - reused)
        if add_special_tokens:
            assert self._frame is not None
            framed = array("I", self._frame[0])
            framed += ids
            framed.extend(self._frame[1])
            ids = framed
        return self._check(text, add_special_tokens, ids, encoded, may_check=may_check)

    def _extend(self, text: str, ids: array, starts: array, pos: int) -> bool | None:
        """Complete ``ids`` (the tokens of ``text`` up to ``pos``, the last ones maybe unfinished) to the end of
        ``text``, a window at a time; False where fresh ids do not join the kept ones, None where a window cannot
        be encoded this way."""
        end = len(text)
        while True:
            # keep the tokens that start before pos - MARGIN, and encode again from OVERLAP tokens before the
            # first one dropped (at the end of the text too: the kept text may have gone on differently)
            j = bisect_left(starts, max(0, pos - MARGIN_CHARS))
            j0 = max(0, j - OVERLAP)
            if j0 < len(ids):  # from the first token that starts there (a word's tokens share their word's start)
                j0 = bisect_left(starts, starts[j0], 0, j0)
            at = starts[j0] if j0 < len(ids) else (pos if ids else 0)
            stop = min(end, at + WINDOW_CHARS)
            if stop <= pos < end:
                return False  # a token longer than a window: no progress this way
            got = self._window(text[at:stop], at)
            if got is None:
                return None
            fresh, places = got
            agree = j - j0
            if agree:
                if list(fresh[:agree]) != ids[j0:j].tolist() or \
                        any(places[i] != starts[j0 + i] for i in range(agree)):
                    return False
            del ids[j0:], starts[j0:]
            ids.extend(fresh)
            starts.extend(places)
            if stop >= end:
                return True
            pos = stop
            # between windows the interpreter is let go: a thread waiting for it (the event loop) takes it now rather
            # than after the switch interval (5 ms). A sleep, not a yield: the waiter needs the moment to wake up.
            time.sleep(0)

    def _keep(self, hashes: list[int], known: int, ids: array, starts: array) -> None:
        """Keep the ids of the blocks not known before: those of the tokens that start in each."""
        if known >= len(hashes):
            return
        blocks = []
        for i in range(known, len(hashes)):
            lo = bisect_left(starts, i * BLOCK_CHARS)
            hi = bisect_left(starts, (i + 1) * BLOCK_CHARS)
            blocks.append((hashes[i], ids[lo:hi].tobytes(), starts[lo:hi].tobytes()))
        with self._lock:
            for h, block_ids, block_starts in blocks:
                if h in self._blocks:
                    continue
                self._blocks[h] = (block_ids, block_starts)
                self._tokens += len(block_ids) // 4
            while self._tokens > CACHE_TOKENS and self._blocks:
                self._tokens -= len(self._blocks.popitem(last=False)[1][0]) // 4

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"state": "on" if self._check.enabled else "off (it encoded differently)",
                    "kept_blocks": len(self._blocks), "kept_tokens": self._tokens, "encodes": self._check.encodes,
                    "reused_tokens": self.reused, "encoded_tokens": self.fresh, "not_joined": self.unjoined,
                    "checked_against_whole": self._check.checked}
