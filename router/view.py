"""An immutable view of one replica for one routing decision.

Filters and scorers read only this: plain values, taken from the pool (health, configuration,
the last ``/metrics`` scrape) and from the load table (in-flight requests and pending prefill on
this host) at the moment of the decision. Nothing a scorer does can change a replica, and a
scorer is tested with a view built from literals.
"""

from __future__ import annotations

from typing import NamedTuple


class ReplicaView(NamedTuple):
    name: str
    ready: bool = True
    models: frozenset[str] = frozenset()
    max_num_seqs: int = 256
    capacity: float = 256.0  # load normaliser: max_num_seqs x relative speed of the parallel group
    block_size: int = 16
    kv_blocks: int = 16384
    prefill_rate: float = 8000.0  # prompt tokens per second
    prefill_marginal_s: float = 0.0  # seconds one more prompt token adds to a scheduler step (0: not known)
    max_num_batched_tokens: int = 2048
    kv_usage: float = 0.0  # at the last scrape
    external_load: float = 0.0  # other clients' requests at the last scrape
    restarts: int = 0  # restarts the router saw (a new process: one that failed a request may be tried again)
    role: str = "both"  # both, prefill or decode (disaggregated prefill and decode)
    platform: str = "cuda"  # what it runs on (router/platforms.py): which replicas it can move KV to and from
    routers_inflight: int = 0  # the other routers' requests in flight there (router.shared_load): its slots too
    # what its answers took (router.replicas.timing): the fixed part of its times to first token and how far the
    # model's prefill is off (a line through its measured times: router.policy.predict), and seconds per output
    # token
    ttft_fixed_s: float = 0.0
    ttft_slope: float = 1.0
    tpot_s: float = 0.0  # at no other sequence running; 0: not measured yet
    tpot_per_seq_s: float = 0.0  # and what each sequence running beside it adds
    # from the load table, at the decision (these three stay last: see with_load)
    drained: bool = False  # an operator stopped new requests to it
    inflight: int = 0
    pending_prefill: int = 0

    @property
    def free_slots(self) -> int:
        """Slots of its ``max_num_seqs`` that no router's request holds (this host's, and the others' as last read)."""
        return self.max_num_seqs - self.inflight - self.routers_inflight

    @property
    def load(self) -> float:
        """This host's in-flight requests plus what other clients had there at the last scrape."""
        return self.inflight + self.external_load


def with_load(base: ReplicaView, drained: bool, inflight: int, pending_prefill: int) -> ReplicaView:
    """``base`` with the load table's figures (cheaper than ``_replace`` on the hot path)."""
    return tuple.__new__(ReplicaView, base[:-3] + (drained, inflight, pending_prefill))


def with_others(view: ReplicaView, inflight: int, pending_prefill: int) -> ReplicaView:
    """``view`` with the other routers' requests in flight (as load from other clients) and pending prefill."""
    return view._replace(external_load=view.external_load + inflight, routers_inflight=inflight,
                         pending_prefill=view.pending_prefill + pending_prefill)
