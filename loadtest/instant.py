"""An instant replica: answers every request at once with bytes captured from a real vLLM.

    python -m loadtest.instant --port 9001

For benchmarks in which the router must be the bottleneck: an asyncio protocol over httptools'
parser (no ASGI framework), answering ``POST /v1/completions`` and ``/v1/chat/completions`` with
the captured responses in ``tests/fixtures/vllm-0.32`` (a non-streaming body, or the captured SSE
stream as one chunk per event written at once), and ``GET /health``, ``/v1/models``, ``/metrics``
likewise. Only ``usage.prompt_tokens`` follows the request (its body's bytes / 4), so that a router
learning bytes per token from answers learns a plausible figure. It spends a few tens of
microseconds per request; it generates nothing and keeps no state but a request count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Callable

import httptools

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-0.32"


_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\d+')


def plain(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (ctype, len(body), body)


def sse(text: bytes) -> bytes:
    events = [e + b"\n\n" for e in text.strip().split(b"\n\n")]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")


def _load() -> dict[tuple[bytes, bool], Callable[[int], bytes]]:
    """Whole HTTP responses by the request's body size, keyed by (path, streaming)."""

    def fixed(response: bytes) -> Callable[[int], bytes]:
        return lambda size: response

    def counted(render: Callable[[bytes], bytes], body: bytes) -> Callable[[int], bytes]:
        return lambda size: render(_PROMPT_TOKENS.sub(b'"prompt_tokens":%d' % max(1, size // 4), body))

    def fixture(name: str) -> bytes:
        return (FIXTURES / name).read_bytes()

    completion = json.dumps(json.loads(fixture("completions.json"))).encode()
    chat = json.dumps(json.loads(fixture("chat.json"))).encode()
    return {
        (b"/v1/completions", False): counted(plain, completion),
        (b"/v1/completions", True): counted(sse, fixture("completions-stream.sse")),
        (b"/v1/chat/completions", False): counted(plain, chat),
        (b"/v1/chat/completions", True): counted(sse, fixture("chat-stream.sse")),
        (b"/health", False): fixed(plain(b"")),
        (b"/v1/models", False): fixed(plain(json.dumps(json.loads(fixture("models.json"))).encode())),
        (b"/metrics", False): fixed(plain(fixture("metrics.txt"), b"text/plain; version=0.0.4; charset=utf-8")),
    }


_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class _Conn(asyncio.Protocol):
    served = 0

    def __init__(self, responses: dict[tuple[bytes, bool], Callable[[int], bytes]]) -> None:
        self.responses = responses
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        body = b"".join(self.body)
        stream = b'"stream":true' in body.replace(b" ", b"")
        respond = self.responses.get((self.url, stream))
        self.transport.write(respond(len(body)) if respond is not None else _NOT_FOUND)
        _Conn.served += 1
        self.url = b""
        self.body = []


async def serve(port: int, host: str = "127.0.0.1") -> None:
    responses = _load()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(responses), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.instant", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
