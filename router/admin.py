"""The admin API: the replicas and how they are seen, registration and removal, drains, the tenants and their
limits, and why a request would go where it goes (``/admin/explain``). Loopback only unless
``auth.admin_key`` is set."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import errors
from .api import ProxyEndpoint, request_id_from
from .bodies import read_body
from .config import ConfigError
from .errors import GatewayError
from .gateway import Gateway
from .replicas.membership import MembershipError
from .tenants import StoreUnavailable

_ADMIN_BODY_BYTES = 64 * 1024


def add_admin_routes(app: FastAPI, gw: Gateway, endpoints: dict[str, ProxyEndpoint]) -> None:
    config = gw.config

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
            "index": gw.decider.index.name if gw.decider.index is not None else None,
            "prompt_keys": gw.decider.keys.describe() if gw.decider.keys is not None else None,
            "queue_length": gw.admission.queue_length,
            "conversations": gw.decider.conversations.describe() if gw.decider.conversations is not None else None,
            "health_checks": gw.pool.describe_checks(),
            "replicas": [_describe(r) for r in gw.pool],
        })

    def _describe(r: Any) -> dict[str, Any]:
        out = gw.pool.describe(r)
        out.update(gw.membership.describe(r.name))
        index = gw.decider.index
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
        await gw.decider.prepare(route)
        return JSONResponse({"model": route.model, "prompt_tokens": route.prompt_tokens,
                             "index_fallback": route.index_fallback, "session_replica": route.session_replica,
                             # its own history's next turn, or a prompt that may start a conversation and the
                             # further turns one is expected to send (router.conversations)
                             "extends_earlier": route.extends_earlier, "turns_ahead": round(route.turns_ahead, 4),
                             # on a large fleet, the few replicas its decision weighs (see router.candidates)
                             "weighed": "all" if route.candidates is None else len(route.candidates),
                             **gw.policy.explain(route, gw.admission.views(route.candidates))})

    async def _json_body(request: Request) -> Any:
        body = await read_body(request.receive, request.scope["headers"], _ADMIN_BODY_BYTES, config.client,
                               gw.metrics)
        try:
            return orjson.loads(body)
        except ValueError as e:
            raise errors.bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    @app.get("/admin/tenants")
    async def admin_tenants(request: Request) -> Response:
        _admin(request)
        return JSONResponse({"header": config.tenancy.header, "tenants": gw.tenants.describe()})

    @app.put("/admin/tenants/{name}")
    async def admin_set_tenant(name: str, request: Request) -> Response:
        """Define or replace a tenant (the fields of tenants[]; its keys are kept as digests only)."""
        _admin(request)
        data = await _json_body(request)
        try:
            cfg = await gw.tenants.put(data, name)
        except ConfigError as e:
            raise errors.bad_request(str(e), code="invalid_tenant") from None
        except StoreUnavailable as e:
            raise GatewayError(503, str(e), "service_unavailable_error", "store_unavailable") from None
        return JSONResponse(cfg.shown())

    @app.delete("/admin/tenants/{name}")
    async def admin_remove_tenant(name: str, request: Request) -> Response:
        _admin(request)
        try:
            removed = await gw.tenants.remove(name)
        except StoreUnavailable as e:
            raise GatewayError(503, str(e), "service_unavailable_error", "store_unavailable") from None
        if not removed:
            raise errors.not_found(f"no tenant named {errors.shown(name, 64)!r}")
        return JSONResponse({"name": name, "removed": True})

    @app.post("/admin/replicas")
    async def admin_register(request: Request) -> Response:
        _admin(request)
        data = await _json_body(request)
        url = data.get("url") if isinstance(data, dict) else None
        if isinstance(url, str) and await gw.pool.control.reaches_this_router(url):
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
