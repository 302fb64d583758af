"""The hot-path HTTP/1.1 client to replicas: an asyncio protocol over httptools' C parser.

One :class:`UpstreamPool` per replica keeps idle keep-alive connections (last in, first out).
A response hands out the replica's body chunks one by one, as they were framed, with a timeout
per wait; reading pauses when the client falls 256 KiB behind. Releasing a response that is
not complete closes its connection, which is how the replica learns that the client left.

Why not httpx here: its connection pool re-checks every pooled connection on every request
(O(connections) per request) and its layers cost several CPU milliseconds per proxied request.
Health checks and scrapes, off the hot path, still use httpx.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024


class UpstreamError(Exception):
    """Base of every failure talking to a replica. ``kind`` names its row in :data:`router.failure_kinds.KINDS`."""

    kind = "protocol"


class TransportError(UpstreamError):
    """The connection could not be made or broke."""

    kind = "closed"


class ConnectFailed(TransportError):
    kind = "connect"


class RemoteClosed(TransportError):
    kind = "closed"


class ProtocolError(UpstreamError):
    """The replica sent something that is not HTTP/1.1."""

    kind = "protocol"


class UpstreamTimeout(UpstreamError):
    """A wait on the replica ran out."""

    kind = "timeout"


class ConnectTimeout(UpstreamTimeout):
    kind = "connect_timeout"


class ResponseTimeout(UpstreamTimeout):
    """No status line and headers within the limit."""

    kind = "timeout"


class ReadTimeout(UpstreamTimeout):
    """The body went silent for longer than the limit."""

    kind = "timeout"


class Stalled(UpstreamError):
    """The replica answered none of its requests for a while, and its engine made no progress: it was taken out,
    and the requests still waiting for it are sent elsewhere."""

    kind = "stalled"


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # small SSE writes must not wait for ACKs (Nagle's algorithm)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes on an idle connection: nothing may be trusted on it now
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            # a callback's own ProtocolError (a status no client can be given) comes through as the parser's context
            cause = e.__context__
            self.response._fail(cause if isinstance(cause, ProtocolError)
                                else ProtocolError(f"invalid HTTP from the replica: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response.complete:
            self.response._eof()

    def pause_writing(self) -> None:  # request bodies are written whole; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.response is not None
        status = self.parser.get_status_code()
        if not 200 <= status <= 599:  # no request asks for a 1xx; anything else is not HTTP a client can be given
            raise ProtocolError(f"the replica answered status {status}")
        self.response._headers_done(status)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response._done(self.parser.should_keep_alive())

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A replica's response: status and headers first, then the body chunk by chunk."""

    def __init__(self, conn: _Connection, pool: "UpstreamPool") -> None:
        self._conn = conn
        self._pool = pool
        self._loop = pool.loop
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.got_bytes = False
        self._keep_alive = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamError | None = None
        self._headers_ready = self._loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    # -- fed by the connection --------------------------------------------------------------

    def _headers_done(self, status: int) -> None:
        self.status = status
        self.got_bytes = True
        self._pool._answered(self)
        if not self._headers_ready.done():
            self._headers_ready.set_result(None)

    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._conn.transport.pause_reading()
            self._paused = True
        self._wake()

    def _done(self, keep_alive: bool) -> None:
        self.complete = True
        self._keep_alive = keep_alive
        self._wake()

    def _eof(self) -> None:
        if not self._headers_ready.done():
            # llhttp cannot see the end of a body that runs until the connection closes
            self._fail(RemoteClosed("the replica closed the connection before answering"))
        elif (self.header(b"content-length") is None and self.header(b"transfer-encoding") is None):
            self._done(False)
        else:
            self._fail(RemoteClosed("the replica closed the connection mid-response"))

    def _fail(self, error: UpstreamError) -> None:
        self._pool._unanswered.pop(self, None)
        if self._error is None:
            self._error = error
        if not self._headers_ready.done():
            self._headers_ready.set_exception(error)
            self._headers_ready.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- used by the proxy ------------------------------------------------------------------

    async def _wait(self, fut: asyncio.Future[None], timeout: float, error: type[UpstreamTimeout], what: str) -> None:
        def expire() -> None:
            if not fut.done():
                fut.set_exception(error(f"no {what} from the replica for {timeout:g} s"))

        timer = self._loop.call_later(timeout, expire)
        try:
            await fut
        finally:
            timer.cancel()

    async def wait_headers(self, timeout: float) -> None:
        await self._wait(self._headers_ready, timeout, ResponseTimeout, "response")

    async def next_chunk(self, timeout: float) -> bytes | None:
        """The next body chunk as the replica framed it, or None at the end of the body."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered < _LOW_WATER and self._conn.transport is not None:
                    self._conn.transport.resume_reading()
                    self._paused = False
                return chunk
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._wait(self._waiter, timeout, ReadTimeout, "data")
            finally:
                self._waiter = None

    async def read(self, limit: int, timeout: float) -> bytes:
        buf = bytearray()
        while len(buf) < limit:
            chunk = await self.next_chunk(timeout)
            if chunk is None:
                break
            buf += chunk
        return bytes(buf)

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool only if the exchange is complete."""
        self._pool._unanswered.pop(self, None)
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        if self.complete and self._keep_alive and not conn.closed and not self._paused:
            self._pool._put_back(conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections to one replica."""

    def __init__(self, url: str, connect_timeout: float, idle_expiry: float = 4.0) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/").encode()
        self.host_header = (parts.netloc.rpartition("@")[2] or self.host).encode()  # never a URL's credentials
        self.connect_timeout = connect_timeout
        # Idle connections are dropped before the replica's own keep-alive timeout (uvicorn: 5 s)
        # would close them under us.
        self.idle_expiry = idle_expiry
        self._idle: list[_Connection] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unanswered: dict[UpstreamResponse, float] = {}  # request sent at (monotonic)
        self.last_answer = time.monotonic()  # a status line from the replica, to any request

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):  # no task of its own, unlike wait_for
                _, conn = await self.loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl,
                                                            server_hostname=self.host if self.ssl else None)
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {self.host}:{self.port} took over {self.connect_timeout:g} s") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        return conn

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            # a transport the loop already closed (the replica died) may not have told the protocol yet
            alive = not conn.closed and conn.transport is not None and not conn.transport.is_closing()
            if alive and now - conn.idle_since < self.idle_expiry:
                conn.reused = True
                return conn
            conn.close()
        return None

    def _put_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.parser = httptools.HttpResponseParser(conn)
        self._idle.append(conn)

    async def request(self, method: bytes, path: str, headers: bytes, body: bytes,
                      timeout: float) -> UpstreamResponse:
        """Send a request and wait (at most ``timeout``) for the status line and headers.

        ``headers`` are header lines (``name: value\\r\\n`` each); host and content-length are added.
        """
        payload = b"%s %s%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
            method, self.prefix, path.encode(), self.host_header, len(body), headers, body)
        while True:
            conn = self._take_idle() or await self._connect()
            resp = UpstreamResponse(conn, self)
            conn.response = resp
            self._unanswered[resp] = time.monotonic()
            assert conn.transport is not None
            try:
                conn.transport.write(payload)
            except RuntimeError:  # closed under us between the check and the write (uvloop raises)
                resp._fail(RemoteClosed("the connection to the replica was closed before the request went out"))
            try:
                await resp.wait_headers(timeout)
                return resp
            except RemoteClosed:
                resp.release()
                if conn.reused and not resp.got_bytes:
                    continue  # a kept-alive connection the replica had just closed: use a new one
                raise
            except BaseException:
                resp.release()
                raise

    # -- requests the replica has not answered (a replica that accepts requests and answers none) ----

    def _answered(self, resp: "UpstreamResponse") -> None:
        self._unanswered.pop(resp, None)
        self.last_answer = time.monotonic()

    def unanswered_for(self, now: float) -> float:
        """Seconds the oldest request still waiting for its status line has waited, counted from this replica's
        last answer to any request if that came later; 0 when none waits."""
        if not self._unanswered:
            return 0.0
        return min(now - min(self._unanswered.values()), now - self.last_answer)

    def abort_unanswered(self, error: UpstreamError) -> int:
        """Fail every request still waiting for its status line (their senders try elsewhere); how many."""
        waiting = list(self._unanswered)
        for resp in waiting:
            resp._fail(error)
        return len(waiting)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
