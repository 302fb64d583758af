"""A replica whose every answer is set by its controller, byte for byte: for fuzzing what the router reads.

    python -m loadtest.scripted_replica --port 9010 --model scripted

Until told otherwise it answers as a healthy vLLM would: ``/health`` 200, ``/v1/models`` listing one model,
``/metrics`` with a cache size, ``/kv_event_sources`` 404 (no events), and any POST with a one-token
completion. ``PUT /__script/<path>`` (JSON) replaces the answer to ``<path>`` (``post`` for every POST):

- ``status`` (int), ``headers`` (list of [name, value]), ``body`` (base64), and ``framing``: ``length``
  (a content-length), ``chunked`` (the body in ``pieces`` chunks), or ``close`` (no length; the connection
  closes after the body);
- ``DELETE /__script`` restores every default; ``GET /__hits`` counts the requests per path.

A raw asyncio server on 127.0.0.1 with no framework to mend what it sends. Answers are sent whatever they
hold (a status line is built from ``status`` alone, so any number goes out as it is).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from collections import Counter
from typing import Any

from .cluster import serve_until_stopped

_REASONS = {200: b"OK", 404: b"Not Found"}


def _completion(model: str) -> bytes:
    return json.dumps({"id": "cmpl-scripted", "object": "text_completion", "created": 0, "model": model,
                       "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length",
                                    "stop_reason": None}],
                       "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}}).encode()


class Answer:
    def __init__(self, status: int = 200, body: bytes = b"", headers: list[tuple[str, str]] | None = None,
                 framing: str = "length", pieces: int = 1) -> None:
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else [("content-type", "application/json")]
        self.framing = framing
        self.pieces = max(1, pieces)

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> Answer:
        return cls(int(spec.get("status", 200)), base64.b64decode(spec.get("body", "")),
                   [(str(k), str(v)) for k, v in spec.get("headers", [])], str(spec.get("framing", "length")),
                   int(spec.get("pieces", 1)))

    def encode(self) -> bytes:
        head = [b"HTTP/1.1 %d %s" % (self.status, _REASONS.get(self.status, b"Scripted"))]
        head += [f"{k}: {v}".encode("latin-1", "replace") for k, v in self.headers]
        if self.framing == "chunked":
            head.append(b"transfer-encoding: chunked")
            size = max(1, -(-len(self.body) // self.pieces))
            parts = [self.body[i:i + size] for i in range(0, len(self.body), size)]
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        elif self.framing == "close":
            head.append(b"connection: close")
            body = self.body
        else:
            head.append(b"content-length: %d" % len(self.body))
            body = self.body
        return b"\r\n".join(head) + b"\r\n\r\n" + body


class ScriptedReplica:
    def __init__(self, model: str) -> None:
        self.model = model
        self.hits: Counter[str] = Counter()
        self.script: dict[str, Answer] = {}

    def default(self, path: str) -> Answer:
        if path == "/health":
            return Answer(200, b"", [])
        if path == "/v1/models":
            return Answer(200, json.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model,
                 "max_model_len": 4096}]}).encode())
        if path == "/metrics":
            return Answer(200, b'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0\n'
                               b"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n",
                          [("content-type", "text/plain; version=0.0.4")])
        if path == "post":
            return Answer(200, _completion(self.model))
        return Answer(404, b'{"detail":"Not Found"}')

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target = head.split(b" ", 2)[:2]
                path = target.decode("latin-1").split("?", 1)[0]
                body = b""
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        body = await reader.readexactly(int(value))
                answer = self.control(method, path, body)
                if answer is None:
                    key = "post" if method == b"POST" else path
                    self.hits[key] += 1
                    answer = self.script.get(key) or self.default(key)
                writer.write(answer.encode())
                await writer.drain()
                if answer.framing == "close":
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def control(self, method: bytes, path: str, body: bytes) -> Answer | None:
        if path == "/__hits":
            return Answer(200, json.dumps(dict(self.hits)).encode())
        if path.startswith("/__script"):
            if method == b"DELETE":
                self.script.clear()
            else:
                key = path[len("/__script"):]
                self.script["post" if key in ("", "/post") else key] = Answer.from_json(json.loads(body))
            return Answer(200, b"{}")
        return None


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="scripted")
    args = p.parse_args()
    asyncio.run(serve_until_stopped(ScriptedReplica(args.model).serve, "127.0.0.1", args.port))
