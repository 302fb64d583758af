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

import json
import logging
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from ..config import ReplicaConfig
from ..upstream import UpstreamError
from .subscriber import Endpoints

log = logging.getLogger("kvroute.kv_events")


class NoSource(Exception):
    """The replica publishes no events this router can read; the message says why."""


def _with_host(endpoint: str, host: str, rank_offset: int = 0) -> str:
    """``tcp://*:5557`` -> ``tcp://HOST:5557+offset`` (IPv6 hosts bracketed)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    h, _, port = rest.rpartition(":")
    if h in ("*", "0.0.0.0", "[::]", "::", ""):
        h = f"[{host}]" if ":" in host else host
    return f"tcp://{h}:{int(port) + rank_offset}"


def from_config(cfg: ReplicaConfig) -> list[Endpoints]:
    assert cfg.kv_events and cfg.kv_events != "off"
    host = urlsplit(cfg.url).hostname or "127.0.0.1"
    replay = cfg.kv_events_replay if cfg.kv_events_replay not in (None, "off") else None
    return [Endpoints(_with_host(cfg.kv_events, host, rank), _with_host(replay, host, rank) if replay else None, rank)
            for rank in range(cfg.data_parallel_size)]


def from_answer(answer: Any, replica_url: str) -> list[Endpoints]:
    """The endpoints in a ``/kv_event_sources`` answer (raises :class:`NoSource` saying why there are none)."""
    if not isinstance(answer, dict) or not answer:
        raise NoSource("its /kv_event_sources lists no publisher")
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    ranks = sorted(((int(k), v) for k, v in answer.items() if str(k).isdigit() and isinstance(v, dict)),
                   key=lambda kv: kv[0])
    if not ranks:
        raise NoSource("its /kv_event_sources lists no publisher")
    endpoints = {v.get("endpoint") for _, v in ranks}
    same = len(endpoints) == 1 and len(ranks) > 1  # one setting for all ranks: each adds its rank to the port
    out = []
    why = ""
    for rank, v in ranks:
        if not v.get("enable_kv_cache_events"):
            why = "events are off (--kv-events-config enable_kv_cache_events)"
            continue
        if v.get("publisher") != "zmq":
            why = f"its publisher is {v.get('publisher')!r}, not zmq"
            continue
        live = v.get("endpoint")
        if not isinstance(live, str) or not live:
            why = "it names no endpoint"
            continue
        if live.startswith("tcp://") and "*" not in live and not _binds_any(live):
            why = f"it connects out to {live} (only an endpoint with * makes it bind for subscribers)"
            continue
        replay = v.get("replay_endpoint")
        offset = rank if same else 0
        out.append(Endpoints(_with_host(live, host, offset),
                             _with_host(replay, host, offset) if isinstance(replay, str) and replay else None, rank))
    if not out:
        raise NoSource(why or "its /kv_event_sources lists no publisher")
    return out


def _binds_any(endpoint: str) -> bool:
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host in ("0.0.0.0", "[::]", "::")


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
        answer = json.loads(body)
    except ValueError:
        raise NoSource("its /kv_event_sources is not JSON") from None
    return from_answer(answer, cfg.url)
