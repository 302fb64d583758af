"""Mid-stream failover: a stream whose replica fails after it started goes on on another replica.

While a stream is relayed byte for byte, a :class:`Transcript` reads a copy of its events and keeps
what a continuation needs: the text generated so far, how many tokens that was, and the stream's
``id``, ``created`` and ``model``. When the replica breaks the stream (or falls silent), the proxy
sends :func:`continuation` of the request to another replica (completions: the text appended to
the prompt; chat: the text as a final assistant message with vLLM's ``continue_final_message``),
with ``max_tokens`` reduced by what was produced, and relays that stream through a :class:`Splice`,
which makes its chunks the rest of the first one: the same ``id``, ``created`` and ``model``, no
second role chunk, and usage totals counting both parts.

Only requests whose continuation is the same generation qualify (:func:`transcript_for`): one
choice, no log probabilities, no structured output, no beam search; a stream that turns to tool
calls or reasoning stops qualifying. A token is counted per content chunk: vLLM sends one per token
(with empty text for a token that completes no character yet), unless its API server fell behind
its engine and merged several into one chunk; then the continuation may generate that many more.
"""

from __future__ import annotations

from typing import Any

import orjson

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
# request fields that make a continuation a different generation (structured output restarts its grammar)
_NOT_RESUMABLE = ("logprobs", "top_logprobs", "prompt_logprobs", "use_beam_search", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar", "structured_outputs")
_MAX_EVENT = 1 << 20  # an event larger than this is not one vLLM sends: the transcript gives up on the stream


class SpliceError(Exception):
    """The continuation's stream cannot be read as vLLM's: it counts as a broken stream of that replica."""


def why_not(path: str, payload: dict[str, Any]) -> str | None:
    """None if a stream of this request can be continued on another replica, else the reason it cannot."""
    if path not in (_CHAT, _COMPLETIONS):
        return "endpoint"
    if payload.get("n") not in (None, 1) or payload.get("best_of") not in (None, 1):
        return "several_choices"
    for field in _NOT_RESUMABLE:
        value = payload.get(field)
        if value is not None and value is not False:  # logprobs: 0 asks for them too
            return field
    fmt = payload.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "response_format"
    if path == _COMPLETIONS:
        prompt = payload.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                            and isinstance(prompt[0], str))):
            return "prompt_not_text"
    elif payload.get("continue_final_message"):
        last = payload["messages"][-1] if payload["messages"] else None
        if not (isinstance(last, dict) and isinstance(last.get("content"), str)):
            return "prompt_not_text"
    return None


def transcript_for(path: str, payload: dict[str, Any]) -> "Transcript | None":
    """A transcript to keep while the stream of this request is relayed, or None if it cannot be resumed."""
    if why_not(path, payload) is not None:
        return None
    usage = payload.get("stream_options")
    include_usage = isinstance(usage, dict) and bool(usage.get("include_usage"))
    return Transcript(path == _CHAT, include_usage)


class Events:
    """Splits a stream of server-sent events into whole events, holding back the start of the next one."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def split(self, chunk: bytes) -> tuple[bytes, list[bytes]]:
        """The bytes of the events ``chunk`` completes, and each of those events without its blank line."""
        data = self._pending + chunk if self._pending else chunk
        events: list[bytes] = []
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            events.append(data[start:end])
            start = end + 2
        self._pending = data[start:]
        return data[:start], events

    def oversized(self) -> bool:
        """The event held back is longer than any stream of vLLM's would send."""
        return len(self._pending) > _MAX_EVENT

    def take(self) -> bytes:
        """The bytes held back, which are no longer held."""
        held, self._pending = self._pending, b""
        return held


