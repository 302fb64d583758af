"""A TCP proxy that delays everything it forwards: a slow network (or a slow Redis) for the fault tests.

    python -m loadtest.slow_proxy --port 7001 --to 127.0.0.1:6379 --delay-ms 100

Each read from either side is held ``--delay-ms`` before it is written to the other (bytes keep their
order). All on 127.0.0.1; stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio

from .cluster import serve_until_stopped


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    try:
        while data := await reader.read(65536):
            await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(args: argparse.Namespace) -> None:
    host, port = args.to.rsplit(":", 1)
    delay = args.delay_ms / 1000

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w, delay), pipe(up_r, client_w, delay))

    await serve_until_stopped(handle, "127.0.0.1", args.port)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.slow_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--to", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=100.0)
    return p


if __name__ == "__main__":
    asyncio.run(main(parser().parse_args()))
