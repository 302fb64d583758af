"""The rendering corpus: requests whose prompt token ids kvroute must compute exactly as vLLM does.

    python -m loadtest.render_corpus capture URL [OUT]   (a vLLM replica of the tiny model, --enable-scale-out)

:func:`corpus` builds the requests, the same on every machine: plain and multi-turn chats, chats
without a system prompt, unicode and whitespace edge cases, tools and tool calls (JSON-string,
object, empty and malformed arguments), tool results, ``chat_template_kwargs``, ``reasoning_effort``,
``documents``, ``continue_final_message``, ``add_generation_prompt: false``, ``developer`` messages,
content given as parts, and completions prompts as text, token ids and batches. ``capture`` asks a
real vLLM replica for the ids of each (``/v1/chat/completions/render``, ``/v1/completions/render``,
and ``/tokenize`` where it takes the request) and writes them as the fixture the tests compare
against (``tests/fixtures/render/vllm-0.32.json``); the ``vllm`` tests ask the replica again.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import httpx

from .tiny_model import WORDS

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "render" / "vllm-0.32.json"

ODD_TEXTS = [
    "", " ", "  leading spaces", "trailing spaces  ", "tabs\tand\ttabs", "windows\r\nline\r\nends",
    "new\n\nlines\n", "ünïcödé wörds", "日本語のテキスト", "emoji 🙂👍🏽 and flags 🇨🇭", "e\u0301 combining",
    "zero\u200bwidth", "literal </s> and <s> markers", "<|user|> inside text", "json {\"a\": [1, 2]}",
    "quotes ' \" ` and backslash \\", "html <b>bold</b> & amp", "a" * 300, " ".join(["alpha"] * 200),
    "mixed 123 4567 89.01 -2e5", "right-to-left עברית العربية",
]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": f"tool_{i}_{rng.choice(WORDS)}"}
    if rng.random() < 0.7:
        function["description"] = _words(rng, rng.randint(3, 12)) + rng.choice(["", " (ünïcödé)", " <html>"])
    if rng.random() < 0.8:
        function["parameters"] = {"type": "object", "properties": {
            rng.choice(WORDS): {"type": rng.choice(["string", "integer"]), "description": _words(rng, 3)},
            "nested": {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "number"}}}}},
            "required": ["nested"]}
    if rng.random() < 0.2:
        function["strict"] = rng.random() < 0.5
    return {"type": "function", "function": function}


def _arguments(rng: random.Random) -> Any:
    return rng.choice([
        json.dumps({"city": _words(rng, 2), "days": rng.randint(1, 9)}),
        json.dumps({"query": "ünïcödé <b> & \"quoted\"", "n": [1, 2.5, None, True]}, ensure_ascii=False),
        "", "not json {", "[1, 2, 3]", "42", "{}",
    ])


def _chat(rng: random.Random, turns: int, system: bool, tools: bool, odd: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": rng.choice(ODD_TEXTS) if odd else _words(rng, rng.randint(5, 60))})
    for t in range(turns):
        messages.append({"role": "user", "content": rng.choice(ODD_TEXTS) if odd else _words(rng, rng.randint(3, 40))})
        if t == turns - 1:
            break
        if tools and rng.random() < 0.6:
            calls = [{"id": f"call_{t}_{k}", "type": "function",
                      "function": {"name": f"tool_{k}", "arguments": _arguments(rng)}}
                     for k in range(rng.randint(1, 3))]
            messages.append({"role": "assistant", "content": rng.choice([None, "", _words(rng, 4)]), "tool_calls": calls})
            for c in calls:
                result: Any = _words(rng, rng.randint(2, 10))
                if rng.random() < 0.3:
                    result = [{"type": "text", "text": result}, {"type": "text", "text": "second part"}]
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        else:
            messages.append({"role": "assistant", "content": _words(rng, rng.randint(3, 30))})
    return messages


def corpus(seed: int = 28) -> list[dict[str, Any]]:
    """About 250 cases, each ``{"name", "path", "body"}``."""
    rng = random.Random(seed)
    cases: list[dict[str, Any]] = []

    def chat(name: str, body: dict[str, Any]) -> None:
        cases.append({"name": f"{name}-{len(cases)}", "path": "/v1/chat/completions",
                      "body": {"model": "tiny", **body}})

    def completion(name: str, body: dict[str, Any]) -> None:
        cases.append({"name": f"{name}-{len(cases)}", "path": "/v1/completions",
                      "body": {"model": "tiny", "max_tokens": 1, **body}})

    for i in range(20):
        chat("plain", {"messages": _chat(rng, rng.randint(1, 6), system=i % 3 != 0, tools=False, odd=False)})
    for i in range(10):
        chat("no-system", {"messages": _chat(rng, rng.randint(1, 4), system=False, tools=False, odd=False)})
    for i, text in enumerate(ODD_TEXTS):
        chat("odd-text", {"messages": [{"role": "system", "content": _words(rng, 5)}, {"role": "user", "content": text}]})
    for i in range(10):
        chat("odd-multi", {"messages": _chat(rng, rng.randint(2, 4), system=True, tools=False, odd=True)})
    for i in range(30):
        body: dict[str, Any] = {"messages": _chat(rng, rng.randint(1, 4), system=i % 2 == 0, tools=False, odd=False),
                                "tools": [_tool(rng, k) for k in range(rng.randint(1, 4))]}
        if i % 5 == 0:
            body["tool_choice"] = rng.choice(["auto", "none"])
        chat("tools", body)
    for i in range(40):
        chat("tool-calls", {"messages": _chat(rng, rng.randint(2, 5), system=i % 3 == 0, tools=True, odd=False),
                            "tools": [_tool(rng, k) for k in range(3)]})
    for arguments in ({"already": "an object"}, None):  # vLLM refuses these: keyed, and counted as invalid
        chat("refused", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "y"}]})
    for i in range(20):
        kwargs = rng.choice([{"enable_thinking": False}, {"enable_thinking": True}, {"unknown_flag": 1},
                             {"enable_thinking": None}, {"enable_thinking": "auto"}, {"bos_token": "[BOS]"},
                             {"enable_thinking": False, "other": [1, 2]}])
        body = {"messages": _chat(rng, rng.randint(1, 3), system=True, tools=False, odd=False),
                "chat_template_kwargs": kwargs}
        if i % 4 == 0:
            body["reasoning_effort"] = rng.choice(["none", "low", "high"])
        chat("kwargs", body)
    for effort in ("none", "minimal", "low", "medium", "high"):
        chat("reasoning-effort", {"messages": _chat(rng, 2, system=True, tools=False, odd=False),
                                  "reasoning_effort": effort})
    for i in range(20):
        messages = _chat(rng, rng.randint(1, 3), system=i % 2 == 0, tools=False, odd=False)
        partial = rng.choice([_words(rng, 5), _words(rng, 5) + "  ", " " + _words(rng, 3), _words(rng, 4) + "\n"])
        if i % 4 == 3:
            chat("no-generation-prompt", {"messages": messages, "add_generation_prompt": False})
        else:
            chat("continue-final", {"messages": messages + [{"role": "assistant", "content": partial}],
                                    "add_generation_prompt": False, "continue_final_message": True})
    for i in range(10):
        docs = [{"title": _words(rng, 2), "text": _words(rng, rng.randint(5, 40))} for _ in range(rng.randint(1, 3))]
        chat("documents", {"messages": _chat(rng, 1, system=True, tools=False, odd=False), "documents": docs})
    for i in range(10):
        messages = _chat(rng, rng.randint(1, 3), system=i % 2 == 0, tools=False, odd=False)
        messages.insert(rng.randint(0, len(messages) - 1), {"role": "developer", "content": _words(rng, 6)})
        if i % 3 == 0:
            messages.append({"role": "system", "content": _words(rng, 4)})
            messages.append({"role": "user", "content": _words(rng, 4)})
        chat("developer", {"messages": messages})
    for i in range(15):
        parts: list[Any] = [{"type": "text", "text": _words(rng, 4)} for _ in range(rng.randint(1, 3))]
        if i % 3 == 0:
            parts.append({"type": "input_text", "text": _words(rng, 3)})
        if i % 5 == 0:
            parts.append({"type": "text", "text": None})
        messages = [{"role": "system", "content": [{"type": "text", "text": _words(rng, 5)}]},
                    {"role": "user", "content": parts}]
        if i % 4 == 1:
            messages += [{"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot"}]},
                         {"role": "user", "content": _words(rng, 3)}]
        chat("content-parts", {"messages": messages})
    for i in range(10):
        messages = _chat(rng, 3, system=True, tools=False, odd=False)
        for m in messages:
            if m["role"] == "assistant":
                m["reasoning"] = _words(rng, rng.randint(0, 8))
        chat("reasoning", {"messages": messages})
    for i in range(5):
        chat("names", {"messages": [{"role": "system", "content": _words(rng, 4)},
                                    {"role": "user", "name": rng.choice(["ann", "bob_2", "ünï"]), "content": _words(rng, 5)}]})
    for i in range(5):
        chat("add-special-tokens", {"messages": _chat(rng, 2, system=True, tools=False, odd=False),
                                    "add_special_tokens": True})
    for i in range(15):
        completion("text", {"prompt": _words(rng, rng.randint(1, 300))})
    for text in ODD_TEXTS[1:]:
        completion("odd-text", {"prompt": text})
    for i in range(5):
        completion("no-special-tokens", {"prompt": _words(rng, 20), "add_special_tokens": False})
    for i in range(5):
        completion("ids", {"prompt": [rng.randint(3, 1000) for _ in range(rng.randint(1, 300))]})
    for i in range(5):
        completion("batch-text", {"prompt": [_words(rng, rng.randint(1, 30)) for _ in range(rng.randint(2, 4))]})
    for i in range(3):
        completion("batch-ids", {"prompt": [[rng.randint(3, 1000) for _ in range(rng.randint(1, 40))] for _ in range(3)]})
    return cases


def _ids(r: httpx.Response) -> Any:
    """Token ids from a render answer: one list per prompt."""
    data = r.json()
    items = data if isinstance(data, list) else [data]
    out = []
    for item in items:
        if "token_ids" in item:
            out.append(item["token_ids"])
        elif "tokens" in item:
            out.append(item["tokens"])
        else:
            raise ValueError(f"no token ids in {str(data)[:200]}")
    return out


def ask(client: httpx.Client, url: str, case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ids for one case: ``{"ids": [[...], ...]}``, or ``{"status": N}`` when vLLM refuses it."""
    r = client.post(url + case["path"] + "/render", json=case["body"])
    if r.status_code != 200:
        return {"status": r.status_code}
    return {"ids": _ids(r)}


def tokenizer_digest(folder: Path) -> str:
    return hashlib.sha256((folder / "tokenizer.json").read_bytes() + (folder / "chat_template.jinja").read_bytes()
                          ).hexdigest()[:16]


def capture(url: str, out: Path, model_folder: Path) -> None:
    with httpx.Client(timeout=60) as client:
        version = client.get(url + "/version").json().get("version")
        cases = [{**c, "vllm": ask(client, url, c)} for c in corpus()]
    out.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"vllm": version, "tokenizer": tokenizer_digest(model_folder)})[:-1]
    lines = ",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases)
    out.write_text(f'{head}, "cases": [\n{lines}\n]}}\n')  # one case per line
    refused = sum("status" in c["vllm"] for c in cases)
    sys.stderr.write(f"{len(cases)} cases from vLLM {version} at {url}, {refused} refused -> {out}\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "capture":
        sys.exit("usage: python -m loadtest.render_corpus capture URL [OUT] [MODEL_FOLDER]")
    capture(sys.argv[2], Path(sys.argv[3]) if len(sys.argv) > 3 else FIXTURE,
            Path(sys.argv[4]) if len(sys.argv) > 4 else Path.home() / ".cache" / "kvroute" / "vllm" / "tiny-llama")
