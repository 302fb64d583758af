"""The built-in filters: which replicas may take a request at all (ready, serving its model, not drained, not
tried already, predicted to meet the request's latency targets, below capacity)."""

from __future__ import annotations

import time

from ..request import RouteRequest
from ..view import ReplicaView
from .predict import tpot, ttft
from .stages import Filter, register_filter


@register_filter("ready")
class Ready(Filter):
    when_empty = "no_ready"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return view.ready


@register_filter("serves-model")
class ServesModel(Filter):
    when_empty = "unknown_model"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return req.model is None or req.model in view.models


@register_filter("not-drained")
class NotDrained(Filter):
    when_empty = "drained"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return not view.drained


@register_filter("not-tried")
class NotTried(Filter):
    """Retries never go back to a replica that failed this request, unless it restarted since."""

    when_empty = "tried"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        tried = req.exclude.get(view.name)
        return tried is None or view.restarts > tried  # a replica that restarted since is a new process


@register_filter("below-capacity")
class BelowCapacity(Filter):
    """Fewer requests in flight than ``max_num_seqs``: this host's, and the other routers' on the shared load
    picture (each router holding up to the replica's limit would send it several times its slots)."""

    when_empty = "at_capacity"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        return view.free_slots > 0


@register_filter("role")
class Role(Filter):
    """A whole request goes to a replica of role both; a split one's prefill to prefill or both, its decode to
    decode or both; one sent whole where its prompt nearly all sits (phase local) to decode or both."""

    when_empty = "no_role"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        role = view.role
        return role == "both" or role == req.phase or (role == "decode" and req.phase == "local")


@register_filter("transfer-pair")
class TransferPair(Filter):
    """A split request's prefill goes to a replica whose KV some decode replica can read, and its decode to one
    that can read the KV where it was prefilled (the same platform, or a pair ``disaggregation.transfers``
    lists)."""

    when_empty = "no_transfer_pair"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        allowed = req.platforms
        return allowed is None or view.platform in allowed


@register_filter("meets-slo")
class MeetsSlo(Filter):
    """A request with latency targets goes only where it is predicted to meet them (:mod:`.predict`): its first
    token by ``arrived + slo_ttft_s`` (the time it already spent counts), and a time per output token within
    ``slo_tpot_s`` with one more sequence running there (not judged before the replica's streams were timed).
    Before below-capacity: a request no replica could serve in time is told so, not queued."""

    when_empty = "slo_unmet"

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        if req.slo_ttft_s is not None and req.phase != "decode":
            if ttft(req, view) > req.arrived + req.slo_ttft_s - time.perf_counter():
                return False
        if req.slo_tpot_s is not None and view.tpot_s and tpot(view) > req.slo_tpot_s:
            return False
        return True


DEFAULT_FILTERS = ("ready", "serves-model", "role", "transfer-pair", "not-drained", "not-tried", "meets-slo",
                   "below-capacity")
