"""Prompt keys: a request's prompt as a chain of block-sized prefix hashes.

The prompt becomes one canonical sequence of units (bytes without a tokenizer, token ids with
one), cut into blocks of the replica's KV block size, each block hashed with xxh3_64 seeded by
the previous block's hash. The first block is seeded by the model name, the LoRA adapter and
``cache_salt``, so equal text under another model or salt never matches. Block k's hash thus
stands for the whole prefix up to block k: two requests share a block hash exactly when they
share everything before and in that block. There is no per-process seed: every router process
computes the same chain.

Only full blocks are hashed, as vLLM caches only full blocks. Only the hashes leave this module;
prompt text is never stored or logged.

Canonical forms:

- with the model's tokenizer: the token ids vLLM computes (chat rendered as :mod:`router.render`
  says, completions text encoded with its special tokens); a request whose ids cannot be known
  here is keyed by bytes as below, with the reason in :attr:`PromptKey.inexact`.
- completions in byte mode: the prompt string (UTF-8); a list of token ids is keyed as ids; a list
  of prompts gives one chain per prompt.
- chat in byte mode: the messages in order, each as its role and its content parts (text, image
  URLs, tool calls, tool call ids, names), so that the messages of turn n are a prefix of those of
  turn n+1.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, Union

import xxhash

from .incremental import OverBudget
from .render import Unkeyable
from .runs import Runs

if TYPE_CHECKING:
    from .tokenizer import LocalTokenizer

_BIG_ENDIAN = sys.byteorder == "big"
Prompt = Union[bytes, list[int], array]  # a prompt in bytes (byte mode) or token ids (a list, or an array("I"))
_ROLE = b"\x1e"  # record separator before each message
_PART = b"\x1f"  # unit separator between the fields of a message


def _text(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _content(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return _text(content)
    if isinstance(content, list):
        out = bytearray()
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind == "text":
                    out += b"text" + _PART + _text(part.get("text", ""))
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    out += b"image" + _PART + _text(url or "")
                else:
                    out += _text(part)
            else:
                out += _text(part)
            out += _PART
        return bytes(out)
    return _text(content)


def chat_bytes(messages: Sequence[Any]) -> bytes:
    """The canonical byte form of a list of chat messages."""
    out = bytearray()
    for m in messages:
        if not isinstance(m, dict):
            out += _ROLE + _text(m)
            continue
        out += _ROLE + _text(str(m.get("role", ""))) + _PART + _content(m.get("content"))
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                out += _PART + key.encode() + _PART + _text(m[key])
        if m.get("tool_calls"):
            out += _PART + b"tool_calls" + _PART + _text(m["tool_calls"])
    return bytes(out)


def root_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    return xxhash.xxh3_64_intdigest(b"\x00".join(
        (model.encode(), (lora or "").encode(), (cache_salt or "").encode())))


_RUN_BYTES = 2048  # a run of blocks about this long is named by one hash, and its blocks' hashes kept under it
_runs = Runs(4096)  # prompts' runs (about 6 MB when full)


def chain_bytes(data: bytes | memoryview, block_bytes: int, seed: int, remember: bool = False) -> list[int]:
    """Hashes of the full ``block_bytes``-sized blocks of ``data``, each seeded by the previous.

    With ``remember`` (prompts: their heads recur; not the blocks of KV events, which do not) a long text's
    blocks are hashed run by run (:mod:`router.runs`; the run names seeded by ``seed`` and ``block_bytes``): a
    prompt that shares 11,000 tokens with an earlier one hashes its blocks only past them.
    """
    per_run = max(4, _RUN_BYTES // block_bytes)
    if not (remember and len(data) // block_bytes >= 2 * per_run):
        per_run = 0
    name = xxhash.xxh3_64_intdigest(block_bytes.to_bytes(8, "little"), seed=seed) if per_run else 0
    return _runs.chain(memoryview(data), block_bytes, per_run, seed, name)


def chain_tokens(ids: Sequence[int], block_tokens: int, seed: int, remember: bool = False) -> list[int]:
    """Hashes of the full blocks of token ids (each id packed as 4 little-endian bytes)."""
    n = len(ids) - len(ids) % block_tokens
    if n == 0:
        return []
    if isinstance(ids, array) and ids.typecode == "I" and ids.itemsize == 4:
        packed = ids[:n] if n < len(ids) or _BIG_ENDIAN else ids
        if _BIG_ENDIAN:
            packed.byteswap()
        return chain_bytes(memoryview(packed).cast("B"), block_tokens * 4, seed, remember)
    try:
        packed = array("I", ids[:n])  # 4-byte unsigned on every platform CPython builds for
        if _BIG_ENDIAN:
            packed.byteswap()
        data = packed.tobytes()
    except (OverflowError, TypeError):  # an id out of 32 bits (a client's token-id prompt): masked, as before
        data = struct.pack(f"<{n}I", *(i & 0xFFFFFFFF for i in ids[:n]))
    return chain_bytes(data, block_tokens * 4, seed, remember)


def _tokens(prompt: Prompt, bytes_per_token: float) -> int:
    return math.ceil(len(prompt) / bytes_per_token) if isinstance(prompt, bytes) else len(prompt)


def block_bytes(block_tokens: int, bytes_per_token: float) -> int:
    """Bytes per KV block in byte mode."""
    return max(1, round(block_tokens * bytes_per_token))


@dataclass
class PromptKey:
    """What routing knows of a request's prompt(s): their units and their chains per block size.

    Each prompt is bytes (byte mode: a token counts as ``bytes_per_token`` bytes) or token ids.
    """

    model: str
    seed: int
    prompts: list[Prompt]
    bytes_per_token: float
    inexact: str | None = None  # why a request whose model has a tokenizer is keyed by bytes (render.REASONS)
    _chains: dict[int, list[list[int]]] = field(default_factory=dict)

    @property
    def in_bytes(self) -> bool:
        """Every prompt is keyed by bytes (byte mode): its length in tokens is an estimate."""
        return all(isinstance(p, bytes) for p in self.prompts)

    def byte_length(self) -> int:
        """Bytes of the byte-mode prompts (what calibration divides by the replica's token count)."""
        return sum(len(p) for p in self.prompts if isinstance(p, bytes))

    def prompt_tokens(self) -> list[int]:
        """Prompt length in tokens (estimated in byte mode), per prompt."""
        return [_tokens(p, self.bytes_per_token) for p in self.prompts]

    def chains(self, block_tokens: int) -> list[list[int]]:
        """One hash chain per prompt for KV blocks of ``block_tokens`` tokens (computed once per size)."""
        got = self._chains.get(block_tokens)
        if got is None:
            got = [chain_bytes(p, block_bytes(block_tokens, self.bytes_per_token), self.seed, remember=True)
                   if isinstance(p, bytes) else chain_tokens(p, block_tokens, self.seed, remember=True)
                   for p in self.prompts]
            self._chains[block_tokens] = got
        return got


def _responses_messages(payload: dict[str, Any]) -> list[Any]:
    """A /v1/responses body's instructions and input as messages (for byte keys)."""
    out: list[Any] = []
    if isinstance(payload.get("instructions"), str):
        out.append({"role": "system", "content": payload["instructions"]})
    items = payload.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
    elif isinstance(items, list):
        out.extend(items)
    return out


def _encode_completion(tokenizer: "LocalTokenizer | None", text: str, special: bool, budget: int | None) -> Prompt:
    return tokenizer.ids(text, add_special_tokens=special, budget=budget) if tokenizer is not None else _text(text)


def _alone(ids: Prompt) -> tuple[list[Prompt], None]:
    """A request's one prompt, keyed exactly (what :func:`prompts_of` answers for it)."""
    return [ids], None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value)


