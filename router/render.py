"""A chat request rendered to prompt text exactly as a vLLM 0.32 replica renders it.

vLLM turns ``/v1/chat/completions`` into a prompt in three steps, reproduced here:

1. **Messages to a conversation.** Each message keeps its role, its content, and the fields a
   template may read (``name``; an assistant's ``tool_calls`` and ``reasoning``, also given as
   ``reasoning_content``; a tool message's ``tool_call_id``). Content is a string for templates that
   print it, or a list of ``{"type": "text", ...}`` parts for templates that loop over it (the
   *content format*, found by reading the template). Text parts of a string-format message are
   joined with newlines; ``None`` content becomes empty. A tool call's ``arguments`` (a JSON string
   in the OpenAI API) becomes an object. ``developer`` messages become ``system`` ones, merged into
   one first message, when the template does not know the role.
2. **The template** (:mod:`router.chat_template`), in a Jinja sandbox like Hugging Face's ``apply_chat_template`` (``tojson``
   without HTML escaping, ``raise_exception``, ``strftime_now``, ``{% generation %}``, loop controls),
   given the messages, ``tools`` (as vLLM serialises them), ``documents``, ``add_generation_prompt``,
   the tokenizer's named special tokens, and the request's ``chat_template_kwargs`` that the template
   reads (with ``reasoning_effort`` and the ``enable_thinking`` it implies). With
   ``continue_final_message`` the text ends where the last message's content ends.
3. **Encoding** without special tokens, unless the request sets ``add_special_tokens``.

What cannot be reproduced without the replica's help raises :class:`Unkeyable` with one of
:data:`REASONS`: the request is then keyed by its bytes, and counted under that reason.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .chat_template import ChatTemplate

REASONS = (
    "multimodal",  # an image, audio or video part: the model's processor expands it into tokens
    "prompt_embeds",  # embeddings instead of text
    "request_chat_template",  # the request brings its own template (a replica refuses it unless trusted)
    "truncated",  # truncate_prompt_tokens: the replica keeps part of the prompt
    "template_error",  # the template refused the conversation (the replica answers 400)
    "invalid",  # a request the replica refuses before rendering
    "no_chat_template",  # the model's tokenizer has no chat template
    "api_conversion",  # /v1/responses, /v1/messages: vLLM turns their input into chat messages its own way
)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's own parameters: accepted from chat_template_kwargs, but never given to the template
_APPLY_PARAMS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
_MEDIA_KEYS = ("image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio",
               "audio_embeds", "video_url", "video_embeds")
# fields of a content part that vLLM reads itself; any other field of a text part reaches the template
_KNOWN_PART_FIELDS = frozenset({"type", "text", "refusal", "thinking", "signature", "image_url", "uuid",
                                "detail", "input_audio", "audio_url", "video_url", "image_embeds",
                                "audio_embeds", "video_embeds", "image_pil", "data", "name", "file",
                                "file_id", "file_data", "filename", "input_image"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_UNSET = (None, "auto")  # vLLM drops kwargs with these values


class Unkeyable(Exception):
    """The request's prompt cannot be computed here; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str) -> None:
        assert reason in REASONS, reason
        super().__init__(reason)
        self.reason = reason


# -- step 1: messages to a conversation ----------------------------------------------------------


