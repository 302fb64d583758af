"""Reading a client's request body within its limits: size, the longest pause, the whole time."""

from __future__ import annotations

import asyncio
from typing import Any

from . import errors
from .config import ClientConfig
from .errors import GatewayError
from .metrics import Metrics


async def read_body(receive: Any, headers: list[tuple[bytes, bytes]], limit: int, cfg: ClientConfig,
                    metrics: Metrics) -> bytes:
    """A request's body, at most ``limit`` bytes (a larger Content-Length is refused before reading), with no pause
    longer than ``client.body_timeout_s`` and all of it within ``client.body_total_timeout_s``.
    Raises :class:`~router.errors.GatewayError` (400, 408, 413)."""
    for k, v in headers:
        if k == b"content-length":
            try:
                if int(v) > limit:
                    raise errors.too_large(limit)
            except ValueError:
                raise errors.bad_request("invalid Content-Length header") from None
    chunks = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.body_total_timeout_s
    while True:
        left = deadline - loop.time()
        pause = min(cfg.body_timeout_s, left)
        try:
            async with asyncio.timeout(pause):  # a timer, no task: this runs for every request
                message = await receive()
        except TimeoutError:
            metrics.client_refused.labels("body_timeout").inc()
            what = (f"stalled for {cfg.body_timeout_s:g} s" if pause == cfg.body_timeout_s
                    else f"took longer than {cfg.body_total_timeout_s:g} s")
            raise GatewayError(408, f"the request body {what}", "invalid_request_error", "body_timeout") from None
        if message["type"] == "http.disconnect":
            raise errors.bad_request("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise errors.too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def with_last_field(body: bytes, name: bytes, value: bytes) -> bytes:
    """``body`` (a JSON object) with ``"name": value`` added as its last member, the rest of its bytes as sent: a
    JSON parser that meets a name twice keeps the last, so this one wins over any the client sent."""
    end = body.rindex(b"}")
    inner = body[:end].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return b'%s%s"%s":%s%s' % (inner, sep, name, value, body[end:])
