"""Prompt keys for requests: the tokenizer (if any) of each model, then :func:`router.prefix.key_for`.

Prompts are keyed by bytes unless a tokenizer is configured for the model (``prefix.tokenizer``
or ``prefix.tokenizers``); then by the token ids the replica's cache is keyed by. Long prompts are
tokenized in a worker thread, off the event loop (the tokenizers package releases the GIL).
"""

from __future__ import annotations

import asyncio
from typing import Any

from .config import ConfigError, PrefixConfig
from .prefix import PromptKey, key_for
from .tokenizer import LocalTokenizer, TokenizerError

_INLINE_TOKENIZE_BYTES = 8192


def _load(field: str, path: str) -> LocalTokenizer:
    try:
        return LocalTokenizer(path)
    except TokenizerError as e:
        raise ConfigError(f"invalid configuration:\n  {field}: {e}") from None


class PromptKeys:
    def __init__(self, cfg: PrefixConfig) -> None:
        self.bytes_per_token = cfg.bytes_per_token
        self._default = _load("prefix.tokenizer", cfg.tokenizer) if cfg.tokenizer else None
        self._by_model = {m: _load(f"prefix.tokenizers.{m}", p) for m, p in cfg.tokenizers.items()}

    async def key(self, path: str, payload: dict[str, Any], model: str, body_size: int = 0) -> PromptKey | None:
        tokenizer = self._by_model.get(model, self._default)
        if tokenizer is not None and body_size > _INLINE_TOKENIZE_BYTES:
            return await asyncio.to_thread(key_for, path, payload, model, self.bytes_per_token, tokenizer)
        return key_for(path, payload, model, self.bytes_per_token, tokenizer)
