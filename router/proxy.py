"""Forwarding: send a request to the chosen replica and relay its answer byte for byte.

Attempts: a connection error, a timeout before the response started, or a 5xx/429 answer is
tried again on another replica (never the same one twice, at most ``proxy.max_attempts``
replicas, short jittered backoff). A 4xx is the client's problem: it is passed through and
never retried. Once the first byte went to the client the answer is committed: a stream that
breaks or stays silent longer than ``proxy.stream_idle_timeout_s`` is ended with an SSE error
event. When the client disconnects, the upstream request is closed at once, which makes vLLM
abort it and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from . import errors
from .admission import Admission
from .matching import Matcher
from .config import ProxyConfig
from .errors import GatewayError
from .metrics import Metrics
from .policy import NoCandidate, RouteRequest
from .pool import Replica, ReplicaPool
from .upstream import ConnectFailed, ReadTimeout, UpstreamError, UpstreamResponse

log = logging.getLogger("kvroute.proxy")

# Request headers a client may pass on to a replica (credentials never: they come from config).
_FORWARD_REQUEST_HEADERS = ("content-type", "accept", "accept-encoding", "traceparent", "tracestate",
                            "x-session-id", "openai-organization", "openai-project")
# Response headers that describe one hop only.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                         b"proxy-authenticate", b"proxy-connection", b"date", b"server", b"x-request-id"})
_MAX_ERROR_BODY = 64 * 1024


@dataclass
class Call:
    """One client request on its way through the gateway."""

    path: str
    body: bytes
    model: str | None
    stream: bool
    request_id: str
    headers: dict[str, str]
    started: float
    route: RouteRequest
    attempts: int = 0
    outcome: str = "ok"
    replica: str = "none"
    status: int = 0
    ttfb: float | None = None
    pending_prefill: int = 0  # prompt tokens counted in the replica's pending prefill until the first byte
    sent_at: float = 0.0  # the last attempt's request went to the replica
    upstream_ttfb: float | None = None  # from then to the replica's first body byte


@dataclass
class _Failure:
    """The latest failed attempt, answered to the client if no attempt succeeds."""

    replica: Replica
    kind: str
    status: int | None = None
    headers: list[tuple[bytes, bytes]] | None = None
    body: bytes = b""


class _ClientGone(Exception):
    pass


def client_headers(scope_headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    out = {}
    for k, v in scope_headers:
        name = k.decode("latin-1")
        if name in _FORWARD_REQUEST_HEADERS:
            out[name] = v.decode("latin-1")
    out.setdefault("accept-encoding", "identity")
    return out


class Forwarder:
    def __init__(self, pool: ReplicaPool, admission: Admission, cfg: ProxyConfig, metrics: Metrics,
                 matcher: Matcher | None = None) -> None:
        self.pool = pool
        self.matcher = matcher
        self.admission = admission
        self.cfg = cfg
        self.metrics = metrics

    async def __call__(self, call: Call, receive: Any, send: Any) -> None:
        """Serve ``call`` on the ASGI connection; returns once the client has its whole answer or left."""
        task = asyncio.current_task()
        assert task is not None
        state = {"done": False, "gone": False}

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["done"]:
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await self._serve(call, send)
        except GatewayError as e:
            call.status = e.status
            call.outcome = e.code
            if e.status not in (502, 504):  # those name the last replica tried
                call.replica = "none"
            await send_error(send, e, call.request_id)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
            call.outcome = "client_disconnected"
            call.status = call.status or 499
        except Exception:
            log.exception("internal error while forwarding", extra={"request_id": call.request_id})
            call.outcome = "internal_error"
            if call.status == 0:  # nothing sent yet: the client still gets a well-formed answer
                call.status = 500
                await send_error(send, GatewayError(500, "internal error in the router", "internal_error",
                                                    "internal_error"), call.request_id)
        finally:
            state["done"] = True
            watcher.cancel()
            self._record(call)

    async def _serve(self, call: Call, send: Any) -> None:
        failure: _Failure | None = None
        matcher = self.matcher
        if matcher is not None and call.route.key is not None:
            call.route.session_replica = matcher.session_replica(call.route.session_id)
            await matcher.annotate(call.route, list(self.pool))
        while True:
            try:
                decision = await self.admission.admit(call.route)
            except NoCandidate as e:
                if failure is not None:
                    return await self._give_up(call, send, failure)
                raise self._no_candidate(call, e) from None
            except GatewayError:
                if failure is not None:  # no more free replicas to try: answer the last failure
                    return await self._give_up(call, send, failure)
                raise
            replica = decision.replica
            call.attempts += 1
            call.replica = replica.name
            if matcher is not None:
                matcher.record(call.route, replica)
            pending = call.route.uncached(replica.name)
            replica.pending_prefill += pending
            call.pending_prefill = pending
            try:
                failure = await self._attempt(call, replica, send)
            finally:
                self._prefill_done(call, replica)
                self.admission.release(replica)
            if failure is None:
                return
            call.route.exclude.add(replica.name)
            self.metrics.upstream_errors.labels(replica.name, failure.kind).inc()
            if call.attempts >= self.cfg.max_attempts:
                return await self._give_up(call, send, failure)
            self.metrics.retries.labels(failure.kind).inc()
            log.info("attempt %d on %s failed (%s); trying another replica", call.attempts, replica.name,
                     failure.kind, extra={"request_id": call.request_id, "replica": replica.name})
            backoff = self.cfg.retry_backoff_s * (2 ** (call.attempts - 1)) * random.uniform(0.5, 1.5)
            if backoff:
                await asyncio.sleep(backoff)

    async def _attempt(self, call: Call, replica: Replica, send: Any) -> _Failure | None:
        """One try on one replica. Returns a failure that may be retried, or None once answered."""
        assert replica.upstream is not None
        headers = list(call.headers.items())
        headers.append(("x-request-id", call.request_id))
        headers.extend(replica.upstream_headers)
        wait = self.cfg.stream_idle_timeout_s if call.stream else self.cfg.request_timeout_s
        call.sent_at = time.perf_counter()
        try:
            upstream = await replica.upstream.request(b"POST", call.path, headers, call.body, wait)
        except ConnectFailed:
            self.pool.mark_failure(replica, "connection refused by the proxy path", immediate=True)
            return _Failure(replica, "connect")
        except UpstreamError as e:
            return _Failure(replica, e.kind)
        try:
            status = upstream.status
            if status >= 500 or status == 429:
                try:
                    body = await upstream.read(_MAX_ERROR_BODY, wait)
                except UpstreamError:
                    body = b""
                kind = "status_429" if status == 429 else "status_5xx"
                return _Failure(replica, kind, status, upstream.headers, body)
            await self._relay(call, replica, upstream, send, wait)
            return None
        finally:
            upstream.release()

    async def _relay(self, call: Call, replica: Replica, upstream: UpstreamResponse, send: Any,
                     wait: float) -> None:
        call.status = upstream.status
        sse = (upstream.header(b"content-type") or b"").startswith(b"text/event-stream")
        await send({"type": "http.response.start", "status": upstream.status,
                    "headers": self._response_headers(call, replica, upstream.headers)})
        tail = b"\n\n"
        try:
            while True:
                chunk = await upstream.next_chunk(wait)
                if chunk is None:
                    break
                if call.ttfb is None:
                    self._prefill_done(call, replica)
                    now = time.perf_counter()
                    call.upstream_ttfb = now - call.sent_at
                    call.ttfb = now - call.started
                    replica.m_ttfb.observe(call.ttfb)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = chunk[-2:]
        except ReadTimeout:
            call.outcome = "stream_idle_timeout"
            self.metrics.upstream_errors.labels(replica.name, "stream_idle_timeout").inc()
            if not sse:
                raise
            await send({"type": "http.response.body", "more_body": False, "body": _sse_error(
                tail, f"the replica sent nothing for {wait:g} s", "timeout", "stream_idle_timeout")})
            return
        except UpstreamError as e:
            call.outcome = "upstream_broke"
            self.metrics.upstream_errors.labels(replica.name, "stream_broken").inc()
            log.warning("stream from %s broke: %s", replica.name, e,
                        extra={"request_id": call.request_id, "replica": replica.name})
            if not sse:
                raise
            await send({"type": "http.response.body", "more_body": False, "body": _sse_error(
                tail, "the replica ended the stream unexpectedly", "upstream_error", "upstream_disconnected")})
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _prefill_done(call: Call, replica: Replica) -> None:
        if call.pending_prefill:
            replica.pending_prefill -= call.pending_prefill
            call.pending_prefill = 0

    def _response_headers(self, call: Call, replica: Replica, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in raw if k.lower() not in _HOP_BY_HOP]
        out.append((b"x-request-id", call.request_id.encode("latin-1")))
        out.append((b"x-kvroute-replica", replica.name.encode("latin-1")))
        if call.route.key is not None:
            out.append((b"x-kvroute-cached-tokens", b"%d" % call.route.cached.get(replica.name, 0)))
        return out

    async def _give_up(self, call: Call, send: Any, failure: _Failure) -> None:
        """Every attempt failed: answer the last replica's error as it was, or our own."""
        if failure.status is not None and failure.headers is not None:
            call.status = failure.status
            call.outcome = "upstream_error"
            headers = [(k, v) for k, v in failure.headers if k.lower() not in _HOP_BY_HOP and k.lower() != b"content-length"]
            headers += [(b"content-length", str(len(failure.body)).encode()),
                        (b"x-request-id", call.request_id.encode("latin-1")),
                        (b"x-kvroute-replica", failure.replica.name.encode("latin-1"))]
            await send({"type": "http.response.start", "status": failure.status, "headers": headers})
            await send({"type": "http.response.body", "body": failure.body})
            return
        if failure.kind in ("timeout", "connect_timeout"):
            raise errors.upstream_timeout(f"replica {failure.replica.name} did not answer in time "
                                          f"({call.attempts} attempt(s))")
        raise errors.upstream_failed(f"no replica could be reached ({call.attempts} attempt(s), "
                                     f"last: {failure.replica.name}, {failure.kind})")

    def _no_candidate(self, call: Call, e: NoCandidate) -> GatewayError:
        if e.why == "unknown_model":
            configured = any(call.model in r.config.models for r in self.pool)
            if not configured:
                return errors.model_not_found(call.model or "")
        return errors.no_ready_replica(call.model)

    def _record(self, call: Call) -> None:
        elapsed = time.perf_counter() - call.started
        replica = self.pool.get(call.replica)
        if replica is not None and call.attempts:
            replica.m_latency.observe(elapsed)
        self.metrics.requests.labels(call.model or "", call.replica, str(call.status)).inc()
        route = call.route
        decision: dict[str, Any] = {}
        if route.key is not None and call.attempts and self.matcher is not None:
            cached = route.cached.get(call.replica, 0)
            self.metrics.prompt_tokens.labels(call.model or "").inc(route.prompt_tokens)
            self.metrics.cached_tokens.labels(call.model or "").inc(cached)
            if route.index_fallback:
                reason = "fallback"
            elif cached > 0 and cached >= max(route.cached.values(), default=0):
                reason = "cache"
            else:
                reason = "load"
            self.metrics.decisions.labels(reason).inc()
            decision = {"prompt_tokens": route.prompt_tokens, "cached_tokens": cached, "decision": reason}
            if 200 <= call.status < 300:
                self.matcher.remember_session(route.session_id, call.replica)
        log.info("%s %s -> %s %d %s", call.path, call.model, call.replica, call.status, call.outcome,
                 extra={"request_id": call.request_id, "replica": call.replica, "model": call.model,
                        "status": call.status, "outcome": call.outcome, "attempts": call.attempts,
                        "ttfb_ms": None if call.ttfb is None else round(call.ttfb * 1e3, 2),
                        "upstream_ttfb_ms": None if call.upstream_ttfb is None else round(call.upstream_ttfb * 1e3, 2),
                        "duration_ms": round(elapsed * 1e3, 2), "stream": call.stream, **decision})


async def send_error(send: Any, e: GatewayError, request_id: str) -> None:
    body = e.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id.encode("latin-1"))]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _sse_error(tail: bytes, message: str, type: str, code: str) -> bytes:
    sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
    event = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    return sep + b"data: " + event + b"\n\ndata: [DONE]\n\n"
