"""A compose project brought up, inspected and torn down by the tests, with podman (podman-compose) or Docker.

``KVROUTE_COMPOSE_ENGINE=docker`` runs the same tests with ``docker compose`` and registry images; the default,
podman, takes its settings and the base images' local stand-ins from ``tests/compose/setup.sh``. Podman without
systemd runs no health-check timers: :meth:`Stack.check_health` runs each container's own health check, as the
timer would, and reads the state the engine keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .paths import ROOT

ENGINE = os.environ.get("KVROUTE_COMPOSE_ENGINE", "podman")


def engine_env() -> dict[str, str]:
    """The environment compose and the engine run with (podman: the set-up script's settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUTER_", "PROMETHEUS_", "GRAFANA_"))}
    if ENGINE != "podman":
        return env
    out = subprocess.run(["bash", str(ROOT / "tests" / "compose" / "setup.sh")], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"tests/compose/setup.sh failed:\n{out.stderr[-4000:]}")
    for line in out.stdout.splitlines():
        if "=" in line:
            k, _, v = line.partition("=")
            env[k] = v
    # keep the Dockerfile's HEALTHCHECK in the image (podman's default image format drops it)
    env["BUILDAH_FORMAT"] = "docker"
    return env


def compose_command() -> list[str]:
    if ENGINE == "podman":
        return [str(Path(sys.executable).parent / "podman-compose")]
    return [ENGINE, "compose"]


@dataclass
class Stack:
    """One compose project: ``file`` run as project ``name`` with ``variables`` set (ports, paths)."""

    file: Path
    name: str
    env: dict[str, str]
    variables: dict[str, str] = field(default_factory=dict)
    profiles: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)  # what the tests measured, in seconds
    _ticker: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        prof = [a for p in self.profiles for a in ("--profile", p)]
        cmd = [*compose_command(), "-p", self.name, "-f", str(self.file), *prof, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.file.parent,
                             env={**self.env, **self.variables})
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def engine(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        out = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and out.returncode != 0:
            raise RuntimeError(f"{ENGINE} {' '.join(args)}: exit {out.returncode}\n{out.stderr[-3000:]}")
        return out.stdout

    def containers(self, service: str | None = None) -> list[str]:
        """The project's containers (of one service), running or not."""
        filters = ["--filter", f"label=com.docker.compose.project={self.name}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.engine("ps", "-a", *filters, "--format", "{{.Names}}").split()

    def container(self, service: str) -> str:
        names = self.containers(service)
        if len(names) != 1:
            raise LookupError(f"{service}: containers {names}")
        return names[0]

    def state(self, service: str) -> dict:
        return json.loads(self.engine("inspect", "--format", "{{json .State}}", self.container(service)))

    def health(self, service: str) -> str:
        s = self.state(service)
        return ((s.get("Health") or s.get("Healthcheck") or {}).get("Status")) or "none"

    def check_health(self) -> None:
        """Run every running container's health check once (podman: what a systemd timer would do)."""
        if ENGINE != "podman":
            return
        for name in self.containers():
            self.engine("healthcheck", "run", name, check=False, timeout=30)

    def drive_health_checks(self, interval: float = 5.0) -> None:
        """Keep running the health checks in the background until :meth:`stop_health_checks`, every
        ``interval`` seconds (the compose files' interval)."""
        if ENGINE != "podman" or self._ticker is not None:
            return
        self._stop.clear()

        def tick() -> None:
            while not self._stop.wait(interval):
                try:
                    self.check_health()
                except (subprocess.SubprocessError, RuntimeError):
                    pass  # a container going away between ps and the check
        self._ticker = threading.Thread(target=tick, daemon=True, name=f"health-{self.name}")
        self._ticker.start()

    def stop_health_checks(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=60)
            self._ticker = None

    def wait_healthy(self, services: list[str], timeout: float) -> float:
        """Seconds until every service's container reports healthy."""
        start = time.monotonic()
        while True:
            self.check_health()
            states = {s: self.health(s) for s in services}
            if all(v == "healthy" for v in states.values()):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"not healthy after {timeout} s: {states}")
            time.sleep(1.0)

    def logs(self, service: str, tail: int = 50) -> str:
        out = subprocess.run([ENGINE, "logs", "--tail", str(tail), self.container(service)], capture_output=True,
                             text=True, timeout=30, env=self.env)
        return out.stdout + out.stderr

    def down(self) -> None:
        self.stop_health_checks()
        self.compose("down", "-v", "-t", "5", check=False, timeout=300)
