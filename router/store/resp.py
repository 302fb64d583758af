"""RESP2 over one pipelined asyncio connection to one Redis server: the protocol and :class:`Node`.

Why not redis-py's asyncio client: it spends about 180 us of CPU per command (a PING included) in
its connection pool, locks and retry layers, more than the rest of a routing decision. A node
writes each command at once on one shared connection and matches replies to callers in order;
about 10 us per command. :class:`router.store.client.Redis` puts one node per server behind one
client (a Redis, or every master of a Redis Cluster).

Every wait is bounded by its caller (``asyncio.timeout``): a call that timed out still gets its
reply slot, and the reply is dropped when it comes. If replies stop coming (more than
``max_pending`` calls waiting, or the oldest waiting longer than ``stall_s``), the connection is
dropped, every waiting call fails, and the next call connects again.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


class RedisError(Exception):
    """A Redis call failed: the server answered an error, or the connection failed."""


class ReplyError(RedisError):
    """The server answered ``-ERR ...`` (or ``-NOSCRIPT ...``)."""


class ConnectionLost(RedisError, ConnectionError):
    pass


class _Incomplete(Exception):
    pass


def encode(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, bytes):
            b = a
        elif isinstance(a, str):
            b = a.encode()
        else:
            b = str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def parse(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One reply from ``buf`` at ``pos``: (value, position after it); raises _Incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    line = bytes(buf[pos + 1:end])
    pos = end + 2
    if kind == 58:  # ':' integer
        return int(line), pos
    if kind == 36:  # '$' bulk string
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise _Incomplete
        return bytes(buf[pos:pos + n]), pos + n + 2
    if kind == 42:  # '*' array
        n = int(line)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == 43:  # '+' simple string
        return line, pos
    if kind == 45:  # '-' error
        return ReplyError(line.decode(errors="replace")), pos
    raise RedisError(f"unexpected reply type {chr(kind)!r} from Redis")


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiters: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                value, pos = parse(buf, pos)
                if not self.waiters:
                    raise RedisError("a reply nobody asked for")
                fut, _ = self.waiters.popleft()
                if not fut.done():  # its caller may have given up waiting
                    if isinstance(value, ReplyError):
                        fut.set_exception(value)
                    else:
                        fut.set_result(value)
        except _Incomplete:
            pass
        except (RedisError, ValueError) as e:
            self.fail(RedisError(f"cannot read Redis's reply: {e}"))
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionLost("the connection to Redis was lost"))

    def fail(self, error: Exception) -> None:
        self.closed = True
        while self.waiters:
            fut, _ = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
        if self.transport is not None:
            self.transport.close()




def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass(frozen=True)
class Address:
    """Where one server listens, and how to talk to it (from the client's URL)."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # a Unix socket instead of host:port
    tls: bool = False
    username: str | None = None
    password: str | None = None
    db: int = 0

    def at(self, host: str, port: int) -> "Address":
        """The same credentials and TLS at another server (a cluster's other nodes)."""
        return Address(host, port, None, self.tls, self.username, self.password, self.db)

    def __str__(self) -> str:
        return self.path if self.path else f"{self.host}:{self.port}"


class Node:
    """One server, one pipelined connection, opened when first needed and again after it was lost."""

    def __init__(self, address: Address, connect_timeout: float = 1.0, max_pending: int = 4096,
                 stall_s: float = 5.0) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self.max_pending = max_pending
        self.stall_s = stall_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    @property
    def waiting(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._conn.waiters) if self._conn is not None and not self._conn.closed else 0

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._connecting is None:  # one connect for every caller that needs it now
            self._connecting = asyncio.get_running_loop().create_future()
            try:
                self._conn = await asyncio.wait_for(self._open(), self.connect_timeout)
                self._connecting.set_result(self._conn)
            except BaseException as e:
                error = e if isinstance(e, Exception) else ConnectionLost("connecting was interrupted")
                if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
                    error = ConnectionLost(f"connecting to Redis at {self.address} took over "
                                           f"{self.connect_timeout:g} s")
                elif isinstance(e, OSError) and not isinstance(e, RedisError):
                    error = ConnectionLost(f"cannot connect to Redis at {self.address}: {e.strerror or e}")
                self._connecting.set_exception(error)
                self._connecting.exception()  # retrieved: no warning if nobody else waits
                if isinstance(e, Exception) and error is not e:
                    raise error from None
                raise
            finally:
                self._connecting = None
            return self._conn
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        a = self.address
        if a.path:
            _, conn = await loop.create_unix_connection(_Connection, a.path)
        else:
            context = ssl.create_default_context() if a.tls else None
            _, conn = await loop.create_connection(_Connection, a.host, a.port, ssl=context,
                                                   server_hostname=a.host if context else None)
        hello: list[tuple[Any, ...]] = []
        if a.password is not None:
            hello.append(("AUTH", a.username, a.password) if a.username else ("AUTH", a.password))
        if a.db:
            hello.append(("SELECT", a.db))
        try:
            for args in hello:
                await self._send(conn, args)
        except BaseException:
            conn.fail(ConnectionLost("the connection was set up but not accepted"))
            raise
        return conn

    def _waiter(self, conn: _Connection) -> asyncio.Future[Any]:
        if conn.waiters:
            if len(conn.waiters) >= self.max_pending or time.monotonic() - conn.waiters[0][1] > self.stall_s:
                conn.fail(ConnectionLost("Redis stopped answering; reconnecting"))
                raise ConnectionLost(f"Redis at {self.address} stopped answering")
        fut = asyncio.get_running_loop().create_future()
        conn.waiters.append((fut, time.monotonic()))
        return fut

    async def _send(self, conn: _Connection, args: tuple[Any, ...]) -> Any:
        fut = self._waiter(conn)
        assert conn.transport is not None
        conn.transport.write(encode(args))
        return await fut

    async def execute(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, int, None or lists of them)."""
        return await self._send(await self._connection(), args)

    async def execute_asking(self, *args: Any) -> Any:
        """ASKING, then the command, back to back on the connection (a Redis Cluster slot being moved here)."""
        conn = await self._connection()
        asking = self._waiter(conn)
        fut = self._waiter(conn)
        assert conn.transport is not None
        conn.transport.write(encode(("ASKING",)) + encode(args))
        fut.add_done_callback(_retrieved)  # if the caller gives up while waiting for ASKING's reply
        try:
            await asking
        except ReplyError:
            pass  # the command's own reply says what went wrong
        return await fut

    def drop(self) -> None:
        """Close the connection; calls waiting on it fail, and the next call connects again."""
        if self._conn is not None:
            self._conn.fail(ConnectionLost("the client was closed"))
            self._conn = None

    async def close(self) -> None:
        self.drop()
