"""The stand-in replica's Responses API and Anthropic Messages API, shaped as vLLM 0.32 answers them.

``tests/fixtures/vllm-apis/`` holds the real replica's answers these follow: a response and its
event stream, a Messages answer and its event stream, and the 404 for an unknown response id.
Responses are stored (``--store-responses``, vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the
replica's own memory, and only there: another replica answers 404 for them, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Iterator

MAX_STORED = 10_000  # responses kept per replica (oldest out first)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (event.encode(), json.dumps(data, separators=(",", ":")).encode())


def invalid(path: str, req: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) of the first field vLLM's Responses or Messages request model would refuse, or None."""
    if path == "/v1/responses":
        checks = [("input", (str, list), True), ("instructions", (str,), False),
                  ("previous_response_id", (str,), False), ("request_id", (str,), False), ("store", (bool,), False)]
    else:
        checks = [("messages", (list,), True), ("system", (str, list), False)]
    for field, types, required in checks:
        v = req.get(field)
        if (v is None and required) or (v is not None and not isinstance(v, types)):
            return field, f"1 validation error:\n  {{'type': 'invalid_type', 'loc': ('body', '{field}'), 'input': {v!r:.40}}}"
    return None


def not_found(response_id: str) -> dict[str, Any]:
    return {"error": {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error",
                      "param": "response_id", "code": 404}}


def messages_of(req: dict[str, Any], previous: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation a /v1/responses request continues, as chat messages (for its prompt's tokens)."""
    out = list(previous or [])
    if isinstance(req.get("instructions"), str) and not previous:
        out.append({"role": "system", "content": req["instructions"]})
    items = req.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
    elif isinstance(items, list):
        out += _flat(items)
    return out


def _text(content: Any) -> str:
    """A message's content as one string (text blocks joined)."""
    if isinstance(content, list):
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return content if isinstance(content, str) else ""


def _flat(messages: list[Any]) -> list[dict[str, Any]]:
    return [{"role": str(m.get("role", "user")), "content": _text(m.get("content"))}
            for m in messages if isinstance(m, dict)]


class StoredResponses:
    """This replica's stored responses: the answer and the conversation it ended."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        return self._items.get(response_id)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > MAX_STORED:
            self._items.popitem(last=False)


def response_object(rid: str, model: str, req: dict[str, Any], text: str | None, input_tokens: int, cached: int,
                    output_tokens: int, msg_id: str, created: int, complete: bool) -> dict[str, Any]:
    max_out = req.get("max_output_tokens")
    output = [] if text is None else [{
        "id": msg_id, "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
        "role": "assistant", "status": "completed", "type": "message", "phase": None}]
    usage = None if not complete else {
        "input_tokens": input_tokens, "input_tokens_details": {
            "cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output_tokens, "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": input_tokens + output_tokens}
    stopped = complete and max_out is not None and output_tokens >= max_out
    return {"id": rid, "created_at": created, "incomplete_details": {"reason": "max_output_tokens"} if stopped else None,
            "instructions": req.get("instructions"), "metadata": req.get("metadata"), "model": model,
            "object": "response", "output": output, "parallel_tool_calls": True, "temperature": 1.0,
            "tool_choice": "none", "tools": [], "top_p": 1.0, "background": False, "max_output_tokens": max_out,
            "max_tool_calls": None, "previous_response_id": req.get("previous_response_id"), "prompt": None,
            "reasoning": None, "service_tier": "auto",
            "status": ("incomplete" if stopped else "completed") if complete else "in_progress", "text": None,
            "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": None, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None}


def response_events(rid: str, model: str, req: dict[str, Any], pieces: list[str], input_tokens: int,
                    cached: int) -> Iterator[bytes]:
    """The event stream of one response, an event at a time (the caller paces the deltas)."""
    created = int(time.time())
    msg_id = f"msg_{uuid.uuid4().hex[:16]}"
    seq = 0

    def event(kind: str, data: dict[str, Any]) -> bytes:
        nonlocal seq
        out = _sse(kind, {**data, "sequence_number": seq, "type": kind})
        seq += 1
        return out

    start = response_object(rid, model, req, None, input_tokens, cached, 0, msg_id, created, False)
    yield event("response.created", {"response": start})
    yield event("response.in_progress", {"response": start})
    yield event("response.output_item.added", {"item": {"id": msg_id, "content": [], "role": "assistant",
                                                        "status": "in_progress", "type": "message", "phase": None},
                                               "output_index": 0})
    part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    yield event("response.content_part.added", {"content_index": 0, "item_id": msg_id, "output_index": 0, "part": part})
    for piece in pieces:
        yield event("response.output_text.delta", {"content_index": 0, "delta": piece, "item_id": msg_id,
                                                   "logprobs": [], "output_index": 0})
    text = "".join(pieces)
    yield event("response.output_text.done", {"content_index": 0, "item_id": msg_id, "logprobs": [],
                                              "output_index": 0, "text": text})
    yield event("response.content_part.done", {"content_index": 0, "item_id": msg_id, "output_index": 0, "part": {
        "annotations": [], "text": text, "type": "output_text", "logprobs": None}})
    done = response_object(rid, model, req, text, input_tokens, cached, len(pieces), msg_id, created, True)
    yield event("response.output_item.done", {"item": done["output"][0], "output_index": 0})
    yield event("response.completed", {"response": done})


def message_object(model: str, text: str, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": text}], "model": model, "stop_reason": "max_tokens",
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def message_events(model: str, pieces: list[str], input_tokens: int) -> Iterator[bytes]:
    start = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "type": "message", "role": "assistant", "content": [],
             "model": model, "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    yield _sse("message_start", {"type": "message_start", "message": start})
    yield _sse("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
                                       "index": 0})
    for piece in pieces:
        yield _sse("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": piece},
                                           "index": 0})
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                 "usage": {"input_tokens": input_tokens, "output_tokens": len(pieces)}})
    yield _sse("message_stop", {"type": "message_stop"})


def anthropic_messages(req: dict[str, Any]) -> list[dict[str, Any]]:
    """A /v1/messages body as chat messages (for its prompt's tokens)."""
    system = req.get("system")
    head = [{"role": "system", "content": _text(system)}] if system is not None else []
    return head + _flat(req.get("messages") or [])
