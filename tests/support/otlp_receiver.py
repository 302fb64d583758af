"""An OTLP/HTTP trace receiver on loopback, for the tracing tests: it takes what an OpenTelemetry exporter sends
to ``POST /v1/traces`` (protobuf, as the OTLP specification defines it; gzip if the exporter compresses) and
answers ``GET /spans`` with every span received, as JSON.

    python tests/support/otlp_receiver.py PORT
"""

from __future__ import annotations

import gzip
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

SPANS: list[dict] = []
LOCK = threading.Lock()
MAX_BODY = 64 << 20


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
            self.send_error(404 if self.path != "/v1/traces" else 400)
            return
        body = self.rfile.read(length)
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest.FromString(body)
        got = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent_span_id": s.parent_span_id.hex(), "kind": s.kind,
                                "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                "status": s.status.code, "status_message": s.status.message,
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "resource": resource, "scope": ss.scope.name})
        with LOCK:
            SPANS.extend(got)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:
        if self.path != "/spans":
            self.send_error(404)
            return
        with LOCK:
            out = json.dumps(SPANS).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
