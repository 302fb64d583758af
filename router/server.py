"""One gateway process: the ASGI app under uvicorn, with a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import sys
from typing import Any

from .config import ConfigError, RouterConfig

log = logging.getLogger("kvroute")


def run_server(config: RouterConfig, share: Any = None, worker: int = 0, sockets: list[Any] | None = None) -> int:
    """Run one gateway process until SIGTERM/SIGINT (on ``sockets`` when a parent bound them)."""
    import asyncio
    import contextlib

    import uvicorn

    from .app import build_app
    from .listener import Refusals, listener_class

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # First SIGTERM: /ready turns 503 and requests are still served for a moment, so a load balancer
            # that polls /ready stops sending before connections are refused; then the listener closes and
            # in-flight streams have shutdown_grace_s. A second signal stops at once.
            if gw.stopping or self.should_exit:
                return super().handle_exit(sig, frame)
            gw.stopping = True
            wait = gw.unready_period()
            if wait <= 0:
                return super().handle_exit(sig, frame)
            log.info("shutting down: /ready answers 503 for %.1f s before the listener closes", wait)
            loop = asyncio.get_running_loop()  # a signal handler: hand the timer to the loop through its pipe
            loop.call_soon_threadsafe(loop.call_later, wait, super().handle_exit, sig, frame)

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
    gw = app.state.gateway
    refused = Refusals(lambda reason: gw.metrics.client_refused.labels(reason).inc())
    server = Server(uvicorn.Config(
        app, host=config.host, port=config.port, loop="auto", http=listener_class(config.client, refused),
        lifespan="on", log_config=None, access_log=False, server_header=False,
        proxy_headers=False,  # only /admin looks at the client's address, and it treats relayed requests itself
        timeout_graceful_shutdown=config.shutdown_grace_s, timeout_keep_alive=75, backlog=4096,
    ))
    server.run(sockets=sockets)
    log.info("kvroute stopped")
    return 0
