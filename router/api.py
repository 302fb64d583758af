"""The proxied endpoints: every OpenAI-compatible (and Anthropic, pooling, tokenizer) endpoint vLLM serves.

They are plain ASGI apps (no per-request dependency injection or body models): they check the key, read
the body within its limit, pull out what routing needs (model, session digest, the parsed body) and hand the
raw bytes to the :class:`~router.proxy.Forwarder`. The process around them is assembled in
:mod:`router.gateway` and served by :mod:`router.app`.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Any

import orjson

from . import errors
from .bodies import read_body
from .errors import GatewayError
from .stream_failover import transcript_for
from .gateway import Gateway
from .call import Call, client_headers
from .request import RouteRequest
from .responses import new_id, valid_id, with_id
from .sessions import session_digest

# endpoint -> the body field it cannot do without (any one of several); every one vLLM serves for clients
PROXIED: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("messages",),
    "/v1/completions": ("prompt", "prompt_embeds"),
    "/v1/responses": ("input", "previous_response_id"),
    "/v1/messages": ("messages",),  # Anthropic's Messages API
    "/v1/messages/count_tokens": ("messages",),
    "/v1/embeddings": ("input", "messages"),
    "/v2/embed": ("texts", "inputs", "images"),
    "/pooling": ("input", "messages"),
    "/classify": ("input", "messages"),
    "/v1/rerank": ("query",),
    "/v2/rerank": ("query",),
    "/rerank": ("query",),
    "/v1/score": ("text_1", "queries", "data_1"),
    "/score": ("text_1", "queries", "data_1"),
    "/tokenize": ("prompt", "messages"),
    "/detokenize": ("tokens",),
}
_RESPONSES = "/v1/responses"
MAX_MODEL_CHARS = 1024
MAX_TARGET_MS = 86_400_000  # a latency target of more than a day is a mistake, not a target


# New request ids: a random prefix per process and a counter (unique like uuid4, without a syscall each)
_ID_PREFIX = secrets.token_hex(8)
_ids = itertools.count()


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for k, v in headers:
        if k == b"x-request-id":
            if 0 < len(v) <= 128 and v.isascii() and v.decode().isprintable():
                return v.decode()
            break
    return f"{_ID_PREFIX}{next(_ids):016x}"


def _target_s(value: bytes, header: str) -> float:
    """A latency target header's milliseconds, in seconds; 400 naming the header unless a number in (0, 1 day]."""
    try:
        ms = float(value[:32])
    except ValueError:
        ms = float("nan")
    if not 0 < ms <= MAX_TARGET_MS:  # nan fails too
        raise errors.bad_request(f"{header} must be milliseconds, a number above 0 and at most {MAX_TARGET_MS}",
                                 header, "invalid_latency_target")
    return ms / 1000.0


