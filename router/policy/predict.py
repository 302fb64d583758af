"""A replica's predicted time to first token and time per output token for a request: what the cache-aware
cost weighs (:mod:`.cost`), what a request's latency targets are checked against (the ``meets-slo`` filter)
and what the router compares with the measured times (:mod:`router.replicas.timing`).

time to first token = fixed + slope x (uncached prompt tokens / prefill rate
                                     + queued prefill that will not fit in this request's step / prefill rate
                                     + queued prefill sharing its step x seconds a token adds to a step)

``fixed`` and ``slope`` are a line through the replica's measured times against the model's, learned online
(until it has answered enough streams: a step's fixed part as its metrics show, and 1); a split request's
decode computes nothing and reads what it lacks (``kv_read_cost`` of a token computed).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..request import RouteRequest
from ..view import ReplicaView

KV_READ_COST = 0.0625  # cache_aware.kv_read_cost's default


def prefill_terms(req: RouteRequest, view: ReplicaView, kv_read_cost: float = KV_READ_COST) -> tuple[float, float]:
    """(seconds of prefill before its first token, seconds queued prefill adds to the step it shares), as the
    prefix index and the load table see ``view`` now; uncorrected."""
    missing = req.missing(view.name)  # what it adds to its cache, computed or read
    if req.phase == "decode":  # a split request's decode: it reads what it lacks, and computes nothing
        uncached, reading = 0, missing * kv_read_cost
    else:
        uncached, reading = missing, 0.0
    # vLLM prefills several requests in one scheduler step (chunked prefill): queued prefill that does not fit in
    # a step beside this request's own waits for earlier steps; what fits lengthens the shared step by the time
    # its tokens add to a step (nothing while that is not known)
    pending = view.pending_prefill
    queued = min(pending, max(0, pending + uncached - view.max_num_batched_tokens))
    return (uncached + queued + reading) / view.prefill_rate, (pending - queued) * view.prefill_marginal_s


def model_s(req: RouteRequest, view: ReplicaView, kv_read_cost: float = KV_READ_COST) -> float:
    """Seconds of prefill before ``req``'s first token on ``view`` by the model alone: its own and the queued."""
    prefill, shared = prefill_terms(req, view, kv_read_cost)
    if not req.prompt_tokens and req.phase != "decode":  # not keyed: about a quarter of its body's bytes, uncached
        prefill += req.body_size / 4 / view.prefill_rate
    return prefill + shared


def on_line(view: ReplicaView, model: float) -> float:
    """Seconds to a first token on ``view`` whose prefill the model prices at ``model`` seconds: the replica's
    fixed part and that by its slope, as its answers showed (:mod:`router.replicas.corrections`)."""
    return view.ttft_fixed_s + view.ttft_slope * model


def ttft(req: RouteRequest, view: ReplicaView, kv_read_cost: float = KV_READ_COST) -> float:
    """Seconds to ``req``'s first token on ``view``."""
    return on_line(view, model_s(req, view, kv_read_cost))


def soonest(req: RouteRequest, views: Iterable[ReplicaView], kv_read_cost: float = KV_READ_COST) -> float | None:
    """The soonest predicted first token for ``req`` among the ready ``views`` serving its model (None: none)."""
    return min((ttft(req, v, kv_read_cost) for v in views
                if v.ready and (req.model is None or req.model in v.models)), default=None)


def tpot(view: ReplicaView) -> float:
    """Seconds per output token on ``view`` with one more sequence running: as its recent streams took for the
    sequences running beside them (0 while none has been measured)."""
    return view.tpot_s + view.tpot_per_seq_s * (view.load + 1)
