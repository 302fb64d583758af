"""The HTTP surface: OpenAI-compatible endpoints, health, metrics and the admin API.

The proxied endpoints are plain ASGI apps (no per-request dependency injection or body models):
they check the key, read the body within its limit, pull out what routing needs (model, session
digest, the parsed body) and hand the raw bytes to the :class:`~router.proxy.Forwarder`.
:class:`Gateway` assembles the components of one router process.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from . import __version__, errors, hops
from .admission import Admission
from .auth import Auth
from .candidates import Candidates
from .config import ClientConfig, RouterConfig
from .conversations import Conversations
from .errors import GatewayError
from .events import EventBus
from .failover import transcript_for
from .index import PrefixIndex
from .index.fallback import FallbackIndex
from .index.memory import MemoryIndex
from .index.precise import PreciseIndex
from .index.redis import RedisIndex
from .shared_conversations import SharedConversations
from .shared_load import SharedLoad, new_host_id
from .kv_events.feed import EventFeed
from .kv_events.lease import Lease
from .keys import PromptKeys
from .load import HostShare, LoadTable
from .membership import Membership, MembershipError
from .metrics import Metrics
from .policy import build_policy
from .pool import ReplicaPool
from .proxy import Call, Forwarder, client_headers, send_error
from .request import RouteRequest
from .routing import Router
from .responses import ResponseHomes, new_id, unavailable, unknown, valid_id, with_id
from .sessions import build_sessions, session_digest
from .store import Store

log = logging.getLogger("kvroute.api")

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
_ADMIN_BODY_BYTES = 64 * 1024
_STORED_RESPONSE = re.compile(r"^/v1/responses/([^/]+)(/cancel)?$")


class Gateway:
    """The components of one router process: pool, load, index, policy, admission, router, forwarder."""

    def __init__(self, config: RouterConfig, share: HostShare | None = None, worker: int = 0) -> None:
        self.config = config
        self.metrics = Metrics()
        self.events = EventBus()
        self.policy = build_policy(config.policy, config.cache_aware)
        # several workers share load (router.workers.check vetted the set-up)
        self.load = LoadTable([r.name for r in config.replicas], self.metrics, share, worker,
                              capacity=config.membership.max_replicas)
        # with a Redis index, every piece of shared state lives in one store (router.store)
        self.store = Store(config.index.backend, config.index.namespace, config.index.background_timeout_s) \
            if config.index.backend != "memory" else None
        # the routers on it share one load picture (router.shared_load)
        self.shared_load: SharedLoad | None = None
        if self.store is not None and config.shared_load.enabled:
            self.shared_load = SharedLoad(self.store, self.load, config.shared_load,
                                          share.host_id if share is not None else new_host_id(), worker)
        self.instance = hops.instance_id()
        self.pool = ReplicaPool(config.replicas, config.health, config.proxy, self.metrics, self.load, self.events,
                                default_blocks=config.index.default_blocks, shared=self.shared_load,
                                instance=self.instance)
        index: PreciseIndex | None = None
        keys: PromptKeys | None = None
        self.feed: EventFeed | None = None
        if self.policy.uses_prefix:
            keys = PromptKeys(config.prefix, self.events, self.metrics)
            base: PrefixIndex = MemoryIndex() if self.store is None else FallbackIndex(
                RedisIndex(self.store, config.index.timeout_s), MemoryIndex(), config.index, self.metrics)
            index = PreciseIndex(base, config.kv_events.provisional_ttl_s, config.kv_events.slow_medium_weight)
            if config.kv_events.enabled:
                lease = None
                if self.store is not None:  # one consumer per replica for every router on this Redis
                    lease = Lease(self.store, config.kv_events.lease_s)
                self.feed = EventFeed(self.pool, index, keys, config.kv_events, self.metrics, self.events, lease)
        conversations = Conversations(config.conversations.window_s, config.conversations.max_tracked,
                                      journal=self.shared_load is not None) if keys else None
        self.admission = Admission(self.policy, self.load, self.pool.views, self.pool.view_of, config.queue,
                                   self.metrics, self.events)
        self.router = Router(self.pool, self.load, self.policy, self.admission,
                             build_sessions(config.index, config.sessions, self.metrics, share, self.load, self.store),
                             self.metrics, self.events,
                             index=index, keys=keys,
                             conversations=conversations,
                             candidates=Candidates(self.pool, config.candidates, index) if index else None,
                             responses=ResponseHomes(build_sessions(config.index, config.sessions, self.metrics, share,
                                                                    self.load, self.store)))
        # the other routers hear what this one answered and continued (router.shared_conversations)
        self.shared_conversations: SharedConversations | None = None
        if conversations is not None and self.shared_load is not None:
            assert self.store is not None
            self.shared_conversations = SharedConversations(self.store, conversations, self.load,
                                                            config.shared_load, self.shared_load.id)
        self.forwarder = Forwarder(self.router, self.pool, config.proxy, self.metrics, config.client.send_timeout_s)
        self.membership = Membership(config, self.pool, self.store)
        self.auth = Auth(config.auth)
        self.started = time.time()
        self.stopping = False  # SIGTERM came: /ready answers 503 while the listener is still open
        self._ready_polls: collections.deque[float] = collections.deque(maxlen=8)

    def ready_polled(self) -> None:
        self._ready_polls.append(time.monotonic())

    def unready_period(self) -> float:
        """Seconds /ready should answer 503 before the listener closes, so that whoever polls it (a load
        balancer) stops sending requests first: two of its polling intervals, or 0 if nothing polls."""
        if self.config.shutdown_unready_s is not None:
            return self.config.shutdown_unready_s
        polls = list(self._ready_polls)
        if len(polls) < 3 or time.monotonic() - polls[-1] > 60:
            return 0.0
        gaps = sorted(b - a for a, b in zip(polls, polls[1:]))
        return min(30.0, 2 * gaps[len(gaps) // 2])

    def admit(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        """A client request's checks before its body is read: its key, and that it has not been here before.
        Returns the ``x-kvroute-via`` line to send on; raises :class:`GatewayError`."""
        self.auth.check_client(headers)
        return hops.via_line(headers, self.instance)

    async def reject(self, send: Any, e: GatewayError, path: str, request_id: str) -> None:
        """Answer a request refused before any replica saw it: counted, logged, and the error sent."""
        self.metrics.requests.labels("", "none", str(e.status)).inc()
        log.info("%s rejected: %d %s", path, e.status, e.code,
                 extra={"request_id": request_id, "status": e.status, "outcome": e.code})
        await send_error(send, e, request_id)

    async def response_home(self, response_id: str) -> str:
        """The ready replica holding stored response ``response_id``; raises a 404 that says why there is none."""
        home = await self.router.responses.home(response_id) if self.router.responses is not None else None
        if home is None:
            raise unknown(response_id)
        replica = self.pool.get(home)
        if replica is None or not replica.view.ready:
            raise unavailable(response_id, home)
        return home

    def single_model(self) -> str | None:
        models: set[str] = set()
        for r in self.pool:
            models |= r.models
        return next(iter(models)) if len(models) == 1 else None


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


async def read_body(receive: Any, headers: list[tuple[bytes, bytes]], limit: int, cfg: ClientConfig,
                    metrics: Metrics) -> bytes:
    """A request's body, at most ``limit`` bytes (a larger Content-Length is refused before reading), with no pause
    longer than ``client.body_timeout_s`` and all of it within ``client.body_total_timeout_s``.
    Raises :class:`~router.errors.GatewayError` (400, 408, 413)."""
    for k, v in headers:
        if k == b"content-length":
            try:
                if int(v) > limit:
                    raise errors.too_large(limit)
            except ValueError:
                raise errors.bad_request("invalid Content-Length header") from None
    chunks = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.body_total_timeout_s
    while True:
        left = deadline - loop.time()
        pause = min(cfg.body_timeout_s, left)
        try:
            async with asyncio.timeout(pause):  # a timer, no task: this runs for every request
                message = await receive()
        except TimeoutError:
            metrics.client_refused.labels("body_timeout").inc()
            what = (f"stalled for {cfg.body_timeout_s:g} s" if pause == cfg.body_timeout_s
                    else f"took longer than {cfg.body_total_timeout_s:g} s")
            raise GatewayError(408, f"the request body {what}", "invalid_request_error", "body_timeout") from None
        if message["type"] == "http.disconnect":
            raise errors.bad_request("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise errors.too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
        try:
            via = self.gw.admit(headers)
            body, payload, route = await self.read(headers, receive, request_id)
        except GatewayError as e:
            await self.gw.reject(send, e, self.path, request_id)
            return
        stream = _streams(payload.get("stream"))
        model = route.model
        call = Call(
            path=self.path, body=body, model=model, stream=stream,
            request_id=request_id, headers=client_headers(headers) + via, started=started, route=route,
            resume=transcript_for(self.path, payload) if stream and self.failover else None,
        )
        await self.gw.forwarder(call, receive, send)

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
        for k, v in headers:
            if k == b"x-session-id" and v:
                session = session_digest(v)
        route = RouteRequest(model=model, request_id=request_id, endpoint=self.path, session_id=session,
                             payload=payload, body_size=len(body))
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
        return payload


def _streams(value: Any) -> bool:
    """``stream`` as vLLM reads it (pydantic's lax booleans: "true", "1", "on"... stream too)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or value == 1


def _json_error(e: GatewayError, request_id: str | None = None) -> Response:
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=headers)