class ProxyEndpoint:
    """ASGI app for one proxied endpoint."""

    def __init__(self, gateway: Gateway, path: str, required: tuple[str, ...]) -> None:
        self.gw = gateway
        self.path = path
        self.required = required
        self.limit = gateway.config.proxy.max_body_bytes
        self.failover = gateway.config.proxy.stream_failover

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        started = time.perf_counter()
        headers = scope["headers"]
        request_id = request_id_from(headers)
        trace = None
        try:
            via, tenant = self.gw.admit(headers)
            trace = self.gw.tracer.start(headers)  # None unless traced: after the key, so strangers cost no span
            body, payload, route = await self.read(headers, receive, request_id)
            route.arrived = started
            route.trace = trace
            route.output_tokens = _output_tokens(payload, self.gw.config.tenancy.output_tokens)
            taken = await self.gw.tenants.enter(tenant, route, lambda: self._prompt_tokens(route))
        except GatewayError as e:
            await self.gw.reject(send, e, self.path, request_id, trace, started)
            return
        stream = _streams(payload.get("stream"))
        model = route.model
        call = Call(
            path=self.path, body=body, model=model, stream=stream,
            request_id=request_id, headers=client_headers(headers, trace is not None) + via, started=started,
            route=route,
            resume=transcript_for(self.path, payload) if stream and self.failover else None,
        )
        try:
            await self.gw.forwarder(call, receive, send)
        finally:
            self.gw.tenants.leave(tenant, taken, route.prompt_estimate(), call.used_completion_tokens())

    async def _prompt_tokens(self, route: RouteRequest) -> int:
        """The request's prompt tokens, for its tenant's token bucket: as the router keys it (prepared once, for
        its decision too), else about a quarter of its body's bytes."""
        if self.gw.decider.keys is not None:
            await self.gw.decider.prepare(route)
        return route.prompt_estimate()

    async def read(self, headers: list[tuple[bytes, bytes]], receive: Any,
                   request_id: str) -> tuple[bytes, dict[str, Any], RouteRequest]:
        """The request's body, parsed and checked, and what routing knows of it. Raises
        :class:`~router.errors.GatewayError` (400, 408, 413) for a body that cannot be routed."""
        body = await self._read_body(headers, receive)
        payload = self._parse(body)
        model = payload.get("model")
        if model is None:
            model = self.gw.single_model()
            if model is None:
                raise errors.bad_request("you must provide a model parameter", "model", "missing_required_field")
        elif not isinstance(model, str) or not model:
            raise errors.bad_request("model must be a non-empty string", "model")
        elif len(model) > MAX_MODEL_CHARS:  # never echoed, logged or kept: a client's name costs what this does
            raise errors.bad_request(f"model must be at most {MAX_MODEL_CHARS} characters", "model", "model_too_long")
        session = None
        slo_ttft = slo_tpot = None
        for k, v in headers:
            if k == b"x-session-id" and v:
                session = session_digest(v)
            elif k == b"x-slo-ttft-ms":
                slo_ttft = _target_s(v, "x-slo-ttft-ms")
            elif k == b"x-slo-tpot-ms":
                slo_tpot = _target_s(v, "x-slo-tpot-ms")
        route = RouteRequest(model=model, request_id=request_id, endpoint=self.path, session_id=session,
                             payload=payload, body_size=len(body), slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
        if self.path == _RESPONSES:
            body = await self._response_home(body, payload, route)
        return body, payload, route

    async def _response_home(self, body: bytes, payload: dict[str, Any], route: RouteRequest) -> bytes:
        """Pin a request that continues a stored response to the replica holding it; name the response this one
        makes (router.responses). Returns the body to send."""
        previous = payload.get("previous_response_id")
        if previous is not None:
            route.pinned = await self.gw.response_home(valid_id(previous, "previous_response_id"))
        own = payload.get("request_id")
        if own is not None:
            route.response_id = valid_id(own, "request_id")
            return body
        route.response_id = new_id()
        return with_id(body, route.response_id)

    async def _read_body(self, headers: list[tuple[bytes, bytes]], receive: Any) -> bytes:
        return await read_body(receive, headers, self.limit, self.gw.config.client, self.gw.metrics)

    def _parse(self, body: bytes) -> dict[str, Any]:
        try:
            payload = orjson.loads(body)  # 3x faster than json on prompts; stops at 1024 levels of nesting
        except (ValueError, UnicodeDecodeError) as e:
            raise errors.bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise errors.bad_request("the request body must be a JSON object", code="invalid_json")
        if not any(payload.get(f) not in (None, "", []) for f in self.required):
            name = self.required[0]
            raise errors.bad_request(f"the field `{name}` is required", name, "missing_required_field")
        if self.path == "/v1/chat/completions" and not isinstance(payload["messages"], list):
            raise errors.bad_request("`messages` must be a list", "messages")
        if "kv_transfer_params" in payload:
            # the router's to set: from a client it could make a replica keep KV for a transfer nobody reads
            raise errors.bad_request("`kv_transfer_params` is set by the router (disaggregated prefill and decode), "
                                     "not by a client", "kv_transfer_params", "reserved_field")
        return payload


def _output_tokens(payload: dict[str, Any], default: int) -> int:
    """The completion tokens a request may use, as it says (bounded), else ``default``."""
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, 1_000_000)
    return default


def _streams(value: Any) -> bool:
    """``stream`` as vLLM reads it (pydantic's lax booleans: "true", "1", "on"... stream too)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or value == 1


class StoredResponseEndpoint:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica holding the response."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, response_id: str) -> None:
        started = time.perf_counter()
        headers = scope["headers"]
        request_id = request_id_from(headers)
        try:
            via, _ = self.gw.admit(headers)
            home = await self.gw.response_home(valid_id(response_id, "response_id"))
        except GatewayError as e:
            await self.gw.reject(send, e, scope["path"], request_id)
            return
        query = scope.get("query_string", b"")
        path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        stream = scope["method"] == "GET" and b"stream=true" in query.lower()
        route = RouteRequest(model=None, request_id=request_id, endpoint=_RESPONSES, pinned=home)
        call = Call(path=path, body=b"", model=None, stream=stream, request_id=request_id,
                    headers=client_headers(headers) + via, started=started, route=route,
                    method=scope["method"].encode())
        await self.gw.forwarder(call, receive, send)
