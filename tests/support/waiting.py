"""Waiting for a condition, and telling whether anything listens."""

from __future__ import annotations

import time
from typing import Callable

import httpx

from loadtest.cluster import HTTP


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Poll until ``predicate()`` holds; return the seconds it took (fails the test on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def refused(url: str) -> bool:
    """Nothing listens at ``url``'s port (the connection is refused)."""
    try:
        HTTP.get(url, timeout=1)
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return False  # accepted, then closed unanswered: the listener is closing but still takes connections
    return False
