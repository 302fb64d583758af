"""Prompt keys for requests: each model's tokenizer (if one is found), then :func:`router.prefix.key_for`.

``prefix.tokenizer: auto`` (the default) looks for each served model's tokenizer and chat template
on this host, never downloading: the folder vLLM reports as the model's ``root`` in ``/v1/models``
when it exists here, else the local Hugging Face cache. It says in the log which one it used, or
that it found none: then that model is keyed in byte mode. A LoRA adapter (a model whose card names another as
its ``parent``) is keyed with its base model's tokenizer, as vLLM encodes it, and is not looked for itself:
adapters may come and go at every health check. A path keys every model with that
tokenizer; ``none`` keys every model in byte mode. ``prefix.tokenizers`` names a tokenizer per model
and wins over both.

In byte mode a token counts as ``prefix.bytes_per_token`` bytes at first; the replicas' answers
(``usage.prompt_tokens``) then teach the real figure per model, and the keys follow it once it has
moved away from it: the first time by a tenth after 2 answers, later by a quarter after 8 (keys made before
a change no longer match, so the first one comes early and the rest are rare).

Long prompts are keyed on two threads of lower scheduling priority than the event loop's (the
tokenizer lets other threads run while it encodes), from where an earlier text left off
(:mod:`router.incremental`) or by pieces kept between requests (:class:`router.tokenizer.Segments`);
tokenizers are loaded in a worker thread too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from .background import Background
from .config import ConfigError, PrefixConfig
from . import errors
from .replica_events import Event, EventBus, ReplicaModels, ReplicaRemoved
from .metrics import Metrics
from .incremental import OverBudget
from .prefix import PromptKey, key_for
from .tokenizer import LocalTokenizer, TokenizerError, find_local

log = logging.getLogger("kvroute.keys")

_INLINE_ENCODE_CHARS = 8192  # a prompt is keyed on the event loop where it encodes at most this much (~0.7 ms)
_ENCODERS = 2  # threads keying long prompts side by side (the tokenizer lets them run in parallel)
_ENCODER_NICE = 10
_WARN_EVERY_S = 60.0
_FIRST_SAMPLES = 2  # answers before the first learned figure replaces the configured one
_MIN_SAMPLES = 8  # answers before a later change
_DECAY = 0.98  # weight of the past in the learned figure (about the last 50 answers count)
_FIRST_MOVE = 0.10  # relative change from the configured figure that the first learned one must show
_MOVE = 0.25  # ... and any later one: a change invalidates every key made before it, a small error costs little


def _yield_cpu() -> None:
    """Lower this thread's scheduling priority (Linux schedules each thread on its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _ENCODER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread runs at the process's priority
        pass


def _load(field: str, path: str) -> LocalTokenizer:
    try:
        return LocalTokenizer(path)
    except TokenizerError as e:
        raise ConfigError(f"invalid configuration:\n  {field}: {e}") from None


class _Calibration:
    """Bytes per token of one model in byte mode, learned from the replicas' token counts."""

    __slots__ = ("bytes", "tokens", "samples", "value", "changes")

    def __init__(self, start: float) -> None:
        self.bytes = 0.0
        self.tokens = 0.0
        self.samples = 0
        self.value = start
        self.changes = 0


