"""Encoding word by word: a byte-level BPE tokenizer's own word rule run by Python's ``re``, each word's ids kept.

Byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's and their kin) cut a text into words with one regular
expression and encode each word on its own. The ``tokenizers`` library runs that expression with Oniguruma
and builds offsets for every token: about 1.7 µs per token here, most of it cutting the text. Python's
``re`` cuts the same text in a tenth of that, and prompts repeat their words, so :class:`WordEncoder`
looks a word's ids up and asks the tokenizer's model only for a word it has not seen.

It is used only where it is the same computation: a ``tokenizer.json`` with no normalizer, a BPE model
without dropout, a pre-tokenizer that is ``ByteLevel`` (GPT-2's expression) or a ``Split`` by an expression
followed by ``ByteLevel`` without its own, no prefix space, and added tokens that keep the spaces beside
them. The expression is translated (``\\p{L}``, ``\\p{N}``, ``\\s``: the Unicode classes spelled out from
this Python's character database); one with any other construct is not. The classes stop at the Basic
Multilingual Plane: a text holding a character past it, or one this Python's database does not know (the
tokenizer's may), is left to the tokenizer, as is one the expression does not cut whole. Its callers check its ids against the tokenizer's whole-text encode, on the first
encodes and now and then after, as they check every reusing encoder.

ASCII text cut by GPT-2's, Llama 3's or Qwen 2's expression is cut in C instead (``router/_wordscan.c``, each
rule written out for ASCII's classes; the tests compare it with ``re`` on random text): a long prompt's new part
then costs about a quarter of what ``re`` and the lookups in Python took. The install compiles it where a C
compiler is found; without one, ``re`` cuts everything, and the log says so when a tokenizer is loaded.

A token's place (:meth:`WordEncoder.encode`'s starts) is where its word begins: each token of a word starts
there, and an added token where it stands.
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from array import array
from functools import lru_cache
from itertools import accumulate, chain, compress, count, repeat
from typing import Any, Callable

try:
    from ._wordscan import scan as _scan
except ImportError:  # installed where it could not be compiled: words are cut by re throughout
    _scan = None
if array("I").itemsize != 4:  # the C cutter writes 32-bit ids; array("I") is that on every platform kvroute runs on
    _scan = None

log = logging.getLogger("kvroute.tokenizer")

# GPT-2's expression: what ByteLevel with use_regex cuts by (tokenizers' pre_tokenizers/byte_level.rs)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's and Qwen 2's (their tokenizer.json's Split), which differ in how many digits make a word
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}", 1)
# the expressions router/_wordscan.c cuts ASCII text by, as its rule numbers
SCAN_RULES = {GPT2_PATTERN: 0, LLAMA3_PATTERN: 1, QWEN2_PATTERN: 2}
# Unicode's White_Space property: what Oniguruma's \s matches in Unicode text (Python's adds \x1c-\x1f)
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
MAX_WORDS = 32_768  # words whose ids are kept (then the table starts over)
MAX_WORD_CHARS = 64  # longer words are encoded each time, not kept ...
MAX_WORD_TOKENS = 8  # ... as are words of more tokens (random strings, encoded data): at most ~10 MB kept in all


class NotEligible(Exception):
    """The tokenizer does not encode the way this module does (the message says why)."""


@lru_cache(maxsize=1)
def _classes() -> dict[str, str]:
    """Character-class bodies (no brackets) of the letters, numbers and unassigned or surrogate code points of the
    Basic Multilingual Plane (a class of those alone is one table lookup per character for ``re``)."""
    spans: dict[str, list[tuple[int, int]]] = {"L": [], "N": [], "C": []}
    for cp in range(0x10000):
        cat = unicodedata.category(chr(cp))
        key = cat[0] if cat[0] in "LN" else "C" if cat in ("Cn", "Cs") else None
        if key is None:
            continue
        runs = spans[key]
        if runs and runs[-1][1] == cp - 1:
            runs[-1] = (runs[-1][0], cp)
        else:
            runs.append((cp, cp))

    def body(runs: list[tuple[int, int]]) -> str:
        return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in runs)

    return {key: body(runs) for key, runs in spans.items()}


def translate(pattern: str) -> str:
    """An Oniguruma expression of the kind tokenizers cut words by, in Python's ``re`` syntax (raises
    :class:`NotEligible` for a construct whose meaning might differ)."""
    classes = _classes()
    inner = {"p{L}": classes["L"], "p{N}": classes["N"], "s": _WHITE_SPACE}
    out = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            rest = pattern[i + 1:]
            name = next((n for n in ("p{L}", "p{N}", "s") if rest.startswith(n)), None)
            if name is not None:
                out.append(inner[name] if in_class else f"[{inner[name]}]")
                i += 1 + len(name)
                continue
            if rest.startswith("S") and not in_class:
                out.append(f"[^{_WHITE_SPACE}]")
                i += 2
                continue
            if not rest or rest[0] in "pPdDwWbBhHSXRKGAzZ0123456789kgu":
                raise NotEligible(f"its word expression uses \\{rest[:1]}")
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if pattern.startswith("[^", i):
                out.append("^")
                i += 1
            i += 1
            continue
        if c == "[" and in_class:
            raise NotEligible("its word expression nests character classes")
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def _byte_chars() -> list[str]:
    """ByteLevel's printable stand-in for each byte (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()


