"""OpenTelemetry spans for each request, exported by OTLP/HTTP when an endpoint is configured; nothing at all
when not (a request then carries no :class:`Trace`, and each stage's only cost is a ``None`` check).

The stages note their times on the request's :class:`Trace` as they happen, as plain numbers: no
OpenTelemetry call on the event loop. When the answer has ended, :meth:`Tracer.export` turns the notes into
spans and hands them to the SDK's batch processor, whose own thread sends them (a bounded queue: spans a slow
or absent collector cannot take are dropped, never held). The tree::

    kvroute.request                  (server span, a child of the client's traceparent when it sent one)
      kvroute.prompt_key             the prompt's key computed (tokenized, hashed)
      kvroute.index_lookup           the prefix index asked for every candidate
      kvroute.route                  one per attempt: the decision, its candidates and scores
        kvroute.queue                the wait for a free slot, if any
      kvroute.attempt                one per upstream attempt: the replica, its status or failure kind;
                                     the replica gets this span as its traceparent

Ids are made here (W3C trace context: 128-bit trace, 64-bit span), so a replica's own spans (vLLM's
``--otlp-traces-endpoint``) join the attempt that sent them.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from typing import TYPE_CHECKING, Any

from .config import ConfigError, TracingConfig

if TYPE_CHECKING:
    from .policy import Scored

log = logging.getLogger("kvroute.tracing")

_TRACEPARENT = re.compile(rb"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
MAX_SPANS = 64  # per request: retries and continuations are bounded, and so is what one request may record
MAX_SCORED = 8  # candidates named on a decision's span, best first
MAX_ATTRIBUTE = 256  # characters of a client-given value (model, tenant) on a span


def _ids() -> tuple[int, int]:
    return random.getrandbits(128) or 1, random.getrandbits(64) or 1


class Trace:
    """One request's spans as they happen: (span id, parent id, name, start, end, attributes, error), with
    ``time.perf_counter`` times."""

    __slots__ = ("trace_id", "parent_id", "root_id", "state", "spans", "decided", "_offset_ns")

    def __init__(self, trace_id: int, parent_id: int | None, state: bytes | None) -> None:
        self.trace_id = trace_id
        self.parent_id = parent_id  # the client's span, if it sent a traceparent
        self.root_id = random.getrandbits(64) or 1
        self.state = state  # the client's tracestate, passed on
        self.spans: list[tuple[int, int, str, float, float, dict[str, Any], str | None]] = []
        self.decided: dict[str, Any] = {}  # the candidates the last decision weighed, and their scores
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def new_id(self) -> int:
        return random.getrandbits(64) or 1

    def add(self, name: str, start: float, end: float, parent: int | None = None, error: str | None = None,
            span_id: int | None = None, **attributes: Any) -> int:
        """Note a span (a child of the request's unless ``parent``); returns its id."""
        sid = span_id or self.new_id()
        if len(self.spans) < MAX_SPANS:
            self.spans.append((sid, parent or self.root_id, name, start, end, attributes, error))
        return sid

    def weighed(self, scored: list[Scored]) -> None:
        """The candidates a decision weighed, with their scores (the best few kept)."""
        best = sorted(scored, key=lambda pair: -pair[1])[:MAX_SCORED]
        self.decided = {"kvroute.candidates": len(scored),
                        "kvroute.scores": [f"{v.name}={s:.6g}" for v, s in best]}

    def header(self, span_id: int) -> bytes:
        """The header lines that make ``span_id`` the parent of what a replica records."""
        out = b"traceparent: 00-%032x-%016x-01\r\n" % (self.trace_id, span_id)
        if self.state is not None:
            out += b"tracestate: %s\r\n" % self.state
        return out

    def unix_ns(self, t: float) -> int:
        return self._offset_ns + int(t * 1e9)


def shown(value: str | None) -> str:
    return "" if value is None else value[:MAX_ATTRIBUTE]


class Tracer:
    """Starts a :class:`Trace` for a sampled request and exports its spans once it ended. Disabled (``start``
    returns None) when no endpoint is configured."""

    def __init__(self, cfg: TracingConfig) -> None:
        self.cfg = cfg
        self.endpoint = _endpoint(cfg)
        self._processor: Any = None
        if self.endpoint is None:
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError:
            if cfg.otlp_endpoint is not None:
                raise ConfigError("invalid configuration:\n  tracing.otlp_endpoint: the OpenTelemetry SDK is not "
                                  "installed (pip install 'kvroute[tracing]')") from None
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed "
                        "(pip install 'kvroute[tracing]'): requests are not traced")
            self.endpoint = None
            return
        self._processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint))
        self._resource = Resource.create({"service.name": cfg.service_name})
        self._scope = InstrumentationScope("kvroute")
        log.info("tracing: spans go to %s (%.0f%% of requests without a traceparent)", self.endpoint,
                 cfg.sample_ratio * 100)

    @property
    def enabled(self) -> bool:
        return self._processor is not None

    def start(self, headers: list[tuple[bytes, bytes]]) -> Trace | None:
        """A trace for a request with these headers, or None: tracing off, or not sampled (the client's
        traceparent says so, or ``sample_ratio``)."""
        if self._processor is None:
            return None
        parent = state = None
        for k, v in headers:
            if k == b"traceparent":
                parent = _TRACEPARENT.match(v.strip().lower())
            elif k == b"tracestate" and len(v) <= 512:
                state = v
        if parent is not None and int(parent.group(1), 16) and int(parent.group(2), 16):
            if not int(parent.group(3), 16) & 1:  # the client's trace is not sampled: neither is this part
                return None
            return Trace(int(parent.group(1), 16), int(parent.group(2), 16), state)
        if self.cfg.sample_ratio < 1.0 and random.random() >= self.cfg.sample_ratio:
            return None
        trace_id, _ = _ids()
        return Trace(trace_id, None, None)

    def export(self, trace: Trace, start: float, end: float, status: int, attributes: dict[str, Any]) -> None:
        """Hand the request's spans to the exporter: its own (``start``..``end``, answered ``status``) and what
        its stages noted."""
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        tid = trace.trace_id

        def context(span_id: int, remote: bool = False) -> SpanContext:
            return SpanContext(tid, span_id, is_remote=remote, trace_flags=flags)

        def make(name: str, sid: int, parent: SpanContext | None, t0: float, t1: float, attrs: dict[str, Any],
                 error: str | None, kind: SpanKind = SpanKind.INTERNAL) -> ReadableSpan:
            return ReadableSpan(name, context(sid), parent, self._resource, attrs, kind=kind,
                                status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
                                start_time=trace.unix_ns(t0), end_time=trace.unix_ns(max(t0, t1)),
                                instrumentation_scope=self._scope)

        root_parent = context(trace.parent_id, remote=True) if trace.parent_id else None
        error = f"status {status}" if status >= 500 or status == 0 else None
        spans = [make("kvroute.request", trace.root_id, root_parent, start, end,
                      {**attributes, "http.response.status_code": status}, error, SpanKind.SERVER)]
        for sid, parent, name, t0, t1, attrs, err in trace.spans:
            kind = SpanKind.CLIENT if name == "kvroute.attempt" else SpanKind.INTERNAL
            spans.append(make(name, sid, context(parent), t0, t1, attrs, err, kind))
        for span in spans:
            self._processor.on_end(span)

    def close(self) -> None:
        if self._processor is not None:
            self._processor.shutdown()  # sends what is queued (the exporter's own timeout bounds it)
            self._processor = None


def _endpoint(cfg: TracingConfig) -> str | None:
    if cfg.otlp_endpoint:
        return cfg.otlp_endpoint
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base:
        return base.rstrip("/") + "/v1/traces"
    return None
