"""Forwarding: send a request to the replica the router chose and relay its answer byte for byte.

The router decides where each attempt goes and hands out a ticket; this module sends, relays,
tells the ticket how the attempt went (first byte, failure kind, end), and logs. What a failure
kind means (retry or not, the client's status) is in :data:`router.failure_kinds.KINDS`.

Attempts: a connection error, a timeout before the response started, or a 5xx/429 answer is
tried again on another replica (never the same one twice, at most ``proxy.max_attempts``
replicas, short jittered backoff). A 4xx is the client's problem: it is passed through and
never retried. Once the first byte went to the client the answer is committed: a stream that
breaks or stays silent longer than ``proxy.stream_idle_timeout_s`` goes on on another replica
when the request qualifies (:mod:`router.stream_failover`), else it is ended with an SSE error event.
When the client disconnects, the upstream request is closed at once, which makes vLLM abort it
and free its KV blocks.

A request the router splits (:mod:`router.disaggregation`) is first sent, changed, to a prefill replica, whose
answer is read here and never reaches the client; the attempts above then send the client's request with the
prefill's transfer parameters to decode replicas. A decode attempt that fails after its request went out (the
replica may have read the prefill's KV, which is then gone) is preceded by another prefill.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from .bodies import with_last_field
from .call import HOP_BY_HOP, Call, ClientStalled, WriteWatch, response_headers
from .config import ProxyConfig
from .disaggregation import LOCAL, SPLIT, Splitter, decode_body, prefill_body, request_object, transfer_params
from .errors import GatewayError, send_error, sse_error
from .stream_failover import Splice, SpliceError, continuation
from .failure_kinds import KINDS, FailureKind
from .metrics import Metrics
from .replicas import Replica, ReplicaPool
from .routing import Decider, Ticket
from .tracing import Tracer, shown
from .upstream import ReadTimeout, UpstreamError, UpstreamResponse

log = logging.getLogger("kvroute.proxy")

_MAX_ERROR_BODY = 64 * 1024
# where vLLM reads a request's `priority` (with --scheduling-policy priority: lower is scheduled first)
_PRIORITIZED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_BUFFERED = 1 << 20  # a JSON answer up to this size is read whole before the client gets any of it


class _Cut(Exception):
    """A JSON answer larger than the buffer broke after part of it was sent: the connection is dropped."""


@dataclass
class _Failure:
    """The latest failed attempt, answered to the client if no attempt succeeds."""

    replica: str
    kind: str
    status: int | None = None
    headers: list[tuple[bytes, bytes]] | None = None
    body: bytes = b""
    resume: bool = False  # a started stream broke, and another replica may continue it


def _request_headers(call: Call, replica: Replica, span_id: int = 0) -> bytes:
    """The header lines a replica gets: the client's it may see, the request id, the replica's own; with a
    trace, the attempt's span as its parent."""
    out = b"%sx-request-id: %s\r\n%s" % (call.headers, call.request_id.encode("latin-1"), replica.header_lines)
    trace = call.route.trace
    return out if trace is None else out + trace.header(span_id)


def _prioritized(call: Call, replica: Replica, body: bytes) -> bytes:
    """The body ``replica`` gets: with the request's class as vLLM's ``priority`` where it schedules by it."""
    if replica.config.priority_scheduling and call.path in _PRIORITIZED and body:
        return with_last_field(body, b"priority", b"%d" % call.route.rank)
    return body