def prompts_of(path: str, payload: dict[str, Any], tokenizer: "LocalTokenizer | None" = None,
               budget: int | None = None) -> tuple[list[Prompt] | None, str | None]:
    """The canonical prompt(s) of a request body in byte/id form (None if it has none to key), and why
    they are bytes though a tokenizer was given (one of :data:`router.render.REASONS`), else None.

    With a tokenizer, text becomes the token ids vLLM computes: chat rendered as vLLM renders it
    (:mod:`router.render`), completions encoded with the special tokens unless ``add_special_tokens``
    is false. ``budget``: as :meth:`router.tokenizer.LocalTokenizer.ids` takes it, for the request's texts together.
    """
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None, None
        if tokenizer is None:
            return [chat_bytes(messages)], None
        try:
            return [tokenizer.chat_ids(payload, budget)], None
        except OverBudget as e:  # rendered: what is left is encoding its text
            raise e.then(_alone) from None
        except Unkeyable as e:  # the replica's ids cannot be known here: the bytes still group alike requests
            return [chat_bytes(messages)], e.reason
    if path == "/v1/responses":
        if payload.get("previous_response_id") is not None:
            return None, None  # its prompt begins with the stored conversation, on the one replica holding it
        messages = _responses_messages(payload)
        if not messages:
            return None, None
        return [chat_bytes(messages)], "api_conversion" if tokenizer is not None else None
    if path == "/v1/messages":  # Anthropic's: the system prompt, then the messages
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None, None
        system = payload.get("system")
        head = [{"role": "system", "content": system}] if system is not None else []
        return [chat_bytes(head + messages)], "api_conversion" if tokenizer is not None else None
    if path == "/v1/completions":
        prompt = payload.get("prompt")
        if tokenizer is not None:
            if payload.get("prompt_embeds") is not None:
                return ([_text(prompt)] if isinstance(prompt, str) else None), "prompt_embeds"
            if payload.get("truncate_prompt_tokens") is not None:
                return prompts_of(path, payload)[0], "truncated"
        special = payload.get("add_special_tokens", True) is not False
        if isinstance(prompt, str):
            try:
                return [_encode_completion(tokenizer, prompt, special, budget)], None
            except OverBudget as e:
                raise e.then(_alone) from None
        if _is_ids(prompt):
            return [list(prompt)], None
        if isinstance(prompt, list) and prompt:
            if budget is not None and tokenizer is not None:  # a batch is keyed inline only where it is short in all
                texts = sum(len(p) for p in prompt if isinstance(p, str))
                if texts > budget:
                    raise OverBudget(texts)
            out: list[Prompt] = []
            for p in prompt:
                if isinstance(p, str):
                    try:
                        out.append(_encode_completion(tokenizer, p, special, budget))
                    except OverBudget as e:  # one prompt of several: the batch is keyed again from the start
                        raise OverBudget(e.chars) from None
                elif _is_ids(p):
                    out.append(list(p))
            return out or None, None
    return None, None


def key_for(path: str, payload: dict[str, Any], model: str, bytes_per_token: float = 4,
            tokenizer: "LocalTokenizer | None" = None, budget: int | None = None) -> PromptKey | None:
    """The request's prompt key (None where it has no prompt to key). With a ``budget``, raises
    :class:`~router.incremental.OverBudget` as :meth:`router.tokenizer.LocalTokenizer.ids` does; its ``rest``,
    where it has one, computes the key from what was done here (a chat's rendering)."""
    try:
        prompts, inexact = prompts_of(path, payload, tokenizer, budget)
    except OverBudget as e:
        raise e.then(lambda got: _key(payload, model, bytes_per_token, *got)) from None
    return _key(payload, model, bytes_per_token, prompts, inexact)


def _key(payload: dict[str, Any], model: str, bytes_per_token: float, prompts: list[Prompt] | None,
         inexact: str | None) -> PromptKey | None:
    if not prompts:
        return None
    lora = payload.get("lora_request") or payload.get("lora_name")
    salt = payload.get("cache_salt")
    seed = root_seed(model, lora if isinstance(lora, str) else None, salt if isinstance(salt, str) else None)
    return PromptKey(model, seed, prompts, bytes_per_token, inexact)
