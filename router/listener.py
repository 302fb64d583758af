"""The client-facing connection: limits on what a client may hold before its request is read.

uvicorn's HTTP protocol (httptools) keeps a connection that never sends a request open for ever,
buffers a header of any size, and has no limit on connections. Before authentication, any client
could hold sockets and memory that way. :class:`Listener` is that protocol with limits:

- ``client.header_timeout_s``: from connection (or the first byte of the next request on a
  keep-alive connection) until the request's headers are complete; then 408 and close;
- ``client.max_header_bytes``: request line and headers together; past it 431 and close;
- ``client.max_connections``: connections open at once; one past it is closed at once (by default
  80% of the process's file-descriptor limit, so sockets to replicas and Redis still open).

Each refusal counts in ``kvroute_client_refused_total{reason}`` and is logged, at most once per
10 s per reason with the count since. The request body's own limit (time between its chunks,
``client.body_timeout_s``) is applied where the body is read (:mod:`router.bodies`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .config import ClientConfig

log = logging.getLogger("kvroute.listener")

_LOG_EVERY_S = 10.0


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 100_000
    return max(16, int(soft * 0.8) - 64)


class Refusals:
    """Counts and logs refused connections (called from the protocol, on the event loop)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._since: dict[str, int] = {}
        self._logged: dict[str, float] = {}

    def __call__(self, reason: str, client: Any) -> None:
        self._count(reason)
        self._since[reason] = self._since.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged.get(reason, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            n = self._since.pop(reason)
            self._logged[reason] = now
            who = f"{client[0]}:{client[1]}" if client else "a client"
            log.warning("closed a connection from %s: %s (%d such in the last %.0f s)", who, _WHY[reason], n,
                        _LOG_EVERY_S)


_WHY = {
    "header_timeout": "its request headers did not arrive within client.header_timeout_s",
    "header_too_large": "its request headers are larger than client.max_header_bytes",
    "too_many_connections": "client.max_connections connections are open",
    "too_many_from_address": "its address has client.max_connections_per_address connections open",
    "body_timeout": "its request body stalled longer than client.body_timeout_s",
}

_RESPONSES = {
    "header_timeout": (408, b"Request Timeout"),
    "header_too_large": (431, b"Request Header Fields Too Large"),
}


class HeadWithBody:
    """A connection's transport that sends a response's head with the first part of its body.

    uvicorn writes a response's status line and headers as soon as the app starts the response, and its body
    at the next ``send``: for a whole answer that is two socket sends (two packets, with TCP_NODELAY) where one
    does. A head is held until the next write on the connection, or until the event loop's next turn when none
    comes in this one (a stream whose first event is not ready yet: its headers still leave at once, as vLLM
    sends them). Every other write goes straight through, and order is kept: a held head always leaves first.
    """

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(b"HTTP/1.1 ") and data.endswith(b"\r\n\r\n"):
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:  # the rest of asyncio.Transport, as it is
        return getattr(self._transport, name)


def listener_class(cfg: ClientConfig, refused: Refusals) -> type[HttpToolsProtocol]:
    """The HTTP protocol class uvicorn runs, with ``cfg``'s limits."""
    max_connections = cfg.max_connections or default_max_connections()
    if cfg.max_connections is None:
        log.info("client connections: at most %d (80%% of this process's file-descriptor limit; "
                 "client.max_connections sets it)", max_connections)
    per_address = cfg.max_connections_per_address or max(1, max_connections // 2)
    open_from: dict[str, int] = {}  # connections open per client address (a bounded number of them)

    class Listener(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True
        _head_bytes = 0
        _head_tail = b""  # the last bytes of the head so far: its end may be split across reads

        _address: str | None = None  # counted in open_from

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                refused("too_many_connections", self.client)
                transport.abort()
                return
            address = self.client[0] if self.client else None
            if address is not None:
                n = open_from.get(address, 0)
                if n >= per_address:
                    refused("too_many_from_address", self.client)
                    transport.abort()
                    return
                open_from[address] = n + 1
                self._address = address
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._address is not None:
                left = open_from.pop(self._address, 1) - 1
                if left > 0:
                    open_from[self._address] = left
                self._address = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head and not self.transport.is_closing():
                # Counted before httptools sees the bytes: a head that ends in this chunk is parsed (and its
                # headers completed) by the call below, so the limit is checked first, up to the head's end.
                seen = self._head_tail + data
                end = seen.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else end + 4 - len(self._head_tail)
                self._head_tail = seen[-3:]
                if self._head_bytes > cfg.max_header_bytes:
                    self._refuse("header_too_large")
                    return
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._in_head:  # the next request on this connection
                self._in_head = True
                self._head_bytes = 0
                self._head_tail = b""
                self._arm()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm()
            super().on_headers_complete()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(cfg.header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self._refuse("header_timeout")

        def _refuse(self, reason: str) -> None:
            refused(reason, self.client)
            status, phrase = _RESPONSES[reason]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % (status, phrase))
            self.transport.close()
            self._disarm()

    return Listener
