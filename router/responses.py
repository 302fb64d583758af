"""The Responses API: a stored response lives in the memory of the replica that made it.

A vLLM replica run with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` keeps each ``/v1/responses`` answer in its
own process. What names it afterwards (``previous_response_id`` on the next request, ``GET
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``) must reach that replica: any other one
answers 404. So the router:

- gives every ``/v1/responses`` request its response id before sending it: the client's own
  ``request_id`` (vLLM's name for it) if it set one, else a new ``resp_...`` put into the body;
- remembers which replica answered it (:class:`ResponseHomes`: the sessions' store, so every router
  instance and worker sharing it knows), once that replica's answer starts;
- sends what names a response to that replica alone (``RouteRequest.pinned``), and answers a clear
  error where it cannot: the id was never routed here (404 ``response_not_found``), or its replica is
  gone or not ready (404 ``response_unavailable``: its stored responses went with it).
"""

from __future__ import annotations

import uuid
from typing import Any

import xxhash

from . import errors
from .errors import GatewayError
from .sessions import Sessions

MAX_ID_CHARS = 256  # longer ids are refused before any lookup (vLLM's own are 37 characters)


def _digest(response_id: str) -> str:
    """The fixed-size key a response's home is stored under (never the raw id)."""
    return xxhash.xxh3_128_hexdigest(b"response\x00" + response_id.encode("utf-8", "surrogatepass"))


def valid_id(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise errors.bad_request(f"`{field}` must be a non-empty printable string of at most {MAX_ID_CHARS} "
                                 "characters", field)
    return value


class ResponseHomes:
    """Which replica holds each response (kept as sessions are: ``sessions.max_local``, ``sessions.ttl_s``)."""

    def __init__(self, store: Sessions) -> None:
        self._store = store

    async def home(self, response_id: str) -> str | None:
        return await self._store.get(_digest(response_id))

    def remember(self, response_id: str, replica: str) -> None:
        self._store.remember(_digest(response_id), replica)

    async def close(self) -> None:
        await self._store.close()


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def with_id(body: bytes, response_id: str) -> bytes:
    """``body`` (a JSON object without ``request_id``) with ``request_id`` set, the rest of its bytes as sent."""
    start = body.index(b"{") + 1
    return b'%s"request_id":"%s",%s' % (body[:start], response_id.encode(), body[start:]) \
        if body[start:].strip() != b"}" else b'%s"request_id":"%s"}' % (body[:start], response_id.encode())


def unknown(response_id: str) -> GatewayError:
    return GatewayError(404, f"Response with id '{response_id}' not found: no replica behind this router made it "
                        "(a stored response lives in the memory of the replica that made it)", "invalid_request_error",
                        "response_not_found", "previous_response_id")


def unavailable(response_id: str, replica: str) -> GatewayError:
    return GatewayError(404, f"Response with id '{response_id}' is no longer available: replica {replica} made it and "
                        "is not serving now, and its stored responses are gone with it; send the conversation's input "
                        "without previous_response_id", "invalid_request_error", "response_unavailable",
                        "previous_response_id")
