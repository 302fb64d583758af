"""The built-in scorers besides the cost model (:mod:`router.policy.cost`): load, session, KV usage, prefix."""

from __future__ import annotations

from ..request import RouteRequest
from ..view import ReplicaView
from .stages import Scorer, register_scorer


@register_scorer("load")
class LoadScorer(Scorer):
    """Prefers the replica with the lowest load relative to its capacity.

    Load is this host's in-flight requests plus the other traffic the replica reported at the
    last scrape; capacity grows with ``max_num_seqs`` and the speed of the parallel group.
    """

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return 1.0 / (1.0 + view.load / view.capacity)


@register_scorer("session")
class SessionScorer(Scorer):
    """1 for the replica that served the request's ``x-session-id`` last, else 0."""

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return 1.0 if req.session_replica is not None and req.session_replica == view.name else 0.0


@register_scorer("kv-usage")
class KVUsageScorer(Scorer):
    """Prefers the replica with the most free KV cache at the last scrape."""

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return max(0.0, 1.0 - view.kv_usage)


@register_scorer("prefix")
class PrefixScorer(Scorer):
    """The share of the prompt predicted to be in the replica's prefix cache."""

    uses_prefix = True

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        return req.cached.get(view.name, 0) / req.prompt_tokens if req.prompt_tokens else 0.0
