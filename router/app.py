"""The ASGI application of one router process: proxied POSTs straight to their endpoint (:mod:`router.api`),
the rest (health, readiness, metrics, models, the admin API) through FastAPI, and the process's start and
stop (the lifespan)."""

from __future__ import annotations

import asyncio

import gc
import logging
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from . import __version__, errors, hops
from .admin import add_admin_routes
from .api import PROXIED, ProxyEndpoint, StoredResponseEndpoint
from .config import RouterConfig
from .errors import GatewayError
from .gateway import Gateway
from .load import HostShare

log = logging.getLogger("kvroute.api")

_STORED_RESPONSE = re.compile(r"^/v1/responses/([^/]+)(/cancel)?$")


def _json_error(e: GatewayError, request_id: str | None = None) -> Response:
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=headers)


class AsgiApp:
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


def build_app(config: RouterConfig, share: HostShare | None = None, worker: int = 0) -> AsgiApp:
    gw = Gateway(config, share, worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.pool.start()
        if gw.shared_load is not None:
            await gw.shared_load.start()
        if gw.shared_conversations is not None:
            await gw.shared_conversations.start()
        await gw.decider.start()
        if gw.feed is not None:
            await gw.feed.start()
        await gw.membership.start()  # replicas registered before (Redis, replicas_file) join now
        await gw.tenants.start_sync()  # and tenants set through the admin API
        # What exists now lives as long as the process: keep the collector from re-scanning it.
        gc.collect()
        gc.freeze()
        log.info("kvroute %s routing with %s over %d replica(s)", __version__, config.policy, len(config.replicas))
        try:
            yield
        finally:
            await gw.tenants.close()
            await gw.membership.close()
            if gw.feed is not None:
                await gw.feed.close()
            await gw.decider.close()
            if gw.shared_load is not None:
                await gw.shared_load.close()
            if gw.shared_conversations is not None:
                await gw.shared_conversations.close()
            await gw.pool.stop()
            await asyncio.to_thread(gw.tracer.close)  # sends the spans still queued
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

    add_admin_routes(app, gw, endpoints)

    return AsgiApp(app, endpoints, StoredResponseEndpoint(gw))