class Forwarder:
    def __init__(self, decider: Decider, pool: ReplicaPool, cfg: ProxyConfig, metrics: Metrics,
                 send_timeout_s: float = 60.0, splitter: Splitter | None = None,
                 tracer: Tracer | None = None) -> None:
        self.decider = decider
        self.tracer = tracer
        self.pool = pool
        self.cfg = cfg
        self.metrics = metrics
        self.send_timeout_s = send_timeout_s
        self.splitter = splitter

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
        client_send = send
        limit = self.send_timeout_s
        stall = WriteWatch(task, limit)

        async def send(message: dict[str, Any]) -> None:  # noqa: F811 - every write has a limit
            stall.since = stall.loop.time()
            try:
                await client_send(message)
            except asyncio.CancelledError:
                if not stall.fired:
                    raise
                task.uncancel()
                raise ClientStalled() from None
            finally:
                stall.since = None

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
                if not call.sse_open:
                    raise
                # the server stops (its shutdown grace is over): end the stream as vLLM ends one on an error
                task.uncancel()
                call.outcome = "shutdown"
                await send({"type": "http.response.body", "more_body": False, "body": sse_error(
                    call.tail, "the router is shutting down", "service_unavailable_error", "shutting_down")})
                return
            task.uncancel()
            call.outcome = "client_disconnected"
            call.status = call.status or 499
        except _Cut:
            pass  # returning unfinished makes the server drop the connection: the client sees a short answer
        except ClientStalled:
            # returning unfinished drops the connection; the replica's request was closed on the way out
            call.outcome = "client_stalled"
            call.status = call.status or 499
            self.metrics.client_refused.labels("send_timeout").inc()
            log.info("client took no bytes for %g s: disconnected", limit, extra={"request_id": call.request_id})
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
            stall.close()
            self._record(call)

    async def _serve(self, call: Call, send: Any) -> None:
        failure: _Failure | None = None
        split = False
        if self.splitter is not None and self.splitter.possible(call.route):
            await self.decider.prepare(call.route)  # the split depends on what its prompt would cost whole
            way = self.splitter.decide(call.route)
            split = way == SPLIT
            if way == LOCAL:
                call.route.phase = LOCAL
                self.metrics.disaggregated.labels("local").inc()
        while True:
            if split and call.decode_body is None:
                decode_tried = call.route.exclude
                call.route.exclude = {}  # the prefill's own: a replica that failed a decode may still prefill
                if not await self._prefill(call, send):
                    return  # answered: the client's own error
                call.route.exclude = decode_tried
            try:
                ticket = await self.decider.route(call.route)
            except GatewayError:
                if split and call.route.platforms is not None:  # no decode replica left that can read that KV
                    self.metrics.disaggregated.labels("no_transfer_pair").inc()
                    call.route.platforms = None
                    call.decode_body = call.body  # the replica computes the prompt
                    continue
                if call.splice is not None:
                    assert failure is not None
                    return await self._end_stream(call, send, failure.kind)
                if failure is not None:  # no replica left to try: answer the last failure
                    return await self._give_up(call, send, failure)
                raise
            call.attempts += 1
            call.replica = ticket.name
            call.ticket = ticket
            began = self._attempt_span(call)
            try:
                failure = await self._attempt(call, ticket, send)
            except BaseException:  # the client left, or the answer broke after it started
                ticket.finish(call.status or 499)
                self._traced(call, ticket, began, call.status or 499, call.broken or "client_left")
                raise
            self._traced(call, ticket, began, failure.status if failure and failure.status else call.status,
                         failure.kind if failure else call.broken)
            if failure is None:
                ticket.finish(call.status, call.prompt_tokens, call.broken, call.per_token_s())
                if call.splice is not None:
                    self.metrics.stream_failovers.labels("completed").inc()
                    call.outcome = "continued"
                return
            ticket.failed(failure.kind)
            if split and not failure.resume and failure.kind not in ("connect", "connect_timeout"):
                call.decode_body = None  # the request went out: the replica may have read (and so used up) the KV
                self.metrics.disaggregated.labels("prefill_again").inc()
            if failure.resume:  # counted as an upstream error where the stream broke
                assert call.resume is not None
                call.resume.flush()  # half an event the broken stream left: never sent, and dropped now
                call.continued = continuation(call.path, call.body, call.resume)
                call.splice = Splice(call.resume)
                call.route.platforms = None  # a continuation reads no transferred KV: any replica may compute it
                call.broken = None  # the break is this replica's; the next one is judged by its own answer
                log.info("stream from %s broke after %d token(s) (%s); continuing on another replica", ticket.name,
                         call.resume.tokens, failure.kind, extra={"request_id": call.request_id, "replica": ticket.name})
            else:
                self.metrics.upstream_errors.labels(ticket.name, failure.kind).inc()
            if not KINDS[failure.kind].retry and not failure.resume or call.attempts >= self.cfg.max_attempts:
                if call.splice is not None:
                    return await self._end_stream(call, send, failure.kind)
                return await self._give_up(call, send, failure)
            self.metrics.retries.labels(failure.kind).inc()
            if not failure.resume:
                log.info("attempt %d on %s failed (%s); trying another replica", call.attempts, ticket.name,
                         failure.kind, extra={"request_id": call.request_id, "replica": ticket.name})
            backoff = self.cfg.retry_backoff_s * (2 ** (call.attempts - 1)) * random.uniform(0.5, 1.5)
            if backoff:
                await asyncio.sleep(backoff)

    async def _attempt(self, call: Call, ticket: Ticket, send: Any) -> _Failure | None:
        """One try on one replica. Returns a failure that may be retried, or None once answered."""
        replica = ticket.replica
        assert replica.upstream is not None
        headers = _request_headers(call, replica, call.attempt_span)
        body = _prioritized(call, replica, call.continued or call.decode_body or call.body)
        wait = self.cfg.stream_idle_timeout_s if call.stream else self.cfg.request_timeout_s
        # a stream's headers come as soon as vLLM accepts the request; a JSON answer's with the whole answer
        headers_wait = min(wait, self.cfg.stream_headers_timeout_s) if call.stream else wait
        call.sent_at = time.perf_counter()
        try:
            upstream = await replica.upstream.request(call.method, call.path, headers, body, headers_wait)
        except UpstreamError as e:
            return _Failure(ticket.name, e.kind)
        try:
            status = upstream.status
            if status >= 500 or status == 429:
                try:
                    body = await upstream.read(_MAX_ERROR_BODY, wait)
                except UpstreamError:
                    body = b""
                kind = "status_429" if status == 429 else "status_5xx"
                return _Failure(ticket.name, kind, status, upstream.headers, body)
            return await self._relay(call, ticket, upstream, send, wait)
        finally:
            upstream.release()

    async def _relay(self, call: Call, ticket: Ticket, upstream: UpstreamResponse, send: Any,
                     wait: float) -> _Failure | None:
        """Pass the answer on. A JSON answer is read whole first (up to ``_BUFFERED``): one cut short is then
        a failure another replica may answer, not a broken response. A stream goes on chunk by chunk."""
        # a stream only if one was asked for: an event stream answering a JSON request is read whole like JSON
        sse = call.stream and (upstream.header(b"content-type") or b"").startswith(b"text/event-stream")
        if call.splice is not None:
            if not sse or upstream.status != 200:
                log.warning("%s answered %d to the continuation of a stream", ticket.name, upstream.status,
                            extra={"request_id": call.request_id, "replica": ticket.name})
                return _Failure(ticket.name, "continuation_refused")
            return await self._relay_stream(call, ticket, upstream, send, wait)
        held: list[bytes] = []
        if not sse:
            size = 0
            try:
                while size <= _BUFFERED:
                    chunk = await upstream.next_chunk(wait)
                    if chunk is None:
                        break
                    if call.ttfb is None:
                        call.first_byte(ticket, upstream.status)
                    held.append(chunk)
                    size += len(chunk)
            except UpstreamError as e:
                kind = "timeout" if isinstance(e, ReadTimeout) else "body_broken"
                log.warning("answer from %s cut short before it reached the client: %s", ticket.name, e,
                            extra={"request_id": call.request_id, "replica": ticket.name})
                return _Failure(ticket.name, kind)
            if chunk is None:  # whole: one write
                body = b"".join(held)
                call.status = upstream.status
                call.learn_prompt_tokens(ticket, body)
                call.learn_completion_tokens(body)
                # the length of what came, whatever the replica's header said (a 204 or 304 has none)
                headers = [(k, v) for k, v in response_headers(call, ticket, upstream.headers)
                           if k != b"content-length"]
                if upstream.status in (204, 304):
                    body = b""
                else:
                    headers.append((b"content-length", b"%d" % len(body)))
                await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return None
        call.status = upstream.status
        headers = response_headers(call, ticket, upstream.headers)
        if sse:  # a stream may end with an error event or go on on another replica: its length is not known
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        if not sse:
            call.resume = None
            try:
                for chunk in held:  # a JSON answer larger than the buffer: the rest follows as it comes
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                while (chunk := await upstream.next_chunk(wait)) is not None:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as e:
                self._broke(call, ticket, e)
                raise _Cut() from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        call.sse_open = True
        if upstream.status != 200:
            call.resume = None
        return await self._relay_stream(call, ticket, upstream, send, wait)

    async def _relay_stream(self, call: Call, ticket: Ticket, upstream: UpstreamResponse, send: Any,
                            wait: float) -> _Failure | None:
        """Relay an SSE stream chunk by chunk: the first part of the answer, or a continuation of it."""
        splice = call.splice
        resume = call.resume
        first = True
        try:
            while True:
                chunk = await upstream.next_chunk(wait)
                if chunk is None:
                    break
                if first:  # checked here: this loop runs for every chunk of every stream
                    first = False
                    call.first_byte(ticket, upstream.status)
                if splice is not None:
                    chunk = splice.feed(chunk)
                    if not chunk:
                        continue
                elif resume is not None:
                    chunk = resume.feed(chunk)
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                call.tail = chunk[-2:]
                call.learn_prompt_tokens(ticket, chunk)
                call.events += chunk.count(b"data: {")
                call.learn_completion_tokens(chunk)
        except (UpstreamError, SpliceError) as e:
            kind = self._broke(call, ticket, e)
            if resume is not None and resume.resumable():
                if resume.finished:  # all content was sent: only the end is missing
                    call.sse_open = False
                    call.outcome = "ok"
                    self.metrics.stream_failovers.labels("completed").inc()
                    await send({"type": "http.response.body", "more_body": False,
                                "body": resume.closing(call.route.prompt_tokens)})
                    return None
                return _Failure(ticket.name, kind.label, resume=True)
            if splice is None:
                self.metrics.stream_failovers.labels("not_resumable").inc()
            else:
                self.metrics.stream_failovers.labels("failed").inc()
            message = f"the replica sent nothing for {wait:g} s" if kind.label == "stream_idle_timeout" else kind.message
            call.sse_open = False
            await send({"type": "http.response.body", "more_body": False,
                        "body": sse_error(call.tail, message, kind.type, kind.code)})
            return None
        call.sse_open = False
        await send({"type": "http.response.body", "body": resume.flush() if resume is not None else b"",
                    "more_body": False})
        return None

    async def _prefill(self, call: Call, send: Any) -> bool:
        """The prefill half of a split request, tried on prefill replicas until one answers with transfer
        parameters; then its decode half goes with them (without: the decode replica computes the prompt).
        Returns False when the client has been answered instead (a 4xx of the replica's: its own error)."""
        req = call.route
        payload = request_object(call.body)
        if payload is None:  # not a JSON object: the decode replica judges it
            req.phase = "decode"
            call.decode_body = call.body
            return True
        body = prefill_body(payload)
        req.phase = "prefill"
        assert self.splitter is not None
        req.platforms = self.splitter.prefill_platforms(req)
        tries = 0
        params: dict[str, Any] | None = None
        outcome = "prefill_failed"
        try:
            while tries < self.cfg.max_attempts:
                try:
                    ticket = await self.decider.route(req)
                except GatewayError:
                    break  # no prefill replica (left) to try
                tries += 1
                began = self._attempt_span(call)
                sent = time.perf_counter()
                try:
                    failure, answer = await self._prefill_attempt(call, ticket, body)
                except BaseException:  # the client left: the replica's request was closed, which aborts it
                    ticket.finish(499)
                    self._traced(call, ticket, began, 499, "client_left")
                    raise
                self._traced(call, ticket, began, failure.status if failure and failure.status else 200,
                             failure.kind if failure else None)
                if failure is None:
                    assert answer is not None
                    ticket.finish(200)
                    params = transfer_params(answer)
                    call.prefill_replica = ticket.name
                    call.prefill_cached_tokens = ticket.cached_tokens if ticket.reason is not None else None
                    call.prefill_s = time.perf_counter() - sent
                    if params is not None:  # its decode, where that KV can be read
                        req.platforms = self.splitter.readers(ticket.replica.config.platform)
                    outcome = "split" if params is not None else "no_transfer_params"
                    if params is None:
                        log.warning("prefill on %s named no KV to read; the decode replica computes the prompt",
                                    ticket.name, extra={"request_id": call.request_id, "replica": ticket.name})
                    break
                if failure.status is not None and 400 <= failure.status < 500 and failure.status != 429:
                    ticket.finish(failure.status)  # the client's own error: the decode would answer it too
                    await self._give_up(call, send, failure)
                    return False
                ticket.failed(failure.kind)
                self.metrics.upstream_errors.labels(ticket.name, failure.kind).inc()
                log.info("prefill on %s failed (%s)", ticket.name, failure.kind,
                         extra={"request_id": call.request_id, "replica": ticket.name})
        finally:
            req.phase = "decode"
            if params is None:
                req.platforms = None
        self.metrics.disaggregated.labels(outcome).inc()
        call.decode_body = call.body if params is None else decode_body(payload, params)
        return True

    async def _prefill_attempt(self, call: Call, ticket: Ticket, body: bytes) -> tuple[_Failure | None, bytes | None]:
        """One prefill on one replica: its whole JSON answer, or the failure (a 4xx with its answer)."""
        replica = ticket.replica
        assert replica.upstream is not None
        headers = _request_headers(call, replica, call.attempt_span)
        body = _prioritized(call, replica, body)
        wait = self.cfg.request_timeout_s
        try:
            upstream = await replica.upstream.request(call.method, call.path, headers, body, wait)
        except UpstreamError as e:
            return _Failure(ticket.name, e.kind), None
        try:
            # the prompt is computed: no longer pending there (its one token came with the answer's headers)
            ticket.first_byte(upstream.status, True)
            try:
                answer = await upstream.read(_BUFFERED, wait)
            except UpstreamError as e:
                return _Failure(ticket.name, "timeout" if isinstance(e, ReadTimeout) else "body_broken"), None
            if upstream.status == 200 and upstream.complete:
                return None, answer
            kind = "status_429" if upstream.status == 429 else "status_5xx" if upstream.status >= 500 else "body_broken"
            return _Failure(ticket.name, kind, upstream.status, upstream.headers, answer[:_MAX_ERROR_BODY]), None
        finally:
            upstream.release()

    def _broke(self, call: Call, ticket: Ticket, e: Exception) -> FailureKind:
        """An answer broke after it started: counted, logged, and named."""
        idle = isinstance(e, ReadTimeout)
        kind = KINDS["stream_idle_timeout" if idle else "stream_broken"]
        call.outcome = "stream_idle_timeout" if idle else "upstream_broke"
        call.broken = kind.label
        self.metrics.upstream_errors.labels(ticket.name, kind.label).inc()
        if not idle:
            log.warning("stream from %s broke: %s", ticket.name, e,
                        extra={"request_id": call.request_id, "replica": ticket.name})
        return kind

    async def _end_stream(self, call: Call, send: Any, kind_label: str) -> None:
        """No replica could continue a broken stream: it ends with an SSE error event, as before failover."""
        kind = KINDS[kind_label]
        self.metrics.stream_failovers.labels("failed").inc()
        call.sse_open = False
        call.outcome = "upstream_broke"
        call.broken = kind.label
        await send({"type": "http.response.body", "more_body": False,
                    "body": sse_error(call.tail, kind.message, kind.type, kind.code)})

    async def _give_up(self, call: Call, send: Any, failure: _Failure) -> None:
        """Every attempt failed: answer the last replica's error as it was, or our own."""
        if failure.status is not None and failure.headers is not None:
            call.status = failure.status
            call.outcome = "upstream_error"
            headers = [(k, v) for k, v in failure.headers if k not in HOP_BY_HOP and k != b"content-length"]
            headers += [(b"content-length", str(len(failure.body)).encode()),
                        (b"x-request-id", call.request_id.encode("latin-1")),
                        (b"x-kvroute-replica", failure.replica.encode("latin-1"))]
            await send({"type": "http.response.start", "status": failure.status, "headers": headers})
            await send({"type": "http.response.body", "body": failure.body})
            return
        kind = KINDS[failure.kind]
        raise GatewayError(kind.status, f"no replica answered ({call.attempts} attempt(s), last: {failure.replica}, "
                           f"{kind.message})", kind.type, kind.code)

    @staticmethod
    def _attempt_span(call: Call) -> float:
        """A new span id for the attempt about to go out (its traceparent), when traced; returns its start."""
        if call.route.trace is not None:
            call.attempt_span = call.route.trace.new_id()
        return time.perf_counter()

    @staticmethod
    def _traced(call: Call, ticket: Ticket, began: float, status: int, failure: str | None) -> None:
        """Note the attempt that began at ``began`` on the request's trace (when traced)."""
        trace = call.route.trace
        if trace is None:
            return
        attrs = {"kvroute.replica": ticket.name, "kvroute.attempt": call.attempts, "kvroute.phase": call.route.phase,
                 "http.response.status_code": status, "kvroute.continuation": call.continued is not None}
        if call.upstream_ttfb is not None:
            attrs["kvroute.upstream_ttfb_ms"] = round(call.upstream_ttfb * 1e3, 3)
        if failure is not None:
            attrs["kvroute.failure"] = failure
        trace.add("kvroute.attempt", began, time.perf_counter(), error=failure, span_id=call.attempt_span, **attrs)

    def _judge_slo(self, call: Call) -> None:
        """Count whether an answered request met its latency targets (as its client saw the first token)."""
        m, route = self.metrics, call.route
        if route.slo_ttft_s is not None and call.ttfb is not None and call.stream:
            m.child(m.slo, "ttft", "met" if call.ttfb <= route.slo_ttft_s else "missed").inc()
        per_token = call.per_token_s() if route.slo_tpot_s is not None else None
        if per_token is not None:
            m.child(m.slo, "tpot", "met" if per_token <= (route.slo_tpot_s or 0.0) else "missed").inc()

    def _record(self, call: Call) -> None:
        elapsed = time.perf_counter() - call.started
        ticket = call.ticket
        if ticket is not None and ticket.name == call.replica:
            ticket.replica.m_latency.observe(elapsed)
        self.metrics.child(self.metrics.requests, self.pool.model_label(call.model), call.replica,
                           str(call.status)).inc()
        route = call.route
        if (route.slo_ttft_s is not None or route.slo_tpot_s is not None) and 200 <= call.status < 300:
            self._judge_slo(call)
        if route.trace is not None and self.tracer is not None:
            self.tracer.export(route.trace, call.started, call.started + elapsed, call.status, {
                "http.request.method": "POST", "url.path": call.path, "kvroute.request_id": call.request_id,
                "kvroute.model": shown(call.model), "kvroute.tenant": shown(route.tenant),
                "kvroute.outcome": call.outcome, "kvroute.attempts": call.attempts, "kvroute.stream": call.stream,
                "kvroute.replica": call.replica, **({"kvroute.ttfb_ms": round(call.ttfb * 1e3, 3)}
                                                    if call.ttfb is not None else {})})
        decision: dict[str, Any] = {}
        if ticket is not None and ticket.reason is not None:
            # the most any replica held beside what this one held: why a "load" decision left the best prefix
            decision = {"prompt_tokens": call.route.prompt_tokens, "cached_tokens": ticket.cached_tokens,
                        "best_cached_tokens": ticket.req.best_cached, "decision": ticket.reason}
        if call.prefill_replica is not None:  # split: where its prompt was computed, and how long that took
            decision["prefill_replica"] = call.prefill_replica
            decision["prefill_cached_tokens"] = call.prefill_cached_tokens
            decision["prefill_ms"] = None if call.prefill_s is None else round(call.prefill_s * 1e3, 2)
        log.info("%s %s -> %s %d %s", call.path, call.model, call.replica, call.status, call.outcome,
                 extra={"request_id": call.request_id, "replica": call.replica, "model": call.model,
                        "status": call.status, "outcome": call.outcome, "attempts": call.attempts,
                        "ttfb_ms": None if call.ttfb is None else round(call.ttfb * 1e3, 2),
                        "upstream_ttfb_ms": None if call.upstream_ttfb is None else round(call.upstream_ttfb * 1e3, 2),
                        "duration_ms": round(elapsed * 1e3, 2), "stream": call.stream, **decision})
