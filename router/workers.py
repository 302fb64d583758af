"""Several worker processes on one port: ``kvroute serve --workers N``.

The parent binds the listening socket, makes the memory the workers share (the load table,
:class:`~router.load.HostShare`), and forks N workers; each runs a whole gateway on the inherited
socket, and the kernel hands each new connection to one of them. Workers share in-flight requests,
pending prefill and drained flags at once through that memory, and the prefix index and sessions
through Redis. Each worker checks health and scrapes ``/metrics`` at N times the configured
interval, staggered, so replicas see the configured rate. ``/metrics`` of any worker shows the
whole router (prometheus_client's multiprocess mode). SIGTERM or SIGINT to the parent drains every
worker (in-flight streams may finish for ``shutdown_grace_s``); a worker that dies is started again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from . import hops
from .config import ConfigError, RouterConfig

log = logging.getLogger("kvroute.workers")

_RESTART_BACKOFF_S = 1.0


def check(config: RouterConfig) -> None:
    """Refuse a configuration that cannot be served: a policy stage that does not exist or takes other
    parameters, or several workers with a cache-aware policy and no shared index (raises ConfigError
    naming the field and the fix)."""
    from .policy import build_policy

    policy = build_policy(config.policy, config.cache_aware)
    if config.workers > 1 and policy.uses_prefix and config.index.backend == "memory":
        raise ConfigError("invalid configuration:\n  workers: several workers with a cache-aware policy need a "
                          "shared prefix index: add --index redis://HOST:PORT/DB (or run one worker)")


def _bind(config: RouterConfig) -> socket.socket:
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def _worker(config: RouterConfig, share: Any, index: int, sock: socket.socket) -> None:
    from . import logs
    from .server import run_server

    logs.setup(config.log.level, config.log.json_format)
    logging.getLogger("kvroute").info("worker %d of %d starting (pid %d)", index, config.workers, os.getpid())
    try:
        status = run_server(config, share=share, worker=index, sockets=[sock])
    finally:
        logs.shutdown()  # a forked worker leaves through os._exit: no atexit handlers run
    sys.exit(status)


def run(config: RouterConfig) -> int:
    """Run ``config.workers`` workers until SIGTERM/SIGINT; returns the exit status."""
    metrics_dir = tempfile.mkdtemp(prefix="kvroute-metrics-")
    # before prometheus_client is imported anywhere: values go to files the workers share
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import multiprocess

    from .load import HostShare

    try:
        sock = _bind(config)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e.strerror or e)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        return 1
    share = HostShare(config.workers, config.membership.max_replicas,
                      session_slots=config.sessions.max_local if config.index.backend == "memory" else 0)
    hops.share_with_workers()
    ctx = multiprocessing.get_context("fork")
    procs: list[Any] = [None] * config.workers
    stopping = {"signal": 0}

    def start(i: int) -> None:
        p = ctx.Process(target=_worker, args=(config, share, i, sock), name=f"kvroute-worker-{i}", daemon=False)
        p.start()
        procs[i] = p

    def on_signal(signum: int, frame: Any) -> None:
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for i in range(config.workers):
        start(i)
    log.info("kvroute listening on %s:%d with %d workers", config.host, config.port, config.workers)
    restarts_at: dict[int, float] = {}
    try:
        while not stopping["signal"]:
            time.sleep(0.1)
            for i, p in enumerate(procs):
                if p is not None and not p.is_alive() and not stopping["signal"]:
                    multiprocess.mark_process_dead(p.pid)
                    log.error("worker %d (pid %d) exited with %s; starting it again", i, p.pid, p.exitcode)
                    procs[i] = None
                    restarts_at[i] = time.monotonic() + _RESTART_BACKOFF_S
            for i, when in list(restarts_at.items()):
                if time.monotonic() >= when and not stopping["signal"]:
                    del restarts_at[i]
                    start(i)
        log.info("stopping %d workers (in-flight requests may finish for %.0f s)", config.workers,
                 config.shutdown_grace_s)
        for p in procs:
            if p is not None and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + config.shutdown_grace_s + 5.0
        for p in procs:
            if p is not None:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    log.warning("worker pid %d did not stop in time; killing it", p.pid)
                    p.kill()
                    p.join(5)
        return 0
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
