"""Start and stop local processes (simulated replicas, routers) on 127.0.0.1, each stopped by its PID.

Used by the tests, the benchmarks and the local demo.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent

# One client for probes and control requests to local processes: httpx.get() and the like build a client,
# and with it a TLS context (about 40 ms of CPU), on every call. No keep-alive: no connection outlives the
# process it went to (the next one may take its port).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=5.0)


# Ports handed out by this process. They come from below the kernel's ephemeral range: a port the kernel
# chooses itself (a bind to port 0, as a replica's event publisher does while it starts; a client
# connection's own end) can then never be one handed out here for a process still about to bind it.
_issued: set[int] = set()


def _handed_out_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range (``ip_local_port_range``), or 20000-60000 if that leaves few."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (10000, low) if low - 10000 >= 4096 else (20000, 60000)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A port free on 127.0.0.1 now, not handed out before by this process, and not one the kernel hands out."""
    import random
    lo, hi = _handed_out_range()
    for _ in range(1000):
        port = random.randrange(lo, hi)
        if port not in _issued and _bindable(port):
            _issued.add(port)
            return port
    raise RuntimeError("no free port that was not handed out already")


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports, none handed out before by this process (for a process serving
    several replicas)."""
    import random
    lo, hi = _handed_out_range()
    for _ in range(100):
        base = random.randrange(lo, hi - n)
        if not _issued.isdisjoint(range(base, base + n)):
            continue
        if all(_bindable(base + i) for i in range(n)):
            _issued.update(range(base, base + n))
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


@dataclass
class Proc:
    """A child process on a known port."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] | None = None
    log_path: Path | None = None
    # Own session and process group: stop() and kill() reach the children too (vLLM runs an engine
    # process), and the kernel's autogroup scheduler gives the process its own CPU share, as a service
    # on its own would have. Left in the caller's session, a router shares one share with the test or
    # load generator that drives it: on 2 cores beside busy vLLM replicas it then waited seconds for a core.
    group: bool = True
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> "Proc":
        env = dict(os.environ)
        env.update(self.env or {})
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.popen = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=self.group)
        return self

    def wait_http(self, path: str = "/health", timeout: float = 20.0, want: int = 200) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; first errors in its log: "
                                   f"{self.log_errors()}; log: {self.log_tail()}")
            try:
                r = HTTP.get(self.url + path, timeout=1.0)
                if r.status_code == want:
                    return
                last = r.status_code
            except httpx.HTTPError as e:
                last = e
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not answer {path} with {want} in {timeout}s (last: {last!r}); "
                           f"log: {self.log_tail()}")

    def log_errors(self, n: int = 12) -> str:
        """The log's first ``n`` lines that name an error, with their line numbers: the root cause of a failed
        start (vLLM's engine process writes it long before the API server's closing traceback)."""
        if not (self.log_path and self.log_path.exists()):
            return "(no log)"
        lines = self.log_path.read_bytes().decode(errors="replace").splitlines()
        hits = [f"{i + 1}: {line.strip()[:300]}" for i, line in enumerate(lines)
                if any(w in line for w in ("Error", "error:", "ERROR", "Exception", "Killed"))]
        # vLLM prefixes every line of a traceback with ERROR, so the first hits are its opening frames: the
        # exceptions themselves ("SomethingError: why") come first
        raised = [f"{i + 1}: {line.strip()[:300]}" for i, line in enumerate(lines)
                  if re.search(r"\b\w*(Error|Exception): ", line)]
        return " | ".join(raised[:n] + hits[:n]) or "(none)"

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return "(no log)"

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def _signal_group(self, sig: int) -> None:
        assert self.popen is not None
        try:
            if self.group:
                os.killpg(self.popen.pid, sig)  # the group's id is the PID of the process started here
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL and reap: the process dies as a crashed replica would."""
        if self.popen is not None and self.popen.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.popen.wait(5)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(5)
        if self.group:  # children that outlived the leader
            self._signal_group(signal.SIGKILL)
        return self.popen.returncode

    def restart(self) -> "Proc":
        self.stop()
        return self.start()


def simulator(port: int | None = None, model: str = "tiny", *args: str, log_dir: Path | None = None,
              name: str | None = None) -> Proc:
    port = port or free_port()
    argv = [sys.executable, "-m", "loadtest.simulator", "--port", str(port), "--model", model, *args]
    name = name or f"sim-{port}"
    return Proc(name, argv, port, log_path=(log_dir / f"{name}.log") if log_dir else None)


def router(replicas: list[str], *args: str, port: int | None = None, log_dir: Path | None = None,
           env: dict[str, str] | None = None, name: str = "router") -> Proc:
    port = port or free_port()
    argv = [sys.executable, "-m", "router", "serve", "--port", str(port)]
    for r in replicas:
        argv += ["--replica", r]
    argv += list(args)
    return Proc(name, argv, port, env=env, log_path=(log_dir / f"{name}-{port}.log") if log_dir else None)


def slow_proxy(to_port: int, delay_ms: float, port: int | None = None, log_dir: Path | None = None) -> Proc:
    """``loadtest.slow_proxy`` in front of 127.0.0.1:``to_port``: every read held ``delay_ms`` each way."""
    port = port or free_port()
    argv = [sys.executable, "-m", "loadtest.slow_proxy", "--port", str(port), "--to", f"127.0.0.1:{to_port}",
            "--delay-ms", str(delay_ms)]
    return Proc(f"slow-{port}", argv, port, log_path=(log_dir / f"slow-{port}.log") if log_dir else None)


def redis_server(port: int | None = None, log_dir: Path | None = None) -> Proc:
    """A throw-away redis-server on 127.0.0.1 that keeps nothing on disk."""
    port = port or free_port()
    argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--daemonize", "no"]
    return Proc(f"redis-{port}", argv, port, log_path=(log_dir / f"redis-{port}.log") if log_dir else None)


def _cluster_port() -> int:
    """A free port for a cluster node, with the cluster bus port (10000 higher) free too; both below the kernel's
    ephemeral range where it leaves room (see :func:`free_port`)."""
    import random
    lo, hi = _handed_out_range()
    lo, hi = (lo, hi - 10000) if hi - 10000 - lo >= 2000 else (20000, 45000)
    for _ in range(1000):
        port = random.randrange(lo, hi)
        if port in _issued or port + 10000 in _issued:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        _issued.update((port, port + 10000))
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisCluster:
    """A throw-away Redis Cluster on 127.0.0.1: ``masters`` masters with ``replicas`` replicas each, nothing kept
    on disk but the nodes' own cluster files (in ``work_dir``). Failover after ``node_timeout_ms`` of silence."""

    def __init__(self, work_dir: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.work_dir = work_dir
        self.node_timeout_ms = node_timeout_ms
        self.procs: list[Proc] = []
        for _ in range(masters * (1 + replicas)):
            port = _cluster_port()
            argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                    "--protected-mode", "no", "--daemonize", "no", "--cluster-enabled", "yes",
                    "--cluster-config-file", str(work_dir / f"nodes-{port}.conf"), "--dir", str(work_dir),
                    "--cluster-node-timeout", str(node_timeout_ms), "--repl-diskless-sync-delay", "0"]
            self.procs.append(Proc(f"redis-cluster-{port}", argv, port, log_path=work_dir / f"redis-{port}.log"))
        self.replicas = replicas

    @property
    def url(self) -> str:
        """Every node as a seed; a client needs one."""
        return "redis://" + ",".join(f"127.0.0.1:{p.port}" for p in self.procs)

    def start(self, timeout: float = 30.0) -> "RedisCluster":
        """Start the nodes and join them; if that fails, every node started is stopped again."""
        try:
            for p in self.procs:
                p.start()
            for p in self.procs:
                wait_redis(p)
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p.port}" for p in self.procs),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=timeout)
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def cli(self, port: int, *args: str, timeout: float = 5.0) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                              timeout=timeout).stdout

    def alive(self) -> list[Proc]:
        return [p for p in self.procs if p.popen is not None and p.popen.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says the cluster is ok and every slot is served, and every replica has
        its master's data (a replica that never synced cannot take over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [self.cli(p.port, "CLUSTER", "INFO") for p in self.alive()]
            if infos and all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos):
                roles = [self.cli(p.port, "INFO", "replication") for p in self.alive()]
                if all("role:master" in r or "master_link_status:up" in r for r in roles):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"the Redis Cluster did not come up in {timeout:g} s")

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Port of each running master -> the slot ranges it serves."""
        alive = self.alive()
        out: dict[int, list[tuple[int, int]]] = {}
        for line in self.cli(alive[0].port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if len(fields) < 8 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            ranges = []
            for item in fields[8:]:
                if item.startswith("["):
                    continue
                a, _, b = item.partition("-")
                ranges.append((int(a), int(b or a)))
            if ranges:
                out[port] = ranges
        return out

    def proc(self, port: int) -> Proc:
        return next(p for p in self.procs if p.port == port)

    def flush(self) -> None:
        for port in self.masters():
            self.cli(port, "FLUSHALL")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=5)


def wait_redis(proc: Proc, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", proc.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"redis on port {proc.port} did not answer PING; log: {proc.log_tail()}")


def prometheus_server(config: Path, data_dir: Path, port: int | None = None, log_dir: Path | None = None) -> Proc:
    """Debian's (or any) ``prometheus`` binary on 127.0.0.1 with its own data folder."""
    port = port or free_port()
    argv = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    return Proc(f"prometheus-{port}", argv, port,
                log_path=(log_dir / f"prometheus-{port}.log") if log_dir else None)


async def serve_until_stopped(handler: Any, host: str, port: int) -> None:
    """Run an asyncio TCP server with ``handler`` until SIGTERM or SIGINT (the fault tests' small servers)."""
    server = await asyncio.start_server(handler, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