class Transcript:
    """What one stream has carried so far (reads copies of its bytes; sends nothing)."""

    __slots__ = ("chat", "include_usage", "parts", "tokens", "id", "created", "model", "finished", "usage_sent",
                 "role_sent", "unusable", "_events")

    def __init__(self, chat: bool, include_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage  # the client asked for a usage chunk at the end
        self.parts: list[str] = []  # the generated text, in pieces
        self.tokens = 0  # tokens generated so far (one per content chunk)
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.finished = False  # a choice carried its finish_reason: all content has been sent
        self.usage_sent = False  # the final usage chunk has been sent
        self.role_sent = False  # a chat stream's first chunk, with the assistant's role, has been sent
        self.unusable: str | None = None  # why the stream can no longer be continued
        self._events = Events()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def resumable(self) -> bool:
        return self.unusable is None

    def feed(self, chunk: bytes) -> bytes:
        """Read the stream's next bytes; returns those the client may have now: whole events only, so that a
        stream broken mid-event leaves no half event before the continuation (vLLM writes whole events, so
        this holds nothing back in practice)."""
        if self.unusable is not None:
            return self._events.take() + chunk
        whole, events = self._events.split(chunk)
        for raw in events:
            self._event(raw)
        if self._events.oversized():
            self.unusable = "oversized_event"
            return whole + self._events.take()
        return whole

    def flush(self) -> bytes:
        """Bytes held back from the client (the end of a stream that was not a whole event)."""
        return self._events.take()

    def _event(self, raw: bytes) -> None:
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload and payload != b"[DONE]":
                    try:
                        self.note(orjson.loads(payload))
                    except (ValueError, TypeError, KeyError, AttributeError):
                        self.unusable = "unreadable_event"
                return

    def note(self, event: Any) -> None:
        """One decoded chunk of the stream."""
        if not isinstance(event, dict):
            return
        if "error" in event:
            self.unusable = "error_event"
            return
        if self.id is None:
            self.id, self.created, self.model = event.get("id"), event.get("created"), event.get("model")
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.unusable = "several_choices"
                return
            if self.chat:
                delta = choice.get("delta") or {}
                if "role" in delta:
                    self.role_sent = True
                if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                    self.unusable = "tool_calls" if delta.get("tool_calls") else "reasoning"
                    return
                if "content" in delta and "role" not in delta:  # "" too: a token that adds no text yet
                    self.parts.append(delta["content"] or "")
                    self.tokens += 1
            else:
                self.parts.append(choice.get("text") or "")
                self.tokens += 1
            if choice.get("finish_reason") is not None:
                self.finished = True
        if event.get("usage") and not event.get("choices"):
            self.usage_sent = True

    def closing(self, prompt_tokens: int) -> bytes:
        """The end of a stream whose content was all sent before the replica broke it: the usage chunk
        the client asked for (the prompt as the router counted it) and ``[DONE]``."""
        out = b""
        if self.include_usage and not self.usage_sent:
            usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + self.tokens,
                     "completion_tokens": self.tokens}
            event = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": self.created, "model": self.model, "choices": [], "usage": usage}
            out = b"data: " + orjson.dumps(event) + b"\n\n"
        return out + b"data: [DONE]\n\n"


def continuation(path: str, body: bytes, transcript: Transcript) -> bytes:
    """The request that makes another replica generate the rest of the stream."""
    if transcript.tokens == 0 and not transcript.text:
        return body  # nothing generated yet: the same request again
    payload = orjson.loads(body)
    text = transcript.text
    if path == _COMPLETIONS:
        prompt = payload["prompt"]
        payload["prompt"] = (prompt if isinstance(prompt, str) else prompt[0]) + text
        payload["echo"] = False  # the client has had the prompt once (a chat's last message likewise)
    elif payload.get("continue_final_message"):
        messages = list(payload["messages"])
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
        payload["messages"] = messages
    else:
        payload["messages"] = [*payload["messages"], {"role": "assistant", "content": text}]
        payload["continue_final_message"] = True
        payload["add_generation_prompt"] = False
    if "echo" in payload:
        payload["echo"] = False
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = payload.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            payload[field] = max(0 if field == "min_tokens" else 1, value - transcript.tokens)
    return orjson.dumps(payload)


class Splice:
    """Turns a continuation's stream into the rest of the first one, event by event."""

    __slots__ = ("transcript", "before", "_events")

    def __init__(self, transcript: Transcript) -> None:
        self.transcript = transcript
        self.before = transcript.tokens  # tokens the earlier parts produced
        self._events = Events()

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send on for ``chunk`` of the continuation (complete events only)."""
        _, events = self._events.split(chunk)
        out = b"".join([self._event(raw) for raw in events])
        if self._events.oversized():
            raise SpliceError("the continuation sent an oversized event")
        return out

    def _event(self, raw: bytes) -> bytes:
        line = raw.strip()
        if not line.startswith(b"data:"):
            return raw + b"\n\n" if line else b""
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return b"data: [DONE]\n\n"
        try:
            event = orjson.loads(payload)
        except ValueError as e:
            raise SpliceError(f"the continuation sent an event that is not JSON: {e}") from None
        t = self.transcript
        if isinstance(event, dict) and "error" not in event:
            if t.id is not None:  # else the client has had no chunk yet: this one's id is the stream's
                event["id"], event["created"], event["model"] = t.id, t.created, t.model
            choices = event.get("choices") or []
            if t.chat and t.role_sent and choices and all(_role_only(c) for c in choices):
                return b""  # the client had the role with the first part
            usage = event.get("usage")
            if isinstance(usage, dict):
                # the continuation's prompt holds the text generated before it
                prompt = max(0, int(usage.get("prompt_tokens") or 0) - self.before)
                completion = int(usage.get("completion_tokens") or 0) + self.before
                usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    details["cached_tokens"] = min(details["cached_tokens"], prompt)
        t.note(event)
        return b"data: " + orjson.dumps(event) + b"\n\n"


def _role_only(choice: Any) -> bool:
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return (isinstance(delta, dict) and "role" in delta and not delta.get("content") and not delta.get("tool_calls")
            and choice.get("finish_reason") is None)
