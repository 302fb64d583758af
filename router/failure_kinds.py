"""What each kind of failed attempt means: one table, read by the proxy, the ticket and the metrics.

A kind is named by the exception the upstream client raised (see :mod:`router.upstream`), or by
the status a replica answered with (``status_5xx``, ``status_429``), or, once the answer has
started, by how the stream ended (``stream_broken``, ``stream_idle_timeout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FailureKind:
    label: str  # the ``kind`` label of kvroute_upstream_errors_total and kvroute_retries_total
    retry: bool  # may be tried again on another replica (only before the first byte went to the client)
    # what it says of the replica: eject takes it out of rotation at once; count adds to its failures in a row
    # (health.eject_after of them take it out); ignore says nothing (429 is back-pressure, not a fault)
    health: Literal["ignore", "count", "eject"]
    status: int  # what the client gets when every attempt failed so and no replica answer can be passed on
    type: str  # the OpenAI error type of that answer (or of the SSE error event once streaming)
    code: str
    message: str


def _kind(label: str, retry: bool, health: Literal["ignore", "count", "eject"], status: int, type: str, code: str,
          message: str) -> FailureKind:
    return FailureKind(label, retry, health, status, type, code, message)


KINDS: dict[str, FailureKind] = {k.label: k for k in (
    # before the response: nothing reached the client, another replica may answer
    _kind("connect", True, "eject", 502, "upstream_error", "upstream_unavailable", "could not connect"),
    _kind("connect_timeout", True, "count", 504, "upstream_error", "upstream_timeout", "connecting timed out"),
    _kind("timeout", True, "count", 504, "upstream_error", "upstream_timeout", "no response in time"),
    _kind("closed", True, "count", 502, "upstream_error", "upstream_unavailable", "closed the connection"),
    _kind("protocol", True, "count", 502, "upstream_error", "upstream_unavailable", "sent invalid HTTP"),
    # the replica answered with an error: passed on as it was if no other replica does better
    _kind("status_5xx", True, "count", 502, "upstream_error", "upstream_unavailable", "answered 5xx"),
    _kind("status_429", True, "ignore", 429, "rate_limit_error", "upstream_overloaded", "answered 429"),
    # a JSON answer cut short while the router still held it: nothing reached the client
    _kind("body_broken", True, "count", 502, "upstream_error", "upstream_disconnected",
          "ended its answer early"),
    # taken out while the request waited: it answered nothing for health.stall_s and its engine did not move
    _kind("stalled", True, "ignore", 504, "upstream_error", "upstream_stalled", "answered nothing for too long"),
    # after the first byte the answer is committed: never retried, ended with an SSE error event
    _kind("stream_broken", False, "count", 502, "upstream_error", "upstream_disconnected",
          "the replica ended the stream unexpectedly"),
    _kind("stream_idle_timeout", False, "count", 504, "timeout", "stream_idle_timeout",
          "the replica sent nothing for too long"),
    # a replica asked to continue a broken stream (proxy.stream_failover) did not answer with a stream
    _kind("continuation_refused", False, "ignore", 502, "upstream_error", "upstream_disconnected",
          "no replica could continue the stream"),
)}
