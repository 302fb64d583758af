"""Errors the gateway itself produces, always as an OpenAI-shaped JSON body."""

from __future__ import annotations

import json
from typing import Any


class GatewayError(Exception):
    """An error answered by the router, not by a replica."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | int | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}},
                      separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param)


def unauthorized(message: str = "missing or invalid API key") -> GatewayError:
    return GatewayError(401, message, "authentication_error", "invalid_api_key",
                        headers={"www-authenticate": "Bearer"})


def forbidden(message: str) -> GatewayError:
    return GatewayError(403, message, "permission_error", "forbidden")


def shown(value: str, limit: int = 200) -> str:
    """``value`` for an error message or a log line: at most ``limit`` characters of it."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{shown(model)}` does not exist.", "not_found_error", "model_not_found",
                        "model")


def not_found(message: str) -> GatewayError:
    return GatewayError(404, message, "not_found_error", "not_found")


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body is larger than {limit} bytes", "invalid_request_error",
                        "request_too_large")


def queue_full(retry_after: float, why: str) -> GatewayError:
    secs = max(1, int(retry_after + 0.999))
    return GatewayError(429, f"every replica is at capacity ({why}); retry later", "rate_limit_error",
                        "router_queue_" + why.replace(" ", "_"), headers={"retry-after": str(secs)})


def over_limit(retry_after: float, limit: str, tenant: str) -> GatewayError:
    """429 for a tenant over one of its limits (``limit`` names the setting)."""
    secs = max(1, int(retry_after + 0.999))
    return GatewayError(429, f"tenant {tenant} is over its {limit} limit; retry in {secs} s", "rate_limit_error",
                        "tenant_" + limit, headers={"retry-after": str(secs)})


def no_ready_replica(model: str | None) -> GatewayError:
    what = f" for model `{model}`" if model else ""
    return GatewayError(503, f"no ready replica{what}", "service_unavailable_error", "no_ready_replica",
                        headers={"retry-after": "1"})


def slo_unattainable(target: str, limit_ms: float, best_ms: float | None) -> GatewayError:
    """503 for a request whose latency target (``target``: ttft or tpot) no replica is predicted to meet."""
    best = f"; the best replica is predicted at {best_ms:.0f} ms" if best_ms is not None else ""
    return GatewayError(503, f"no replica is predicted to meet x-slo-{target}-ms: {limit_ms:g}{best}",
                        "service_unavailable_error", "slo_unattainable", param=f"x-slo-{target}-ms",
                        headers={"retry-after": "1"})


async def send_error(send: Any, e: GatewayError, request_id: str) -> None:
    body = e.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id.encode("latin-1"))]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def sse_error(tail: bytes, message: str, type: str, code: str) -> bytes:
    """An SSE error event (after a blank line if the stream's ``tail`` did not end with one), then [DONE]."""
    sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
    event = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    return sep + b"data: " + event + b"\n\ndata: [DONE]\n\n"
