"""What routing knows of one client request. A leaf module: it imports nothing else of the router."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .conversations import Continuation
    from .prefix import PromptKey
    from .tracing import Trace


@dataclass(slots=True)
class RouteRequest:
    """One request on its way through the routing stage.

    The API fills the first fields from the HTTP request. The router fills the rest once, before
    the first attempt: the prompt key, the predicted cached tokens and index occupancy per replica,
    the requests expected back at each replica, and the replica that served the session last.
    ``exclude`` grows with every failed attempt.
    """

    model: str | None
    request_id: str
    endpoint: str
    session_id: str | None = None  # a fixed-size digest of the client's x-session-id, never the raw value
    pinned: str | None = None  # the one replica that can serve it (it holds the stored response it names)
    response_id: str | None = None  # the id of the stored response it makes (/v1/responses)
    payload: dict[str, Any] | None = None  # the parsed body, until the router has keyed it
    body_size: int = 0
    exclude: dict[str, int] = field(default_factory=dict)  # replica -> its restarts when it failed this request
    # who it is for (router.tenants): its place in the router queue
    tenant: str = "default"
    rank: int = 1  # its class's place in router.config.tenants.CLASSES (0 the most urgent)
    weight: float = 1.0  # its tenant's share against the others of its class
    output_tokens: int = 256  # the completion tokens it is expected to use (its max_tokens, else tenancy.output_tokens)
    # latency targets (x-slo-ttft-ms, x-slo-tpot-ms), in seconds: ttft counted from ``arrived`` (perf_counter)
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    arrived: float = 0.0
    # filled by the router
    prepared: bool = False
    prepare_s: float = 0.0  # what preparing it took, until its decision counts it
    key: "PromptKey | None" = None
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)  # predicted cached tokens per replica name
    best_cached: int = 0  # the most of them on any one replica
    occupancy: dict[str, float] = field(default_factory=dict)  # share of each replica's KV blocks indexed
    index_fallback: bool = False  # the shared index could not answer: the local one did
    returning: dict[str, float] = field(default_factory=dict)  # requests expected back at each replica
    continues: Continuation | None = None  # the answered prompt's tail it holds, if one waits
    # it holds the tail of a prompt routed before it (router.conversations): what it shares is its own history
    extends_earlier: bool = False
    # of a prompt that extends no earlier one: the further turns it is expected to send where it starts, if it
    # starts a conversation (router.conversations), which meet the load there; 0 for a history's next turn
    turns_ahead: float = 0.0
    session_replica: str | None = None
    candidates: tuple[str, ...] | None = None  # the replicas its decision weighs (None: every replica)
    # whole; or, split between two replicas (router.disaggregation), its prefill or its decode; or local: whole, on
    # a replica of role decode (or both) that holds nearly all its prompt
    phase: str = "whole"
    # of a split request: the platforms of the replicas its phase may use (KV moves only between platforms able to
    # transfer: router.disaggregation); None: any
    platforms: frozenset[str] | None = None
    trace: "Trace | None" = None  # its spans as they happen, when it is traced (router.tracing)

    def prompt_estimate(self) -> int:
        """Its prompt tokens as the router counted them, else about a quarter of its body's bytes (not keyed)."""
        return self.prompt_tokens or self.body_size // 4

    def missing(self, replica: str) -> int:
        """Prompt tokens ``replica``'s cache lacks (as the prefix index predicts): computed there, or read from
        the replica that prefilled them."""
        return max(0, self.prompt_tokens - self.cached.get(replica, 0))

    def uncached(self, replica: str) -> int:
        """Prompt tokens ``replica`` would have to prefill (as the prefix index predicts); none for the decode of
        a split request, which reads its prompt's KV from the replica that prefilled it."""
        if self.phase == "decode":
            return 0
        return max(0, self.prompt_tokens - self.cached.get(replica, 0))
