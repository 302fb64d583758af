"""One gateway process: the ASGI app under uvicorn, with a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import sys
from typing import Any

from .config import ConfigError, RouterConfig

log = logging.getLogger("kvroute")


def run_server(config: RouterConfig, share: Any = None, worker: int = 0, sockets: list[Any] | None = None) -> int:
    """Run one gateway process until SIGTERM/SIGINT (on ``sockets`` when a parent bound them)."""
    import contextlib

    import uvicorn

    from .api import build_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            with super().capture_signals():
                yield
                # the graceful stop is done: exit normally (status 0, logs flushed) instead of
                # re-raising SIGTERM/SIGINT, which would kill the process before the log thread drains
                self._captured_signals.clear()

    try:
        app = build_app(config, share, worker)
    except ConfigError as e:
        sys.stderr.write(f"kvroute: {e}\n")
        return 2
    server = Server(uvicorn.Config(
        app, host=config.host, port=config.port, loop="auto", http="httptools",
        lifespan="on", log_config=None, access_log=False, server_header=False,
        proxy_headers=False,  # only /admin looks at the client's address, and it treats relayed requests itself
        timeout_graceful_shutdown=config.shutdown_grace_s, timeout_keep_alive=75, backlog=4096,
    ))
    server.run(sockets=sockets)
    log.info("kvroute stopped")
    return 0
