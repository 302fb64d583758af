"""A lean HTTP/1.1 keep-alive client for load generation.

The load generator shares the machine's cores with the router and the replicas, so it must
spend as little CPU per request as possible: this client parses only the status line, the
framing headers and chunked encoding, and timestamps the first body byte.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class Result:
    status: int
    ttfb: float  # seconds from sending the request to the first body byte
    total: float  # seconds from sending the request to the last body byte
    body: bytes
    headers: dict[bytes, bytes]


class H1Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = None

    async def post(self, path: str, body: bytes, extra_headers: bytes = b"") -> Result:
        if self.reader is not None and self.reader.at_eof():  # the server closed it while idle
            await self.close()
        if self.writer is None:
            await self._connect()
        try:
            return await self._exchange(path, body, extra_headers)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            await self.close()
            raise

    async def _exchange(self, path: str, body: bytes, extra_headers: bytes) -> Result:
        assert self.reader is not None and self.writer is not None
        start = time.perf_counter()
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n%s\r\n%s" % (path.encode(), self.host.encode(), len(body),
                                                               extra_headers, body))
        r = self.reader
        status_line = await r.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        while True:
            line = await r.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        parts: list[bytes] = []
        ttfb = None
        if headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await r.readuntil(b"\r\n")
                    break
                chunk = await r.readexactly(size + 2)
                if ttfb is None:
                    ttfb = time.perf_counter() - start
                parts.append(chunk[:-2])
        else:
            n = int(headers.get(b"content-length", b"0"))
            data = await r.readexactly(n) if n else b""
            ttfb = time.perf_counter() - start
            parts.append(data)
        total = time.perf_counter() - start
        if headers.get(b"connection") == b"close":
            await self.close()
        return Result(status, ttfb if ttfb is not None else total, total, b"".join(parts), headers)
