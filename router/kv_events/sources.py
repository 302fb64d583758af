"""Where a replica publishes its KV-cache events.

From the configuration (``replicas[].kv_events``, ``kv_events_replay``; ``off`` for none), else
from the replica itself: vLLM 0.32 answers ``GET /kv_event_sources`` with its publisher settings per
data-parallel rank (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": ..., ...}}``). A ``*`` host is the replica's own host. Ranks
publish on consecutive ports (``port + rank``). An endpoint without ``*`` means the replica
connects to a subscriber that binds, which a router shared by many replicas does not do: such a
source is reported and left out.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from ..config import ReplicaConfig
from ..errors import shown
from ..upstream import UpstreamError
from .subscriber import Endpoints

log = logging.getLogger("kvroute.kv_events")


class NoSource(Exception):
    """The replica publishes no events this router can read; the message says why."""


MAX_RANKS = 64  # data-parallel ranks read from one replica (replicas[].data_parallel_size allows as many)
_BIND_ANY = ("*", "0.0.0.0", "[::]", "::", "")
_MAX_ENDPOINT = 256


def _with_host(endpoint: str, host: str, rank_offset: int = 0) -> str:
    """``tcp://*:5557`` -> ``tcp://HOST:5557+offset`` (IPv6 hosts bracketed). Raises ``ValueError`` for a port
    that is not a number from 1 to 65535 (after the offset)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    h, _, port = endpoint[len("tcp://"):].rpartition(":")
    if h in _BIND_ANY:
        h = f"[{host}]" if ":" in host else host
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) + rank_offset <= 65535):
        raise ValueError(f"{shown(endpoint, 80)} has no usable port (1 to 65535)")
    return f"tcp://{h}:{int(port) + rank_offset}"


def from_config(cfg: ReplicaConfig) -> list[Endpoints]:
    assert cfg.kv_events and cfg.kv_events != "off"
    host = urlsplit(cfg.url).hostname or "127.0.0.1"
    replay = cfg.kv_events_replay if cfg.kv_events_replay not in (None, "off") else None
    return [Endpoints(_with_host(cfg.kv_events, host, rank), _with_host(replay, host, rank) if replay else None, rank)
            for rank in range(cfg.data_parallel_size)]


def _unusable(endpoint: Any) -> str:
    """Why the router cannot subscribe to an endpoint a replica names ("" when it can)."""
    if not isinstance(endpoint, str) or not endpoint:
        return "it names no endpoint"
    if len(endpoint) > _MAX_ENDPOINT or not endpoint.isprintable() or any(c.isspace() for c in endpoint):
        return f"its endpoint {shown(endpoint, 80)!r} is not one ZMQ can use"
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return ""
    if not endpoint.startswith("tcp://"):
        return f"its endpoint {shown(endpoint, 80)!r} is neither tcp:// nor ipc://"
    if endpoint[len("tcp://"):].rpartition(":")[0] not in _BIND_ANY:
        return f"it connects out to {shown(endpoint, 80)} (only an endpoint with * makes it bind for subscribers)"
    return ""


def from_answer(answer: Any, replica_url: str) -> list[Endpoints]:
    """The endpoints in a ``/kv_event_sources`` answer (raises :class:`NoSource` saying why there are none)."""
    if not isinstance(answer, dict) or not answer:
        raise NoSource("its /kv_event_sources lists no publisher")
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    ranks = sorted(((int(k), v) for k, v in answer.items()
                    if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 3 and isinstance(v, dict)),
                   key=lambda kv: kv[0])
    if not ranks:
        raise NoSource("its /kv_event_sources lists no publisher")
    if len(ranks) > MAX_RANKS or ranks[-1][0] >= MAX_RANKS:
        raise NoSource(f"its /kv_event_sources lists {len(ranks)} ranks up to {ranks[-1][0]}; "
                       f"at most {MAX_RANKS} data-parallel ranks (0 to {MAX_RANKS - 1}) are read")
    endpoints = {v.get("endpoint") if isinstance(v.get("endpoint"), str) else None for _, v in ranks}
    same = len(endpoints) == 1 and len(ranks) > 1  # one setting for all ranks: each adds its rank to the port
    out = []
    why = ""
    for rank, v in ranks:
        if v.get("enable_kv_cache_events") is not True:
            why = "events are off (--kv-events-config enable_kv_cache_events)"
            continue
        if v.get("publisher") != "zmq":
            publisher = v.get("publisher")
            why = f"its publisher is {shown(publisher, 40) if isinstance(publisher, str) else type(publisher).__name__!r}, not zmq"
            continue
        live, replay = v.get("endpoint"), v.get("replay_endpoint")
        why = _unusable(live) or (_unusable(replay) if replay is not None else "")
        if why:
            continue
        offset = rank if same else 0
        try:
            out.append(Endpoints(_with_host(live, host, offset), _with_host(replay, host, offset) if replay else None,
                                 rank))
        except ValueError as e:
            why = str(e)
    if not out:
        raise NoSource(why or "its /kv_event_sources lists no publisher")
    return out


async def discover(get: Callable[[str], Awaitable[tuple[int, bytes]]], cfg: ReplicaConfig) -> list[Endpoints]:
    """The replica's event sources, asked with ``get`` (a GET on the replica: status and body). Raises
    :class:`NoSource`, or what ``get`` raises when the replica cannot be asked."""
    if cfg.kv_events == "off":
        raise NoSource("replicas[].kv_events is off")
    if cfg.kv_events:
        return from_config(cfg)
    status, body = await get("/kv_event_sources")
    if status == 404:
        raise NoSource("it has no /kv_event_sources (vLLM before 0.32: set replicas[].kv_events)")
    if status != 200:
        raise UpstreamError(f"/kv_event_sources answered {status}")
    try:
        answer = orjson.loads(body)  # at most 1,024 levels deep
    except ValueError:
        raise NoSource("its /kv_event_sources is not JSON") from None
    return from_answer(answer, cfg.url)