class StoredResponseEndpoint:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica holding the response."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, response_id: str) -> None:
        started = time.perf_counter()
        headers = scope["headers"]
        request_id = request_id_from(headers)
        try:
            via = self.gw.admit(headers)
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


class GatewayApp:
    """The ASGI entry point: proxied POSTs go straight to their endpoint, the rest to FastAPI.

    The proxied paths carry every token of every stream; FastAPI's middleware stack would wrap
    each ``send`` of each chunk several times over for nothing they need.
    """

    def __init__(self, fastapi_app: FastAPI, endpoints: dict[str, "ProxyEndpoint"],
                 stored: StoredResponseEndpoint) -> None:
        self.app = fastapi_app
        self.endpoints = endpoints
        self.stored = stored
        self.state = fastapi_app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            if method == "POST":
                endpoint = self.endpoints.get(path)
                if endpoint is not None:
                    await endpoint(scope, receive, send)
                    return
            if path.startswith("/v1/responses/"):
                m = _STORED_RESPONSE.match(path)
                if m is not None and (method, bool(m.group(2))) in (("GET", False), ("POST", True)):
                    await self.stored(scope, receive, send, m.group(1))
                    return
        await self.app(scope, receive, send)


def build_app(config: RouterConfig, share: HostShare | None = None, worker: int = 0) -> GatewayApp:
    gw = Gateway(config, share, worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.pool.start()
        if gw.shared_load is not None:
            await gw.shared_load.start()
        if gw.shared_conversations is not None:
            await gw.shared_conversations.start()
        await gw.router.start()
        if gw.feed is not None:
            await gw.feed.start()
        await gw.membership.start()  # replicas registered before (Redis, replicas_file) join now
        # What exists now lives as long as the process: keep the collector from re-scanning it.
        gc.collect()
        gc.freeze()
        log.info("kvroute %s routing with %s over %d replica(s)", __version__, config.policy, len(config.replicas))
        try:
            yield
        finally:
            await gw.membership.close()
            if gw.feed is not None:
                await gw.feed.close()
            await gw.router.close()
            if gw.shared_load is not None:
                await gw.shared_load.close()
            if gw.shared_conversations is not None:
                await gw.shared_conversations.close()
            await gw.pool.stop()
            if gw.store is not None:
                await gw.store.close()

    app = FastAPI(title="kvroute", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gateway = gw

    endpoints = {path: ProxyEndpoint(gw, path, required) for path, required in PROXIED.items()}
    for path, endpoint in endpoints.items():  # for OPTIONS/GET on these paths: FastAPI answers 405
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError) -> Response:
        return _json_error(e, request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        err = GatewayError(e.status_code, str(e.detail), kind, "not_found" if e.status_code == 404 else "bad_request")
        return _json_error(err)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"}, headers={hops.INSTANCE: gw.instance})

    @app.get("/ready")
    async def ready() -> Response:
        gw.ready_polled()
        if gw.stopping:
            return _json_error(GatewayError(503, "the router is shutting down", "service_unavailable_error",
                                            "shutting_down", headers={"retry-after": "1"}))
        n = sum(1 for v in gw.pool.views() if v.ready and not v.drained)
        if n == 0:
            return _json_error(errors.no_ready_replica(None))
        return JSONResponse({"status": "ready", "ready_replicas": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gw.auth.check_client(request.scope["headers"])
        return JSONResponse({"object": "list", "data": list(gw.pool.ready_models().values())},
                            headers={hops.INSTANCE: gw.instance})

    def _admin(request: Request) -> None:
        client = request.scope.get("client")
        host = client[0] if client else None
        if any(k in (b"x-forwarded-for", b"forwarded") for k, _ in request.scope["headers"]):
            host = None  # relayed by a proxy on this host: the real client is elsewhere, never loopback
        gw.auth.check_admin(request.scope["headers"], host)

    def _replica(name: str):
        r = gw.pool.get(name)
        if r is None:
            raise errors.not_found(f"no replica named {name!r}")
        return r

    @app.get("/admin/replicas")
    async def admin_replicas(request: Request) -> Response:
        _admin(request)
        return JSONResponse({
            "policy": gw.policy.name,
            "index": gw.router.index.name if gw.router.index is not None else None,
            "prompt_keys": gw.router.keys.describe() if gw.router.keys is not None else None,
            "queue_length": gw.admission.queue_length,
            "conversations": gw.router.conversations.describe() if gw.router.conversations is not None else None,
            "replicas": [_describe(r) for r in gw.pool],
        })

    def _describe(r: Any) -> dict[str, Any]:
        out = gw.pool.describe(r)
        out.update(gw.membership.describe(r.name))
        index = gw.router.index
        if index is not None:
            events = gw.feed.describe(r.name) if gw.feed is not None else None
            out["index"] = {"mode": "precise" if index.is_exact(r.name) else "approximate",
                            "event_blocks_held": index.held_blocks(r.name),
                            "events": events}
        return out

    def _membership_error(e: MembershipError) -> GatewayError:
        kind, code = {400: ("invalid_request_error", "invalid_replica"), 404: ("not_found_error", "not_found"),
                      409: ("invalid_request_error", "conflict")}.get(e.status, ("service_unavailable", "unavailable"))
        return GatewayError(e.status, str(e), kind, code)

    @app.post("/admin/explain/{path:path}")
    async def admin_explain(path: str, request: Request) -> Response:
        """Where a request would go and why, without sending it: the body a client would POST to ``/{path}``."""
        _admin(request)
        endpoint = endpoints.get("/" + path)
        if endpoint is None:
            raise errors.not_found(f"/{path} is not routed; explain one of: {', '.join(endpoints)}")
        headers = request.scope["headers"]
        _, _, route = await endpoint.read(headers, request.receive, request_id_from(headers))
        await gw.router.prepare(route)
        return JSONResponse({"model": route.model, "prompt_tokens": route.prompt_tokens,
                             "index_fallback": route.index_fallback, "session_replica": route.session_replica,
                             # on a large fleet, the few replicas its decision weighs (see router.candidates)
                             "weighed": "all" if route.candidates is None else len(route.candidates),
                             **gw.policy.explain(route, gw.admission.views(route.candidates))})

    @app.post("/admin/replicas")
    async def admin_register(request: Request) -> Response:
        _admin(request)
        body = await read_body(request.receive, request.scope["headers"], _ADMIN_BODY_BYTES, config.client,
                               gw.metrics)
        try:
            data = orjson.loads(body)
        except ValueError as e:
            raise errors.bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        url = data.get("url") if isinstance(data, dict) else None
        if isinstance(url, str) and await gw.pool.reaches_this_router(url):
            raise errors.bad_request("replica.url reaches this router itself: a replica must be a vLLM server", "url",
                                     "replica_is_this_router")
        try:
            cfg = await gw.membership.register(data)
        except MembershipError as e:
            raise _membership_error(e) from None
        return JSONResponse(_describe(gw.pool.replicas[cfg.name]), status_code=201)

    @app.delete("/admin/replicas/{name}")
    async def admin_deregister(name: str, request: Request) -> Response:
        _admin(request)
        try:
            await gw.membership.deregister(name)
        except MembershipError as e:
            raise _membership_error(e) from None
        r = gw.pool.get(name)
        return JSONResponse(_describe(r) if r is not None else {"name": name, "removed": True}, status_code=202)

    @app.post("/admin/replicas/{name}/drain")
    async def admin_drain(name: str, request: Request) -> Response:
        _admin(request)
        r = _replica(name)
        gw.pool.set_drained(r, True)
        return JSONResponse(_describe(r))

    @app.post("/admin/replicas/{name}/undrain")
    async def admin_undrain(name: str, request: Request) -> Response:
        _admin(request)
        r = _replica(name)
        if gw.membership.describe(name).get("removing"):
            raise GatewayError(409, f"replica {name!r} is being removed", "invalid_request_error", "conflict")
        gw.pool.set_drained(r, False)
        return JSONResponse(_describe(r))

    return GatewayApp(app, endpoints, StoredResponseEndpoint(gw))
