"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import time
from typing import Callable

import httpx

from loadtest.cluster import Proc


# -- helpers used across tests ---------------------------------------------------------------


def sim_state(sim: Proc) -> dict:
    return httpx.get(sim.url + "/sim/state", timeout=2).json()["counters"]


def set_faults(sim: Proc, **faults: object) -> None:
    httpx.post(sim.url + "/sim/faults", json=faults, timeout=2).raise_for_status()


def replicas_view(router_proc: Proc, headers: dict[str, str] | None = None) -> dict[str, dict]:
    body = httpx.get(router_proc.url + "/admin/replicas", headers=headers, timeout=2).json()
    return {r["url"]: r for r in body["replicas"]}


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Poll until ``predicate()`` holds; return the seconds it took (fails the test on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def sse_events(raw: bytes) -> list[str]:
    """The data lines of an SSE body, in order."""
    return [block[len(b"data: "):].decode() for block in raw.split(b"\n\n") if block.startswith(b"data: ")]


def sse_json(raw: bytes) -> list[dict]:
    return [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]


