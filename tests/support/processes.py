"""Processes a test starts: stand-in replicas, routers, slow links; all stopped by PID at its end."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import yaml

from loadtest.cluster import Proc, free_port, router, simulator, slow_proxy

# Fast by default: tests set slower timings where they need them.
FAST = ("--ttft-ms", "2", "--itl-ms", "1")


class Cluster:
    """Processes started by one test; all stopped (by PID) at its end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def sim(self, *args: str, model: str = "tiny", port: int | None = None, name: str | None = None,
            wait: bool = True) -> Proc:
        p = simulator(port, model, *(args or FAST), log_dir=self.log_dir, name=name)
        self.procs.append(p.start())
        if wait:
            p.wait_http()
        return p

    def router(self, replicas: list[Proc] | list[str], *args: str, config: dict | None = None,
               env: dict[str, str] | None = None, wait_ready: bool = True, port: int | None = None) -> Proc:
        urls = [r.url if isinstance(r, Proc) else r for r in replicas]
        extra = list(args)
        if config is not None:
            path = self.log_dir / f"router-{len(self.procs)}.yaml"
            path.write_text(yaml.safe_dump(config))
            extra = ["--config", str(path), *extra]
        p = router(urls, *extra, log_dir=self.log_dir, env=env, port=port)
        self.procs.append(p.start())
        p.wait_http("/health")
        if wait_ready:
            p.wait_http("/ready", timeout=15)
        return p

    def slow_link(self, to: Proc, delay_ms: float) -> Proc:
        """A proxy in front of ``to`` that holds every read ``delay_ms`` each way, once it listens."""
        p = slow_proxy(to.port, delay_ms, log_dir=self.log_dir)
        self.procs.append(p.start())
        return self._listening(p)

    def otlp_receiver(self) -> Proc:
        """An OTLP/HTTP trace receiver (support/otlp_receiver.py): POST /v1/traces, GET /spans."""
        port = free_port()
        p = Proc(f"otlp-{port}", [sys.executable, str(Path(__file__).with_name("otlp_receiver.py")), str(port)], port,
                 log_path=self.log_dir / f"otlp-{port}.log")
        self.procs.append(p.start())
        return self._listening(p)

    def _listening(self, p: Proc) -> Proc:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", p.port)) == 0:
                    return p
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.name} is not listening: {p.log_tail(800)}")
            time.sleep(0.1)

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=5)
