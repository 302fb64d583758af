"""Disaggregated prefill and decode: whether a request is split between two replicas, and the bodies of its two
halves, as vLLM's KV-transfer protocol (its NixlConnector and example proxy) has them.

A split request is sent first to a prefill replica (role ``prefill`` or ``both``) with
``kv_transfer_params: {"do_remote_decode": true, ...}``, ``max_tokens: 1``, not streamed; that replica computes
the prompt's KV, keeps it, and answers ``kv_transfer_params`` naming where it is. The client's own request then
goes to a decode replica (role ``decode`` or ``both``) with those parameters: it reads the KV instead of
computing the prompt and generates the answer the client gets (its usage counts the prompt once).

How a request goes is decided per request (:meth:`Splitter.decide`, from the fleet's roles per model, kept as
replicas change rather than read per request), only where the model has replicas of role ``prefill`` or
``decode``; elsewhere it goes whole. A short prefill costs less than a second request and a transfer, so a request
is split unless a replica could take it whole with a short prefill (as the prefix index predicts): one of role
``both`` with fewer than ``disaggregation.min_uncached_tokens`` to compute, else one of role ``decode`` with fewer
than ``disaggregation.max_local_tokens`` (its prefill stalls the streams it decodes), which computes them itself
(a next turn that adds little to a conversation decoded there is prefilled nowhere else). A request whose prompt
could not be keyed goes whole where a replica of role ``both`` serves its model, else it is split. The forwarder
(:mod:`router.proxy`) sends the halves.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from .config import DisaggregationConfig
from .replica_events import EventBus
from .replicas import ReplicaPool
from .request import RouteRequest

# The endpoints vLLM's connector can split (the others go whole).
SPLITTABLE = frozenset({"/v1/completions", "/v1/chat/completions"})
# What a decode replica needs of the prefill's answer (vLLM's NixlConnector scheduler)
REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")
MAX_PARAMS_BYTES = 64 * 1024  # transfer parameters larger than this are not passed on (the prompt is recomputed)


REFRESH_S = 1.0  # the fleet's roles per model are read again this often, and at once when a replica changes

# What :meth:`Splitter.decide` says of a request: the phase it is routed in first (RouteRequest.phase)
WHOLE = "whole"  # whole, to a replica of role both
SPLIT = "prefill"  # its prefill on a prefill replica, then its decode on a decode replica
LOCAL = "local"  # whole, to a replica of role decode or both that holds nearly all its prompt


@dataclass(frozen=True)
class _Roles:
    whole: int  # ready replicas of role both
    split: bool  # some ready replica does one phase only
    prefill_platforms: frozenset[str]  # platforms of its prefill replicas whose KV some decode replica can read


class Splitter:
    def __init__(self, pool: ReplicaPool, cfg: DisaggregationConfig, events: EventBus) -> None:
        self.pool = pool
        self.cfg = cfg
        self._pairs = cfg.pairs()
        self._readers: dict[str, frozenset[str]] = {}  # prefill platform -> the platforms that can read its KV
        self._roles: dict[str, _Roles] = {}  # per model served, as of _at
        self._at = -1.0
        events.subscribe(self._on_event)

    def _on_event(self, event: object) -> None:
        self._at = -1.0  # a replica came, went, became (un)ready or serves other models: read the roles again

    def possible(self, req: RouteRequest) -> bool:
        """Whether ``req`` might be split, before its prompt is looked at: where the model has replicas that do
        one phase only (most fleets have none, and their requests are not looked at twice)."""
        return self._roles_of(req) is not None

    def _roles_of(self, req: RouteRequest) -> _Roles | None:
        """The roles serving ``req``'s model, where it might be split; None where it goes whole anyway."""
        if not self.cfg.enabled or req.endpoint not in SPLITTABLE or req.model is None or req.pinned is not None:
            return None
        roles = self._current().get(req.model)
        return roles if roles is not None and roles.split else None

    def can_transfer(self, prefill: str, decode: str) -> bool:
        """Whether a decode replica on platform ``decode`` can read KV prefilled on platform ``prefill``."""
        return prefill == decode or (prefill, decode) in self._pairs

    def prefill_platforms(self, req: RouteRequest) -> frozenset[str] | None:
        """The platforms ``req``'s prefill may run on: those whose KV a decode replica of its model can read."""
        roles = self._current().get(req.model or "")
        return roles.prefill_platforms if roles is not None else None

    def readers(self, platform: str) -> frozenset[str]:
        """The platforms whose decode replicas can read KV prefilled on ``platform``."""
        got = self._readers.get(platform)
        if got is None:
            got = self._readers[platform] = frozenset({platform, *(b for a, b in self._pairs if a == platform)})
        return got

    def decide(self, req: RouteRequest) -> str:
        """How ``req`` (prepared: keyed and looked up) goes: :data:`WHOLE`, :data:`SPLIT` or :data:`LOCAL`."""
        roles = self._roles_of(req)
        if roles is None:
            return WHOLE
        if not roles.prefill_platforms:  # no prefill replica whose KV a decode replica could read
            return WHOLE if roles.whole else LOCAL
        if not req.prompt_tokens:  # not keyed: its prefill cannot be told short
            return WHOLE if roles.whole else SPLIT
        # the replicas its decision weighs (all, or on a large fleet a few): the best cache of each role
        get = self.pool.get
        both = decode = 0
        for name, tokens in req.cached.items():
            r = get(name)
            if r is None:
                continue
            role = r.view.role
            if role == "both":
                both = max(both, tokens)
            elif role == "decode":
                decode = max(decode, tokens)
        least = self.cfg.min_uncached_tokens
        if roles.whole and req.prompt_tokens - both < least:
            return WHOLE
        if req.prompt_tokens - decode < min(least, self.cfg.max_local_tokens):
            return LOCAL
        return SPLIT

    def _current(self) -> dict[str, _Roles]:
        now = time.monotonic()
        if now - self._at >= REFRESH_S:
            whole: dict[str, int] = {}
            split: set[str] = set()
            prefills: dict[str, set[str]] = {}  # model -> platforms of its replicas able to prefill, and to decode
            decodes: dict[str, set[str]] = {}
            for r in self.pool:
                view = r.view
                if not view.ready:
                    continue
                for model in view.models:
                    if view.role == "both":
                        whole[model] = whole.get(model, 0) + 1
                    else:
                        split.add(model)
                    if view.role != "decode":
                        prefills.setdefault(model, set()).add(view.platform)
                    if view.role != "prefill":
                        decodes.setdefault(model, set()).add(view.platform)
            self._roles = {m: _Roles(whole.get(m, 0), m in split, frozenset(
                p for p in prefills.get(m, ()) if any(self.can_transfer(p, d) for d in decodes.get(m, ()))))
                for m in whole.keys() | split}
            self._at = now
        return self._roles


def request_object(body: bytes) -> dict[str, Any] | None:
    """A client's JSON request, parsed once for both halves; None if it is not a JSON object (it then goes to
    the decode replica as it came, which judges it)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return payload if isinstance(payload, dict) else None


def prefill_body(request: dict[str, Any]) -> bytes:
    """The prefill half of a client's request: one token, not streamed, its KV kept for a remote decode."""
    payload = dict(request)
    payload["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
    payload["stream"] = False
    payload["max_tokens"] = 1
    if "max_completion_tokens" in payload:
        payload["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):  # not for one token
        payload.pop(name, None)
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill's JSON answer, if they name KV a decode replica can read."""
    try:
        payload = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    if not all(params.get(k) not in (None, "", []) for k in REQUIRED):
        return None
    if len(json.dumps(params)) > MAX_PARAMS_BYTES:
        return None
    return params


def decode_body(request: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The client's request with the prefill's transfer parameters."""
    return json.dumps({**request, "kv_transfer_params": params}, separators=(",", ":"), ensure_ascii=False).encode()
