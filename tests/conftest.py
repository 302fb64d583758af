"""Fixtures that run real processes on 127.0.0.1: simulated vLLM replicas and kvroute routers."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from loadtest.cluster import Proc, RedisCluster, redis_server, wait_redis
from support.processes import Cluster


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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that takes ``shared_url`` runs several routers on one store: it belongs to the ``shared`` marker (before
    ``-m`` selects), unless it is already in another suite's (the markers pyproject.toml declares)."""
    suites = [m.split(":", 1)[0] for m in config.getini("markers")]
    for item in items:
        if "shared_url" in getattr(item, "fixturenames", ()) and \
                not any(item.get_closest_marker(m) for m in suites):
            item.add_marker(pytest.mark.shared)


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
