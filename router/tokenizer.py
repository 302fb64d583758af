"""A model's own tokenizer and chat template, loaded from local files (never downloaded).

With one configured, prompt keys are built from real token blocks, as the replica's KV cache is:
completions prompts are encoded with the tokenizer's special tokens (BOS), chat messages are
rendered with the model's chat template (with the generation prompt) and encoded without adding
special tokens again, as vLLM does.

``path`` is a ``tokenizer.json`` file, or a model folder holding ``tokenizer.json`` and,
optionally, ``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``) or
``chat_template.jinja``. :func:`find_local` finds a served model's folder on this host.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
from array import array
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from .incremental import WINDOW_CHARS, Ids, Incremental, OverBudget, WholeCheck, encode_whole
from .chat_template import ChatTemplate
from .render import SPECIAL_TOKENS, Unkeyable, render_chat
from .word_encoder import WordEncoder

log = logging.getLogger("kvroute.tokenizer")

# The tokenizer's own thread pool would encode at the process's priority beside the event loop: texts are
# encoded on the calling thread (router.prompt_keys runs long ones on threads of lower priority), unless set otherwise.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SEGMENT_MIN_CHARS = 256  # shorter text between added tokens is encoded each time (it is cheap)
_CACHE_TOKENS = 2_000_000  # token ids kept per tokenizer (4 bytes each)


class TokenizerError(Exception):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizer:
    """``reuse=False`` encodes every text whole (no :class:`Segments`, no :class:`~router.incremental.Incremental`;
    for comparisons)."""

    def __init__(self, path: str | Path, reuse: bool = True) -> None:
        try:
            import tokenizers
        except ImportError:
            raise TokenizerError("a tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise TokenizerError(f"cannot load {file}: {e}") from None
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        self._sources = _templates(folder, config)
        self._compiled: dict[str, ChatTemplate] = {}
        # the named special tokens every template is given (Hugging Face's special_tokens_map)
        self.special_tokens = {name: text for name in SPECIAL_TOKENS
                               if (text := _token_text(config.get(name))) is not None}
        self.bos_token = self.special_tokens.get("bos_token", "")
        self.eos_token = self.special_tokens.get("eos_token", "")
        if self._sources:
            if importlib.util.find_spec("jinja2") is None:
                raise TokenizerError("a chat template needs the 'jinja2' package: pip install jinja2")
            for name in self._sources:  # a template that does not compile is found at start, not per request
                try:
                    self._template(name)
                except Exception as e:
                    raise TokenizerError(f"chat template {name!r} does not compile: {e}") from None
        frame = special_frame(self._tok)
        self._frame = frame
        self._words = WordEncoder.of(self._tok, str(file)) if reuse else None
        self._words_check = WholeCheck(self._tok, str(file), "encoding word by word")
        self._segments = Segments.of(self._tok, str(file), frame, self._plain) if reuse else None
        self._incremental = Incremental(self._tok, str(file), frame,
                                        self._word_window if self._words is not None else None) if reuse else None

    @property
    def has_chat_template(self) -> bool:
        return bool(self._sources)

    def _template(self, name: str) -> ChatTemplate:
        got = self._compiled.get(name)
        if got is None:
            got = self._compiled[name] = ChatTemplate(self._sources[name])
        return got

    def chat_template(self, tools: bool) -> ChatTemplate:
        """The template vLLM picks: ``tool_use`` for a request with tools where there is one, else ``default``."""
        if not self._sources:
            raise Unkeyable("no_chat_template")
        if len(self._sources) == 1:
            return self._template(next(iter(self._sources)))
        if tools and "tool_use" in self._sources:
            return self._template("tool_use")
        if "default" in self._sources:
            return self._template("default")
        raise Unkeyable("no_chat_template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text`` as a list (:meth:`ids`)."""
        got = self.ids(text, add_special_tokens)
        return got.tolist() if isinstance(got, array) else got

    def ids(self, text: str, add_special_tokens: bool = True, budget: int | None = None) -> Ids:
        """The ids of ``text``: from where an earlier long text left off (:mod:`router.incremental`; an
        ``array("I")``), by pieces between added tokens (:class:`Segments`), word by word
        (:mod:`router.word_encoder`), or whole by the tokenizer library; the same ids every way.

        With a ``budget``, raises :class:`~router.incremental.OverBudget` rather than compute more than that many
        characters (or check a long text against its whole encode): the event loop keys a prompt itself where
        that is cheap, and hands it to a thread where not: the exception's ``rest`` encodes ``text`` there."""
        try:
            return self._ids(text, add_special_tokens, budget)
        except OverBudget as e:
            raise OverBudget(e.chars, partial(self._rest, text, add_special_tokens, e.rest)) from None

    def _rest(self, text: str, add_special_tokens: bool, encoder_rest: Callable[[], Ids | None] | None) -> Ids:
        """What :meth:`ids` left to a thread: the incremental encoder's rest where it left one, else (or where that
        cannot finish) the whole way again without a budget."""
        ids = encoder_rest() if encoder_rest is not None else None
        return ids if ids is not None else self._ids(text, add_special_tokens)

    def _ids(self, text: str, add_special_tokens: bool, budget: int | None = None) -> Ids:
        if self._incremental is not None:
            ids = self._incremental.encode(text, add_special_tokens, budget)
            if ids is not None:
                return ids
        if budget is not None and len(text) > budget:
            raise OverBudget(len(text))
        if self._segments is not None:
            ids = self._segments.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        if self._frame is not None or not add_special_tokens:
            words = self._words_ids(text)
            if words is not None:
                if add_special_tokens:
                    assert self._frame is not None
                    words = self._frame[0] + words + self._frame[1]
                return self._words_check(text, add_special_tokens, words)
        return encode_whole(self._tok, text, add_special_tokens)

    def _word_window(self, text: str, at: int) -> tuple[array, array] | None:
        """A window for :class:`~router.incremental.Incremental`, word by word while that encodes as the library does."""
        if self._words is None or not self._words_check.enabled:
            return None
        return self._words.encode_arrays(text, at)

    def _words_ids(self, text: str) -> list[int] | None:
        """``text``'s ids without special tokens added, word by word where that is on and the text not long (it holds
        the interpreter); None where it must go to the tokenizer library."""
        if self._words is None or not self._words_check.enabled or len(text) > WINDOW_CHARS:
            return None
        got = self._words.encode(text)
        return None if got is None else got[0]

    def _plain(self, text: str) -> list[int]:
        """``text`` without special tokens added: word by word (:meth:`_words_ids`), else by the tokenizer library."""
        ids = self._words_ids(text)
        return ids if ids is not None else encode_whole(self._tok, text, False)

    def describe(self) -> dict[str, Any]:
        out = self._segments.describe() if self._segments is not None else {"segments": "off"}
        out["incremental"] = self._incremental.describe() if self._incremental is not None else "off"
        if self._words is None:
            out["words"] = "off"
        else:
            out["words"] = {"state": "on" if self._words_check.enabled else "off (it encoded differently)",
                            **self._words.describe(), "encodes": self._words_check.encodes,
                            "checked_against_whole": self._words_check.checked}
        return out

    def render(self, payload: dict[str, Any]) -> str:
        """A chat completions body's prompt text, as vLLM renders it (raises :class:`Unkeyable`)."""
        return render_chat(self.chat_template(payload.get("tools") is not None), payload, self.special_tokens)

    def chat_ids(self, payload: dict[str, Any], budget: int | None = None) -> Ids:
        """A chat completions body's prompt token ids, as vLLM computes them (raises :class:`Unkeyable`, and
        :class:`~router.incremental.OverBudget` as :meth:`ids` does)."""
        return self.ids(self.render(payload), add_special_tokens=payload.get("add_special_tokens") is True,
                        budget=budget)

    def render_chat(self, messages: Sequence[Any]) -> str:
        """Plain messages with the generation prompt (what most requests are)."""
        return self.render({"messages": list(messages)})