def word_pattern(spec: dict[str, Any]) -> str:
    """The Oniguruma expression a ``tokenizer.json`` cuts words by (raises :class:`NotEligible`)."""
    if spec.get("normalizer") is not None:
        raise NotEligible("it has a normalizer")
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NotEligible(f"its model is {model.get('type')}, not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise NotEligible("its BPE model has dropout")
    pre = spec.get("pre_tokenizer") or {}

    def byte_level(p: dict[str, Any], regex: bool) -> bool:
        return p.get("type") == "ByteLevel" and not p.get("add_prefix_space") and bool(p.get("use_regex", True)) == regex

    if byte_level(pre, True):
        return GPT2_PATTERN
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if isinstance(steps, list) and len(steps) == 2 and byte_level(steps[1], False):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
        if split.get("type") == "Split" and isinstance(regex, str) and split.get("behavior") == "Isolated" \
                and not split.get("invert"):
            return regex
    raise NotEligible("its pre-tokenizer is not a byte-level word split")


class _Words(dict):
    """Word -> its ids, computed by ``compute`` on a miss; starts over past ``MAX_WORDS``."""

    def __init__(self, compute: Callable[[str], tuple[int, ...]]) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = self._compute(word)
        if len(word) <= MAX_WORD_CHARS and len(ids) <= MAX_WORD_TOKENS:
            if len(self) >= MAX_WORDS:
                self.clear()
            self[word] = ids
        return ids


class WordEncoder:
    """A tokenizer's ids for text without its special frame (``add_special_tokens=False``), word by word."""

    def __init__(self, tok: Any, pattern: str, added: dict[str, int], native: bool = True) -> None:
        self._model = tok.model
        self._findall = re.compile(translate(pattern)).findall
        # ASCII text cut in C where the expression is one it knows (the same words: tests compare the two)
        self._rule = SCAN_RULES.get(pattern) if native and _scan is not None else None
        # characters this module leaves to the tokenizer: unassigned here (maybe not there), lone surrogates, and
        # those past the Basic Multilingual Plane (the classes above stop there)
        self._foreign = re.compile(f"[{_classes()['C']}\U00010000-\U0010FFFF]").search
        self._added = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
                                 ).split if added else None
        self._words = _Words(self._word_ids)

    @classmethod
    def of(cls, tok: Any, name: str) -> "WordEncoder | None":
        """The encoder for ``tok``, or None (logged, with the reason) where it would not be the same computation."""
        try:
            spec = json.loads(tok.to_str())
            pattern = word_pattern(spec)
            added: dict[str, int] = {}
            for i, t in tok.get_added_tokens_decoder().items():
                if t.lstrip or t.rstrip or t.single_word:
                    raise NotEligible(f"its added token {t.content!r} takes the spaces or word around it")
                if t.content:
                    added[t.content] = i
            enc = cls(tok, pattern, added)
            if enc._rule is None:
                log.info("tokenizer %s: words cut by Python's re (%s)", name,
                         "kvroute's C word cutter is not compiled in this install" if _scan is None
                         else "its word expression is not GPT-2's, Llama 3's or Qwen 2's, which the C cutter knows")
            return enc
        except NotEligible as e:
            log.info("tokenizer %s: encoded by the tokenizer library throughout (%s)", name, e)
        except (re.error, ValueError, TypeError, AttributeError) as e:
            log.info("tokenizer %s: encoded by the tokenizer library throughout (%s: %s)", name, type(e).__name__, e)
        return None

    def _word_ids(self, word: str) -> tuple[int, ...]:
        mapped = "".join([_BYTE_CHARS[b] for b in word.encode("utf-8")])
        return tuple(t.id for t in self._model.tokenize(mapped))

    def encode(self, text: str, at: int = 0) -> tuple[list[int], list[int]] | None:
        """The ids of ``text`` and where each token's word begins (counted from ``at``: where ``text`` begins in a
        longer one); None where the tokenizer must encode it."""
        got = self.encode_arrays(text, at)
        return None if got is None else (got[0].tolist(), got[1].tolist())

    def encode_arrays(self, text: str, at: int = 0) -> tuple[array, array] | None:
        """:meth:`encode`'s ids and places as ``array("I")``: what :mod:`router.incremental` joins to kept ids."""
        if not text.isascii() and self._foreign(text) is not None:
            return None
        pieces = self._split(text) if self._split is not None else [text]
        ids, starts = array("I"), array("I")
        pos = at
        words = self._words
        for i, piece in enumerate(pieces):
            if i % 2:  # an added token
                ids.append(self._added[piece])
                starts.append(pos)
            elif self._rule is not None and piece.isascii():
                assert _scan is not None
                fresh, fresh_starts = _scan(piece, self._rule, pos, words)
                ids.frombytes(fresh)
                starts.frombytes(fresh_starts)
            elif piece:
                cut = self._findall(piece)
                lengths = list(map(len, cut))
                if sum(lengths) != len(piece):
                    return None  # the expression does not cover the text: not cut as the tokenizer cuts it
                entries = list(map(words.__getitem__, cut))
                before = len(ids)
                ids.extend(chain.from_iterable(entries))
                places = list(accumulate(lengths, initial=pos))
                places.pop()
                extra = len(ids) - before - len(cut)  # tokens past the first of their word's
                if not extra:  # a token per word (most words of a large vocabulary)
                    starts.extend(places)
                elif extra * 4 < len(cut):  # a few words of several tokens: their places repeated, slices between
                    counts = list(map(len, entries))
                    prev = 0
                    for w in compress(count(), map((1).__lt__, counts)):
                        starts.extend(places[prev:w + 1])
                        starts.extend(repeat(places[w], counts[w] - 1))
                        prev = w + 1
                    starts.extend(places[prev:])
                else:
                    starts.extend(chain.from_iterable(map(repeat, places, map(len, entries))))
            pos += len(piece)
        return ids, starts

    def describe(self) -> dict[str, Any]:
        return {"kept_words": len(self._words), "ascii_cut_in_c": self._rule is not None}
