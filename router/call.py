"""One client request on its way through the gateway: what it carries, the headers that pass each way, and
the limit on writing its answer to the client."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .request import RouteRequest

if TYPE_CHECKING:
    from .stream_failover import Splice, Transcript
    from .routing import Ticket

# Request headers a client may pass on to a replica (credentials never: they come from config).
FORWARD_REQUEST_HEADERS = frozenset({b"content-type", b"accept", b"accept-encoding", b"traceparent", b"tracestate",
                                     b"x-session-id", b"openai-organization", b"openai-project"})
TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})
# Response headers that describe one hop only (the upstream parser gives names in lower case).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                        b"proxy-authenticate", b"proxy-connection", b"date", b"server", b"x-request-id"})
# usage.prompt_tokens in an answer (the whole body, or a stream's usage chunk): teaches byte mode
PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,9})')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})')


@dataclass
class Call:
    """One client request on its way through the gateway."""

    path: str
    body: bytes
    model: str | None
    stream: bool
    request_id: str
    headers: bytes  # the client's headers a replica may see, as HTTP/1.1 header lines
    started: float
    route: RouteRequest
    attempts: int = 0
    outcome: str = "ok"
    replica: str = "none"
    status: int = 0
    ttfb: float | None = None
    ticket: Ticket | None = None  # the latest attempt's
    prompt_tokens: int | None = None  # the replica's usage.prompt_tokens, when it was looked for
    sent_at: float = 0.0  # the last attempt's request went to the replica
    upstream_ttfb: float | None = None  # from then to the replica's first body byte
    sse_open: bool = False  # an SSE stream has started and not ended: it can still be closed with an error event
    tail: bytes = b"\n\n"  # the last bytes sent on it
    broken: str | None = None  # the failure kind that ended the answer after it started
    resume: Transcript | None = None  # kept for a stream that may go on on another replica if its own fails
    splice: Splice | None = None  # set while another replica continues the stream
    continued: bytes | None = None  # the request body that asks for the continuation
    method: bytes = b"POST"
    attempt_span: int = 0  # the span id of the attempt going out, when traced (its traceparent)
    # split into a prefill and a decode (router.disaggregation): the replica that prefilled it, and the body
    # sent for its decode (the client's, with the prefill's transfer parameters); None: prefill (again) first;
    # the prefill's predicted cached tokens there and its time (request sent to answer read)
    prefill_replica: str | None = None
    prefill_cached_tokens: int | None = None
    prefill_s: float | None = None
    decode_body: bytes | None = None
    # what it used, for its tenant (router.tenants): usage.completion_tokens where the answer said, and the
    # stream's data events (about one token each) where it did not
    completion_tokens: int | None = None
    events: int = 0

    def first_byte(self, ticket: Ticket, status: int) -> None:
        """The attempt's first byte came: routing hears it (with the time to it, where a stream's first event
        carries the first token), and (for the answer's first) the time is taken."""
        if self.ttfb is not None:  # a continuation: the client had its first byte long ago
            ticket.first_byte(status)
            return
        now = time.perf_counter()
        self.upstream_ttfb = now - self.sent_at
        self.ttfb = now - self.started
        ticket.replica.m_ttfb.observe(self.ttfb)
        ticket.first_byte(status, self.stream)

    def per_token_s(self) -> float | None:
        """A whole stream's seconds per output token after its first (as of now: call it at its end); None for
        an answer not streamed, continued on another replica, or of fewer than 2 tokens."""
        if not self.stream or self.ttfb is None or self.splice is not None or self.broken is not None:
            return None
        tokens = self.used_completion_tokens()
        if tokens < 2:
            return None
        return (time.perf_counter() - self.started - self.ttfb) / (tokens - 1)

    def learn_prompt_tokens(self, ticket: Ticket, data: bytes) -> None:
        """The replica's usage.prompt_tokens, which teaches byte mode its bytes per token."""
        if ticket.learns_tokens and self.prompt_tokens is None and 200 <= self.status < 300:
            found = PROMPT_TOKENS.search(data)
            if found is not None:
                self.prompt_tokens = int(found.group(1))


    def learn_completion_tokens(self, data: bytes) -> None:
        if self.completion_tokens is None and b'"completion_tokens"' in data:
            found = COMPLETION_TOKENS.search(data)
            if found is not None:
                self.completion_tokens = int(found.group(1))

    def used_completion_tokens(self) -> int:
        """The completion tokens it used: as the replica's usage said, else about one per streamed event (the
        chat stream's first, naming the role, and the last, with the finish reason, carry none)."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return max(0, self.events - (2 if self.path.endswith("chat/completions") else 1))


def client_headers(scope_headers: list[tuple[bytes, bytes]], traced: bool = False) -> bytes:
    """The client's headers a replica may see (never its credentials), as header lines; a traced request's
    trace context is the router's to send (each attempt's span as the parent)."""
    out = b""
    has_encoding = False
    for k, v in scope_headers:
        if k in FORWARD_REQUEST_HEADERS and not (traced and k in TRACE_CONTEXT):
            out += b"%s: %s\r\n" % (k, v)
            has_encoding = has_encoding or k == b"accept-encoding"
    if not has_encoding:
        out += b"accept-encoding: identity\r\n"
    return out


def response_headers(call: Call, ticket: Ticket, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The replica's answer headers the client gets: hop-by-hop ones dropped, the request id, the replica,
    the predicted cached tokens and the predicted time to first token added."""
    out = [(k, v) for k, v in raw if k not in HOP_BY_HOP]
    out.append((b"x-request-id", call.request_id.encode("latin-1")))
    out.append((b"x-kvroute-replica", ticket.name.encode("latin-1")))
    if call.prefill_replica is not None:
        out.append((b"x-kvroute-prefill-replica", call.prefill_replica.encode("latin-1")))
    if ticket.reason is not None:
        out.append((b"x-kvroute-cached-tokens", b"%d" % ticket.cached_tokens))
    predicted = ticket.predicted_since_arrival_s
    if predicted is not None:
        out.append((b"x-kvroute-predicted-ttft-ms", b"%.1f" % (predicted * 1e3)))
    return out


class ClientStalled(Exception):
    """The client took none of its answer's bytes for ``client.send_timeout_s``: it is disconnected."""


class WriteWatch:
    """The limit on each write to a client, kept by one timer per request instead of one per write (a stream
    writes once per event; an ``asyncio.timeout`` per write took 12% of the event loop's CPU on paced streams).

    ``since`` is when the write in progress began (None between writes). The timer fires no later than that
    write's deadline; a write still pending then cancels the request's task, with ``fired`` set."""

    __slots__ = ("loop", "since", "fired", "_task", "_limit", "_timer")

    def __init__(self, task: asyncio.Task[Any], limit: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.since: float | None = None
        self.fired = False
        self._task = task
        self._limit = limit
        self._timer = self.loop.call_later(limit, self._check)

    def _check(self) -> None:
        since = self.since
        if since is not None and self.loop.time() - since >= self._limit - 1e-3:
            self.fired = True
            self._task.cancel()
            return
        # a write that starts after now has its deadline after now + limit
        self._timer = self.loop.call_at((since if since is not None else self.loop.time()) + self._limit,
                                        self._check)

    def close(self) -> None:
        self._timer.cancel()