class Segments:
    """Encodes long text piece by piece between the tokenizer's added tokens, keeping the pieces' ids.

    A tokenizer matches its added tokens (``<s>``, ``</s>``, ``<|eot_id|>``, ...) before anything else
    and encodes the text between them on its own, so a prompt's ids are its pieces' ids in order. Chat
    templates put such tokens between messages: the long system prompt that many requests share is
    one piece, encoded once. The pieces' ids are kept least recently used first out, up to
    ``_CACHE_TOKENS``. Whether a tokenizer really encodes that way (an added token that swallows the
    spaces beside it does not) is checked against the whole-text encode on the first encodes and now and
    then after: one difference turns the pieces off for that tokenizer, with a warning.
    """

    def __init__(self, tok: Any, name: str, added: dict[str, int], prefix: list[int], suffix: list[int],
                 plain: Callable[[str], list[int]]) -> None:
        self._tok = tok
        self._plain = plain  # text without special tokens added -> its ids
        self._ids = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._prefix, self._suffix = prefix, suffix  # what add_special_tokens puts around the text
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # encodes run on the event loop and in worker threads
        self._check = WholeCheck(tok, name, "encoding text piece by piece between its added tokens")
        self.hits = self.misses = 0

    @classmethod
    def of(cls, tok: Any, name: str, frame: tuple[list[int], list[int]] | None,
           plain: Callable[[str], list[int]]) -> "Segments | None":
        """Segments for ``tok``, or None if it has no added tokens to split at (or its frame is unknown)."""
        added = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.content}
        if not added or frame is None:
            return None
        return cls(tok, name, added, *frame, plain)

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids of ``text``, or None where the whole text must be encoded instead."""
        if not self._check.enabled or len(text) < 2 * _SEGMENT_MIN_CHARS:
            return None
        parts = self._split.split(text)
        if len(parts) == 1:
            return None  # nothing to split at (a prompt is seldom sent twice whole)
        ids: list[int] = list(self._prefix) if add_special_tokens else []
        for i, part in enumerate(parts):
            if i % 2:  # an added token
                ids.append(self._ids[part])
            elif len(part) >= _SEGMENT_MIN_CHARS:
                ids.extend(self._piece(part))
            elif part:
                ids.extend(self._plain(part))
        if add_special_tokens:
            ids.extend(self._suffix)
        return self._check(text, add_special_tokens, ids)

    def _piece(self, part: str) -> array:
        with self._lock:
            got = self._cache.get(part)
            if got is not None:
                self._cache.move_to_end(part)
                self.hits += 1
                return got
            self.misses += 1
        got = array("I", self._plain(part))
        with self._lock:
            if part not in self._cache and len(got) <= _CACHE_TOKENS // 4:
                self._cache[part] = got
                self._tokens += len(got)
                while self._tokens > _CACHE_TOKENS:
                    self._tokens -= len(self._cache.popitem(last=False)[1])
        return got

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"segments": "on" if self._check.enabled else "off (they encoded differently)",
                    "cached_pieces": len(self._cache), "cached_tokens": self._tokens, "hits": self.hits,
                    "misses": self.misses, "checked_against_whole": self._check.checked}


def special_frame(tok: Any) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens`` puts before and after a text (BOS, ...), or None if that is not how it adds
    them."""
    empty = tok.encode("", add_special_tokens=True).ids
    probe, bare = tok.encode("a", add_special_tokens=True).ids, tok.encode("a", add_special_tokens=False).ids
    for k in range(len(empty) + 1):  # where the text goes among the special tokens added around it
        if probe == empty[:k] + bare + empty[k:]:
            return empty[:k], empty[k:]
    return None


