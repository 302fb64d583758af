"""The replica record: one replica's configuration and everything the router has learned about it.

The record is written by the modules of this package only: :mod:`.health` moves its state, :mod:`.control`
stores what its checks and scrapes found, :mod:`.learning` its prefill figures, :mod:`.corrections` its measured times, :mod:`.pool` creates and
closes it. After every change the writer rebuilds :attr:`Replica.view` (:meth:`Replica.make_view`), the
immutable :class:`~router.view.ReplicaView` that routing reads, with no load in it (the load table adds
that per decision).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from .. import platforms
from ..config import IndexConfig, ReplicaConfig
from ..metrics import Metrics
from ..upstream import UpstreamPool
from ..view import ReplicaView
from .prefill import PrefillEstimate
from .stats import ReplicaStats
from .timing import TimingEstimate

DEFAULT_BLOCKS = IndexConfig().default_blocks

State = Literal["starting", "ready", "unready"]

# Replicas of one kind prefill at one speed: the same platform, parallel sizes and models.
Kind = tuple[str, int, int, frozenset[str]]


def _slope(fit: tuple[float, float] | None, rate: float) -> float:
    """How far a fitted line's seconds per prefill token are from the model's ``1 / rate`` (1 without a line)."""
    return min(4.0, max(0.0, fit[1] * rate)) if fit is not None else 1.0


class Replica:
    """A replica's configuration and the router's live view of it."""

    def __init__(self, config: ReplicaConfig, upstream: UpstreamPool | None, metrics: Metrics,
                 default_blocks: int = DEFAULT_BLOCKS, control: UpstreamPool | None = None) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.upstream = upstream  # requests' connections
        self.control = control  # health checks' and scrapes' own, so neither waits on the other
        self.state: State = "starting"
        self.default_blocks = default_blocks  # KV blocks assumed while neither config nor /metrics says
        self.model_cards: dict[str, dict[str, Any]] = {}
        self.models_capped = False  # it listed more than models.MAX_MODELS (warned once)
        self.loops_back = False  # its URL reaches the router itself (warned once)
        self.progress = -1.0  # its engine's prompt + generated tokens at the last scrape ...
        self.progress_at = time.monotonic()  # ... and when that last changed
        self.models: frozenset[str] = frozenset(config.models)
        self.stats: ReplicaStats | None = None
        self.stats_at: float | None = None
        self.external_load = 0.0
        self.prefill = PrefillEstimate()  # its prefill speed, from its own metrics
        # (rate, seconds per token in a step) averaged over the replicas of its kind (the same platform, parallel
        # sizes and models), this one included: what routing uses once learned
        self.kind_prefill: tuple[float | None, float | None] = (None, None)
        self.prefill_base: ReplicaStats | None = None  # the scrape the next prefill-rate sample counts from
        self.timing = TimingEstimate()  # its answers' times against the predicted ones (.corrections)
        # (fixed s, s per prefill token) of its times to first token, as .corrections last set
        self.ttft_fit: tuple[float, float] | None = None
        self.checks = 0  # health checks answered by /health with 200
        self.fails = 0
        self.successes = 0
        self.last_error: str | None = None
        self.restarts = 0
        self.added_at = time.monotonic()  # starting since then (warm-up)
        self.request_failures = 0  # proxied requests that failed in a row
        self.ejections = 0  # times taken out for that, in a row
        self.ejected_until = 0.0
        self.failed_to_start: str | None = None
        self.adopted = False  # unready on the word of the router that owns its checks (.shared_health), not ours
        # (name, value) pairs (event-source discovery, with httpx), the same as header lines for the rest
        self.upstream_headers: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.api_key.get_secret_value()}"),) if config.api_key else ())
        self.header_lines = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                                     for k, v in self.upstream_headers)
        # metric children resolved once, not per request
        self.m_ttfb = metrics.ttfb.labels(self.name)
        self.m_latency = metrics.latency.labels(self.name)
        self.m_ready = metrics.replica_ready.labels(self.name)
        self.m_ready.set(0)
        metrics.replica_draining.labels(self.name).set(0)
        self.view = self.make_view()

    def make_view(self) -> ReplicaView:
        """This replica as routing sees it, without load (the load table adds that per decision)."""
        cfg = self.config
        tpot, tpot_per_seq = self.timing.tpot_fit()
        slope = _slope(self.ttft_fit, self.prefill_rate)
        return ReplicaView(
            name=self.name, ready=self.ready, models=self.models,
            max_num_seqs=cfg.max_num_seqs, capacity=cfg.capacity, block_size=self.block_size,
            kv_blocks=self.kv_blocks, prefill_rate=self.prefill_rate,
            prefill_marginal_s=min(self.kind_prefill[1] or 0.0, 1.0 / self.prefill_rate),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            kv_usage=self.stats.kv_usage if self.stats is not None else 0.0, external_load=self.external_load,
            restarts=self.restarts, role=cfg.role, platform=cfg.platform,
            ttft_fixed_s=self.ttft_fit[0] if self.ttft_fit else self.prefill.fixed_s or 0.0,
            ttft_slope=slope,
            tpot_s=tpot, tpot_per_seq_s=tpot_per_seq)

    @property
    def kind(self) -> Kind:
        return self.config.platform, self.config.tensor_parallel_size, self.config.pipeline_parallel_size, self.models

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def slots(self) -> int:
        return self.config.max_num_seqs

    @property
    def capacity(self) -> float:
        return self.config.capacity

    @property
    def block_size(self) -> int:
        if self.config.block_size:
            return self.config.block_size
        if self.stats and self.stats.block_size:
            return self.stats.block_size
        return platforms.get(self.config.platform).block_size

    @property
    def kv_blocks(self) -> int:
        if self.config.num_gpu_blocks:
            return self.config.num_gpu_blocks
        if self.stats and self.stats.num_gpu_blocks:
            return self.stats.num_gpu_blocks
        return self.default_blocks

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens per second: as configured, else as its kind's metrics show, else the platform's guess."""
        if self.config.prefill_tokens_per_s is None and self.kind_prefill[0] is not None:
            return self.kind_prefill[0]
        return self.config.prefill_rate

    @property
    def prefill_rate_source(self) -> str:
        if self.config.prefill_tokens_per_s is not None:
            return "configured"
        if self.kind_prefill[0] is None:
            return "platform guess"
        # replicas of a kind route by one figure; one without samples of its own yet takes theirs
        return "learned from its metrics" if self.prefill.rate is not None else "learned from replicas alike"

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "name": self.name,
            "url": self.config.shown_url,
            "state": self.state,
            "ready": self.ready,
            "models": sorted(self.models),
            "platform": self.config.platform,
            "role": self.config.role,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "pipeline_parallel_size": self.config.pipeline_parallel_size,
            "max_num_seqs": self.slots,
            "capacity": self.capacity,
            "external_load": self.external_load,
            "block_size": self.block_size,
            "num_gpu_blocks": self.kv_blocks,
            "prefill_tokens_per_s": self.prefill_rate,
            "prefill_rate_source": self.prefill_rate_source,
            "prefill_tokens_per_s_own": self.prefill.rate,  # by its own metrics alone
            # seconds one more queued prompt token adds to a step shared with a new request (None: not told yet)
            "prefill_s_per_token_in_step": self.kind_prefill[1],
            # its streamed answers against the predictions (router.replicas.corrections)
            "ttft_fixed_ms": round(self.view.ttft_fixed_s * 1e3, 3),
            "ttft_model_slope": self.view.ttft_slope,
            "ttft_prediction_error": self.timing.error,
            "ttft_answers_timed": self.timing.samples,
            "tpot_ms": round(self.view.tpot_s * 1e3, 3) if self.view.tpot_s else None,
            "tpot_ms_per_running_seq": round(self.view.tpot_per_seq_s * 1e3, 4) if self.view.tpot_s else None,
            "engine": None if s is None else {
                "running": s.running,
                "waiting": s.waiting,
                "kv_cache_usage": s.kv_usage,
                "prefix_cache_hits": s.prefix_hits,
                "prefix_cache_queries": s.prefix_queries,
                "start_time": s.start_time,
                "scraped_at": self.stats_at,
            },
            "failed_to_start": self.failed_to_start,
            "failed_requests_in_a_row": self.request_failures,
            "ejected_for_s": max(0.0, round(self.ejected_until - time.monotonic(), 1)),
            "consecutive_failures": self.fails,
            "consecutive_good_checks": self.successes,  # an unready replica returns at health.rise_threshold
            "last_error": self.last_error,
            "restarts": self.restarts,
        }

    def close(self) -> None:
        """Close its connections (requests' and control)."""
        for pool in (self.upstream, self.control):
            if pool is not None:
                pool.close()