class PromptKeys:
    def __init__(self, cfg: PrefixConfig, events: EventBus | None = None, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self._metrics = metrics
        self.keyed: dict[tuple[str, str], int] = {}  # prompts keyed, by (mode, reason)
        self.auto = cfg.tokenizer == "auto"
        fixed = cfg.tokenizer not in (None, "auto", "none")
        self._default = _load("prefix.tokenizer", cfg.tokenizer) if fixed and cfg.tokenizer else None
        self._by_model: dict[str, LocalTokenizer] = {
            m: _load(f"prefix.tokenizers.{m}", p) for m, p in cfg.tokenizers.items()}
        self._seen: set[str] = set(self._by_model)  # models the replicas serve (or configured)
        self._source: dict[str, str] = {m: f"prefix.tokenizers.{m}" for m in self._by_model}
        self._calibration: dict[str, _Calibration] = {}
        self._served: dict[str, frozenset[str]] = {}  # replica -> the models it serves
        self._parent: dict[str, str] = {}  # LoRA adapter -> the base model whose tokenizer keys it
        self._warned_at = -_WARN_EVERY_S
        self._unwarned = 0  # models without a tokenizer not warned about (one warning a minute at most)
        self._searching: set[str] = set()  # models whose tokenizer is being looked for, or waiting to be
        self._queue: dict[str, str | None] = {}  # those waiting (model -> root), looked for one at a time in order
        self._searcher: asyncio.Task[None] | None = None
        self._background = Background()
        # long prompts are keyed on threads of their own, at a lower scheduling priority than the event loop's,
        # so that a first-seen 100,000-token prompt takes spare CPU rather than the other requests' turn
        self._encoder = ThreadPoolExecutor(_ENCODERS, thread_name_prefix="kvroute-encode", initializer=_yield_cpu)
        if events is not None:
            events.subscribe(self._on_event)

    # -- keys ----------------------------------------------------------------------------------

    def tokenizer(self, model: str) -> LocalTokenizer | None:
        return self._by_model.get(self._keyed_as(model), self._default)

    def settled(self, model: str) -> bool:
        """How ``model``'s prompts are keyed is decided (its tokenizer was looked for, or configured)."""
        return model in self._seen and self._keyed_as(model) not in self._searching

    def bytes_per_token(self, model: str) -> float:
        c = self._calibration.get(self._keyed_as(model))
        return c.value if c is not None else self.cfg.bytes_per_token

    def _keyed_as(self, model: str) -> str:
        """The model whose tokenizer (and bytes per token) keys ``model``: its base model for a LoRA adapter,
        unless ``prefix.tokenizers`` names one for the adapter itself."""
        base = self._parent.get(model)
        return base if base is not None and model not in self.cfg.tokenizers else model

    async def key(self, path: str, payload: dict[str, Any], model: str) -> PromptKey | None:
        """The prompt's key, or None when it has none (the request is then routed by load alone)."""
        tokenizer = self.tokenizer(model)
        bpt = self.bytes_per_token(model)
        try:
            if tokenizer is None:
                key = key_for(path, payload, model, bpt)
            else:
                try:  # here where what it computes is short (a long prompt mostly seen before), else on a thread
                    key = key_for(path, payload, model, bpt, tokenizer, budget=_INLINE_ENCODE_CHARS)
                except OverBudget as e:  # its rest goes on from what was done here (a chat rendered), else anew
                    rest = e.rest or partial(key_for, path, payload, model, bpt, tokenizer)
                    key = await asyncio.get_running_loop().run_in_executor(self._encoder, rest)
        except RecursionError:  # content nested past what can be walked: the replica judges it
            log.info("prompt of a %s request nested too deeply to key; routing it by load", path)
            self._count("none", "too_deep")
            return None
        if key is None:
            self._count("none", "no_prompt")
        elif key.inexact is not None:
            self._count("bytes", key.inexact)
        elif key.in_bytes:
            self._count("bytes", "no_tokenizer")
        else:
            self._count("tokens", "")
        return key

    def _count(self, mode: str, reason: str) -> None:
        """How prompts were keyed (a fixed set of labels: modes, and the reasons of render.REASONS and here)."""
        self.keyed[(mode, reason)] = self.keyed.get((mode, reason), 0) + 1
        if self._metrics is not None:
            self._metrics.child(self._metrics.prompt_keys, mode, reason).inc()

    # -- learning bytes per token --------------------------------------------------------------

    def observe(self, model: str, key: PromptKey, prompt_tokens: int) -> None:
        """A replica counted ``prompt_tokens`` for a prompt keyed as ``key``."""
        if prompt_tokens <= 0 or not key.in_bytes:
            return  # token ids (some or all): nothing to learn
        model = self._keyed_as(model)
        c = self._calibration.get(model)
        if c is None:
            c = self._calibration[model] = _Calibration(self.cfg.bytes_per_token)
        c.bytes = c.bytes * _DECAY + key.byte_length()
        c.tokens = c.tokens * _DECAY + prompt_tokens
        c.samples += 1
        # within the configured field's range: an answer whose usage is wrong must not make blocks absurd
        learned = min(16.0, max(1.0, c.bytes / c.tokens))
        # the first change comes early: every prompt keyed before it loses its match (a conversation's
        # next turn no longer finds its first); later ones need more answers and a real move
        first = c.changes == 0
        if c.samples >= (_FIRST_SAMPLES if first else _MIN_SAMPLES) and \
                abs(learned - c.value) > (_FIRST_MOVE if first else _MOVE) * c.value:
            c.changes += 1
            log.info("prefix keys for model %s: %.2f bytes per token, learned from %d answers (was %.2f)",
                     model, learned, c.samples, c.value)
            c.value = round(learned, 2)

    # -- finding tokenizers --------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, ReplicaModels):
            self._served[event.replica] = frozenset(m for m, _, _ in event.models)
            for model, root, parent in event.models:
                if parent is not None and parent != model:
                    self._parent[model] = parent
                if model not in self._seen:
                    self._seen.add(model)
                    if self.auto and model not in self._by_model and self._keyed_as(model) == model:
                        self._searching.add(model)
                        self._queue[model] = root
            self._forget_unserved()
            if self._queue and (self._searcher is None or self._searcher.done()):
                self._searcher = self._background.spawn(self._search_queued())
        elif isinstance(event, ReplicaRemoved):
            self._served.pop(event.replica, None)
            self._forget_unserved()

    def _forget_unserved(self) -> None:
        """What this router keeps per model follows the replicas that serve it (ids come and go: LoRA adapters)."""
        served = set(self.cfg.tokenizers).union(*self._served.values())
        for model in [m for m in self._seen | set(self._calibration) | set(self._parent) if m not in served]:
            self._seen.discard(model)
            self._parent.pop(model, None)
            self._calibration.pop(model, None)
            if model in self._queue:  # not looked for yet: it need not be
                del self._queue[model]
                self._searching.discard(model)
            if model not in self.cfg.tokenizers:
                self._by_model.pop(model, None)
                self._source.pop(model, None)

    async def _search_queued(self) -> None:
        """Look for the queued models' tokenizers, one at a time: ids that churn faster than they can be looked
        for (LoRA adapters at every health check) wait in a queue that holds each model once, and leave it when
        no replica serves them any more, instead of piling up searches."""
        while self._queue:
            model = next(iter(self._queue))
            root = self._queue.pop(model)
            await self._find(model, root)

    async def _find(self, model: str, root: str | None) -> None:
        try:
            await self._search(model, root)
        finally:
            self._searching.discard(model)
            if model not in self._seen:  # no replica serves it any more
                self._by_model.pop(model, None)
                self._source.pop(model, None)

    async def _search(self, model: str, root: str | None) -> None:
        found = await asyncio.to_thread(find_local, root, model)
        if found is not None:
            folder, where = found
            try:
                self._by_model[model] = await asyncio.to_thread(LocalTokenizer, folder)
                self._source[model] = where
                log.info("prefix keys for model %s: its tokenizer from %s", model, where)
                return
            except TokenizerError as e:
                log.warning("prefix keys for model %s: cannot load the tokenizer in %s (%s)", model, where, e)
        now = time.monotonic()
        if now - self._warned_at < _WARN_EVERY_S:  # ids that come and go (adapters) must not flood the log
            self._unwarned += 1
            return
        more = f" ({self._unwarned} more models since the last such warning)" if self._unwarned else ""
        self._warned_at, self._unwarned = now, 0
        log.warning("prefix keys for model %s: no tokenizer on this host (root %r is not a local folder, nor in the "
                    "Hugging Face cache); keyed in byte mode with bytes per token learned from the replicas' "
                    "answers. For exact keys set prefix.tokenizers.%s to the model's folder%s",
                    errors.shown(model), errors.shown(root or ""), errors.shown(model), more)

    def describe(self) -> dict[str, Any]:
        """Per model seen: how its prompts are keyed."""
        models = self._seen | set(self._calibration)
        out: dict[str, Any] = {}
        for m in sorted(models):
            base = self._keyed_as(m)
            tokenizer = self.tokenizer(m)
            if tokenizer is not None:
                out[m] = {"mode": "tokens", "tokenizer": self._source.get(base, "prefix.tokenizer"),
                          "encoding": tokenizer.describe()}
            else:
                c = self._calibration.get(base)
                out[m] = {"mode": "bytes", "bytes_per_token": self.bytes_per_token(m),
                          "answers_seen": c.samples if c is not None else 0}
            if base != m:
                out[m]["keyed_as"] = base  # a LoRA adapter, keyed as its base model is
        return out

    async def close(self) -> None:
        await self._background.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)
