"""A replica that is healthy to its health checks and broken for its requests, in one of several ways.

    python -m loadtest.bad_replica --port 9009 --mode garbage

``/health``, ``/v1/models`` and ``/metrics`` answer as a healthy vLLM would (so only what the router
sees on real requests can take it out of rotation); a generation request (any POST) gets, by mode:

- ``garbage``: bytes that are not HTTP, then the connection closes;
- ``truncated_chunked``: a 200 stream in chunked encoding whose chunk is shorter than its size line;
- ``invalid_sse``: a 200 ``text/event-stream`` that sends one event that is not JSON, then closes;
- ``slow``: a well-formed answer sent one byte per second;
- ``no_read``: the request is never read and nothing is answered (the connection stays open).

For the fault tests: all on 127.0.0.1, a raw asyncio server with no framework to mend what it sends.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from .cluster import serve_until_stopped

MODES = ("garbage", "truncated_chunked", "invalid_sse", "slow", "no_read")


class BadReplica:
    def __init__(self, mode: str, model: str) -> None:
        self.mode = mode
        self.models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm",
                                                              "root": model, "max_model_len": 4096}]}).encode()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                if method == b"POST":
                    return await self.broken(reader, writer, head)
                body, ctype = b"", b"text/plain"
                if path == b"/v1/models":
                    body, ctype = self.models, b"application/json"
                elif path == b"/metrics":
                    body = b"# kvroute bad replica\n"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (ctype, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def broken(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        if self.mode == "no_read":
            await asyncio.Event().wait()  # cancelled when the server stops
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        if self.mode == "garbage":
            writer.write(b"\x00\x17NOT HTTP AT ALL\r\n\r\n\xff\xfe")
        elif self.mode == "truncated_chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"400\r\ndata: {\"id\": \"x\"")
        elif self.mode == "invalid_sse":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100\r\n\r\n"
                         b"data: {this is not json\n\n")
        elif self.mode == "slow":
            body = b'{"error": {"message": "slow", "type": "x", "param": null, "code": 503}}'
            answer = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            for i in range(len(answer)):
                writer.write(answer[i:i + 1])
                await writer.drain()
                await asyncio.sleep(1.0)
        await writer.drain()


async def main(args: argparse.Namespace) -> None:
    await serve_until_stopped(BadReplica(args.mode, args.model).serve, args.host, args.port)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bad_replica", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", choices=MODES, required=True)
    return p


if __name__ == "__main__":
    asyncio.run(main(parser().parse_args()))
