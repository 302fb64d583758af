"""A small Redis client for the hot path: RESP2 over one pipelined asyncio connection.

Why not redis-py's asyncio client here: it spends about 180 us of CPU per command (a PING
included) in its connection pool, locks and retry layers, more than the rest of a routing
decision. This client writes each command at once on one shared connection and matches replies
to callers in order; about 10 us per command.

Every wait is bounded by its caller (``asyncio.timeout``): a call that timed out still gets its
reply slot, and the reply is dropped when it comes. If replies stop coming (more than
``max_pending`` calls waiting, or the oldest waiting longer than ``stall_s``), the connection is
dropped, every waiting call fails, and the next call connects again.

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS), ``unix:///path?db=N``.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


# A Lua function for scripts that change a hash: from ARGV[i] on, n (field, value) pairs to set, then every
# remaining argument a field to delete (in batches, within Lua's limit on unpack).
LUA_HASH_CHANGES = """
local function hash_changes(key, n, i)
  while n > 0 do
    local upto = math.min(n, 500)
    local batch = {}
    for j = 1, upto do
      batch[#batch + 1] = ARGV[i]; batch[#batch + 1] = ARGV[i + 1]; i = i + 2
    end
    redis.call('HSET', key, unpack(batch))
    n = n - upto
  end
  local gone = {}
  while i <= #ARGV do
    gone[#gone + 1] = ARGV[i]; i = i + 1
    if #gone >= 500 then redis.call('HDEL', key, unpack(gone)); gone = {} end
  end
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
end
"""


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


class Redis:
    def __init__(self, url: str, connect_timeout: float = 1.0, max_pending: int = 4096, stall_s: float = 5.0) -> None:
        parts = urlsplit(url)
        self.scheme = parts.scheme
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.path = parts.path
        query = parse_qs(parts.query)
        if parts.scheme == "unix":
            self.db = int(query.get("db", ["0"])[0])
        else:
            self.db = int(parts.path.strip("/") or query.get("db", ["0"])[0])
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        self.connect_timeout = connect_timeout
        self.max_pending = max_pending
        self.stall_s = stall_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._scripts: dict[bytes, bytes] = {}  # sha1 hex -> source

    # -- connection ----------------------------------------------------------------------------

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
                    error = ConnectionLost(f"connecting to Redis took over {self.connect_timeout:g} s")
                self._connecting.set_exception(error)
                self._connecting.exception()  # retrieved: no warning if nobody else waits
                raise
            finally:
                self._connecting = None
            return self._conn
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self.scheme == "unix":
            _, conn = await loop.create_unix_connection(_Connection, self.path)
        else:
            context = ssl.create_default_context() if self.scheme == "rediss" else None
            _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=context,
                                                   server_hostname=self.host if context else None)
        hello: list[tuple[Any, ...]] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
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
                raise ConnectionLost("Redis stopped answering")
        fut = asyncio.get_running_loop().create_future()
        conn.waiters.append((fut, time.monotonic()))
        return fut

    async def _send(self, conn: _Connection, args: tuple[Any, ...]) -> Any:
        fut = self._waiter(conn)
        assert conn.transport is not None
        conn.transport.write(encode(args))
        return await fut

    # -- commands ------------------------------------------------------------------------------

    async def execute(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, int, None or lists of them)."""
        return await self._send(await self._connection(), args)

    def script(self, source: str) -> bytes:
        """Register a Lua script; returns its SHA1 for :meth:`evalsha`."""
        sha = hashlib.sha1(source.encode()).hexdigest().encode()
        self._scripts[sha] = source.encode()
        return sha

    async def evalsha(self, sha: bytes, keys: list[str], args: list[Any]) -> Any:
        """Run a registered script; loads it first if the server does not know it (restarted, flushed)."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except ReplyError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        await self.execute("SCRIPT", "LOAD", self._scripts[sha])
        return await self.execute("EVALSHA", sha, len(keys), *keys, *args)

    async def load_scripts(self) -> None:
        for source in self._scripts.values():
            await self.execute("SCRIPT", "LOAD", source)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.fail(ConnectionLost("the client was closed"))
            self._conn = None
