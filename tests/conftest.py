"""Fixtures that run real processes on 127.0.0.1: simulated vLLM replicas and kvroute routers."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from loadtest.cluster import Proc, RedisCluster, redis_server, router, simulator, slow_proxy, wait_redis

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


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.stop_all()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for p in c.procs:
            print(f"----- {p.name} log -----\n{p.log_tail()}")


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[Proc]:
    """A throw-away redis-server of this test's own, on a free port."""
    p = redis_server(log_dir=tmp_path).start()
    wait_redis(p)
    yield p
    p.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A Redis Cluster (3 masters, 3 replicas) for the whole session; tests that kill nodes start their own."""
    c = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield c
    c.stop()


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where routers share their state: a redis-server of this test's own, or the session's Redis Cluster
    (emptied first). A test taking it runs once on each."""
    if request.param == "redis":
        p = redis_server(log_dir=tmp_path).start()
        wait_redis(p)
        yield f"redis://127.0.0.1:{p.port}/0"
        p.stop()
    else:
        c = request.getfixturevalue("redis_cluster")
        c.flush()
        yield c.url


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


# Figures the fault and soak suites report (printed at the end of the run, for docs/operations.md).
FIGURES: list[tuple[str, dict]] = []


@pytest.fixture
def figure(request: pytest.FixtureRequest):
    def record(values: dict) -> None:
        FIGURES.append((request.node.name, values))
    return record


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if FIGURES:
        terminalreporter.section("figures")
        for name, values in FIGURES:
            terminalreporter.write_line(f"{name}: {values}")