def _part_text(part: Any, openai: bool) -> Any:
    """A content part as the template sees it (a string, or a text dict), or None to skip it."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai else part
    if not isinstance(part, dict):
        raise Unkeyable("invalid")
    kind = part.get("type")
    if any(k in part for k in _MEDIA_KEYS) or kind in _MEDIA_KEYS:
        raise Unkeyable("multimodal")
    if kind == "prompt_embeds" or "prompt_embeds" in part:
        raise Unkeyable("prompt_embeds")
    if kind == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if openai else name
    field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if field is None:
        raise Unkeyable("invalid")  # vLLM answers 400 to a part it does not know
    text = part.get(field)
    if text is None:
        return None
    if not isinstance(text, str):
        raise Unkeyable("invalid")
    if not openai:
        return text
    out = {"type": "text", "text": text}
    out.update({k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS})
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops the first line of a system text that starts with Claude Code's billing header."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and \
            part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith("x-anthropic-billing-header")):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def conversation(messages: Sequence[Any], content_format: str) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template (step 1)."""
    openai = content_format == "openai"
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unkeyable("invalid")
        role = message["role"]
        content = message.get("content")
        if isinstance(content, str) and role != "system":  # the common case, and a long history's bulk
            msg: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": content}] if openai else content}
        else:
            if content is None:
                parts: list[Any] = []
            elif isinstance(content, str):
                parts = [{"type": "text", "text": content}]
            elif isinstance(content, list):
                parts = content
            else:
                raise Unkeyable("invalid")
            if role == "system":
                parts = _strip_billing_header(parts)
            texts = [t for t in (_part_text(p, openai) for p in parts) if t is not None]
            msg = {"role": role, "content": texts if openai else "\n".join(texts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = message["tool_calls"]
                if not isinstance(calls, list):
                    raise Unkeyable("invalid")
                msg["tool_calls"] = [_tool_call(c) for c in calls]
            if message.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):
                if all(isinstance(i, dict) and i.get("type") == "text" for i in msg["content"]):
                    msg["content"] = "\n".join(i.get("text", "") for i in msg["content"])
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    for msg in out:
        if "tool_calls" in msg and not msg["tool_calls"]:
            del msg["tool_calls"]  # an empty list takes the template's plain assistant path
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    """One assistant tool call as the template sees it: ``arguments`` parsed to an object (``{}`` where the
    string is empty or not a JSON object). vLLM refuses a call without a string ``id``, ``name`` and
    ``arguments``."""
    if not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type") != "function":
        raise Unkeyable("invalid")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
            not isinstance(function.get("arguments"), str):
        raise Unkeyable("invalid")
    args: Any = {}
    if function["arguments"]:
        try:
            args = json.loads(function["arguments"])
        except (ValueError, RecursionError):  # nested deeper than Python's stack: vLLM cannot read it either
            args = {}
    if not isinstance(args, dict):
        args = {}
    # the fields of an OpenAI tool call, in the order vLLM's validation gives them
    return {"id": call["id"], "function": {"arguments": args, "name": function["name"]}, "type": "function"}


def _as_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``developer`` messages as ``system`` ones, every system message merged into the first."""
    conv = [{k: v for k, v in {**m, "role": "system"}.items() if k != "tools"} if m["role"] == "developer" else m
            for m in conv]
    systems, rest, merge = [], [], False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) and "text" in p else p
                                for p in content if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else conv


# -- step 2: the template -------------------------------------------------------------------------


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM gives them to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unkeyable("invalid")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise Unkeyable("invalid")
        f = tool.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise Unkeyable("invalid")
        defer = tool.get("defer_loading")
        function: dict[str, Any] = {"name": f["name"], "description": f.get("description"),
                                    "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            function["strict"] = f["strict"]
        if f.get("defer_loading", defer) is not None:
            function["defer_loading"] = f.get("defer_loading", defer)
        entry: dict[str, Any] = {"type": "function", "function": function}
        if defer is not None:
            entry["defer_loading"] = defer
        out.append(entry)
    return out


def render_chat(template: ChatTemplate, payload: dict[str, Any], special_tokens: dict[str, str]) -> str:
    """The prompt text of a ``/v1/chat/completions`` body (step 2); raises :class:`Unkeyable`."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Unkeyable("invalid")
    if payload.get("chat_template") is not None:
        raise Unkeyable("request_chat_template")
    if payload.get("truncate_prompt_tokens") is not None:
        raise Unkeyable("truncated")
    user = payload.get("chat_template_kwargs") or {}
    if not isinstance(user, dict) or user.keys() & {"chat_template", "tokenize", "conversation"}:
        raise Unkeyable("invalid")
    effort = payload.get("reasoning_effort")
    generation = payload.get("add_generation_prompt", True)
    final = payload.get("continue_final_message", False)
    if generation and final:
        raise Unkeyable("invalid")
    # what vLLM merges, in its order: defaults (tools), the request's kwargs, then its own fields
    kwargs: dict[str, Any] = {"tools": _tools(payload.get("tools"))}
    kwargs.update({k: v for k, v in user.items() if v not in _UNSET})
    extra = {"add_generation_prompt": generation, "continue_final_message": final,
             "documents": payload.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    kwargs.update({k: v for k, v in extra.items() if v not in _UNSET})
    tools = kwargs.pop("tools", None)
    conv = conversation(messages, template.content_format)
    if not template.knows_developer and any(m["role"] == "developer" for m in conv):
        conv = _as_system(conv)
    generation = bool(kwargs.pop("add_generation_prompt", False))
    final = kwargs.pop("continue_final_message", False)
    documents = kwargs.pop("documents", None)
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise Unkeyable("invalid")
    context: dict[str, Any] = dict(special_tokens)
    context.update({k: v for k, v in kwargs.items() if k in template.variables and k not in _APPLY_PARAMS})
    if final:
        key = final if isinstance(final, str) else "content"
        conv = [dict(m) for m in conv]
        last = conv[-1].get(key)
        if last is None or key not in template.source:
            raise Unkeyable("template_error")
        if isinstance(last, list):
            last = [dict(p) if isinstance(p, dict) else p for p in last]
            block = next((p for p in reversed(last) if isinstance(p, dict) and "text" in p), None)
            if block is None:
                raise Unkeyable("template_error")
            final_text = block["text"]
            block["text"] = final_text + _CONTINUE_TAG
            conv[-1][key] = last
        else:
            final_text = last
            conv[-1][key] = last + _CONTINUE_TAG
    try:
        text = template.render(messages=conv, tools=tools, documents=documents, add_generation_prompt=generation,
                               **context)
    except Unkeyable:
        raise
    except Exception:
        raise Unkeyable("template_error") from None
    if final:
        if final_text.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise Unkeyable("template_error")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