def _templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The model's chat templates by name, read as Hugging Face reads them: the ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` files first, else ``chat_template`` in ``tokenizer_config.json``."""
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text()
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            files[f.stem] = f.read_text()
    if files:
        return files
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        return {t["name"]: t["template"] for t in template
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


def _hub_caches() -> list[Path]:
    """Where the Hugging Face hub keeps downloaded models on this host (never fetched from here)."""
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return out


def _snapshot(repo: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one that has a tokenizer."""
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if (pinned / "tokenizer.json").is_file():
            return pinned
    found = [s for s in snapshots.glob("*") if (s / "tokenizer.json").is_file()] if snapshots.is_dir() else []
    return max(found, key=lambda s: s.stat().st_mtime) if found else None


def find_local(root: str | None, served: str) -> tuple[Path, str] | None:
    """A model's tokenizer folder on this host, and where it was found; None if there is none.

    ``root`` is what vLLM reports as the model's ``root`` in ``/v1/models``: the folder it loaded
    the model from, or a hub name (``org/name``), which maps to the local Hugging Face cache; the
    served name is tried as a hub name too. Nothing is downloaded.
    """
    if root:
        path = Path(root).expanduser()
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return path, f"the model's folder {path}"
    for name in (root, served):
        if not name or name.startswith(("/", ".", "~")) or name.count("/") != 1:
            continue
        for cache in _hub_caches():
            snap = _snapshot(cache / ("models--" + name.replace("/", "--")))
            if snap is not None:
                return snap, f"the Hugging Face cache ({snap})"
    return None
