"""Requests that come back to a router: a replica URL that points at the router itself, or at another router
that points back.

Every router process (all workers of one ``kvroute serve`` alike) has an instance id. Requests it sends to a
replica carry ``x-kvroute-via``: the ids of the routers they went through, its own last. A router that finds
its own id there, or more than :data:`MAX_HOPS` ids, answers 508 at once instead of sending the request on
again: a loop is cut at its first repeated hop. Its own ``/health`` and ``/v1/models`` answers carry
``x-kvroute-instance``, so that its health checks see when a replica *is* this router, and keep it out.
"""

from __future__ import annotations

import os
import secrets

from .errors import GatewayError

VIA = b"x-kvroute-via"
INSTANCE = "x-kvroute-instance"
MAX_HOPS = 8
_ENV = "KVROUTE_INSTANCE_ID"


def instance_id() -> str:
    """This router's id: the one its workers share (:func:`share_with_workers`), else a new one."""
    return os.environ.get(_ENV) or secrets.token_hex(8)


def share_with_workers() -> None:
    """Before forking workers: give them one id, so that they count as one router."""
    os.environ[_ENV] = secrets.token_hex(8)


def via_line(headers: list[tuple[bytes, bytes]], me: str) -> bytes:
    """The ``x-kvroute-via`` header line to send on; raises a 508 :class:`GatewayError` for a request that was
    here before (or went through too many routers)."""
    chain: list[bytes] = []
    for k, v in headers:
        if k == VIA:
            chain = [p.strip() for p in v.split(b",")][: MAX_HOPS + 1]
            break
    if me.encode() in chain or len(chain) >= MAX_HOPS:
        raise GatewayError(508, "request loop: this request came back to the router that sent it (a replica URL "
                           "points at this router, or at a router that sends to it)", "invalid_request_error",
                           "request_loop")
    return VIA + b": " + b",".join([*chain, me.encode()]) + b"\r\n"
