"""Reads the few series the router needs out of a vLLM replica's ``/metrics`` text.

It scans line prefixes instead of parsing every family: a vLLM exposition has hundreds of lines
and this runs on the event loop of the gateway for every replica on every scrape interval.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# series name -> attribute; several names feed one attribute (renamed across vLLM releases)
_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_time_seconds_count": "prefill_requests",
    "vllm:request_success_total": "finished",  # every finished_reason: requests ended, however
}
_MAXED = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}


# what a replica may claim at most: a larger figure is a lie or a fault, and the router sizes its index by it
MAX_BLOCK_SIZE = 65_536  # tokens per KV block
MAX_BLOCKS = 2**22  # KV blocks per replica (all ranks): 67M tokens at 16 per block; replicas[].num_gpu_blocks goes higher
_MAX_VALUE = 2.0**53  # any one sample; counters past it are not plausible and their sums could overflow

_WANTED = tuple(_SUMMED) + tuple(_MAXED) + ("vllm:cache_config_info", "process_start_time_seconds")


@dataclass
class ReplicaStats:
    """One scrape of a replica, summed over its engines (data-parallel ranks)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    generation_tokens: float = 0.0  # counter: tokens generated (with prompt_tokens: whether its engine moves)
    prompt_tokens: float = 0.0  # counters since the replica started: prompt tokens (cached or not),
    prefill_seconds: float = 0.0  # ... time requests spent in prefill, summed, and how many requests
    prefill_requests: float = 0.0
    finished: float = 0.0  # counter: requests that ended (any reason)
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    start_time: float | None = None
    seen: set[str] = field(default_factory=set)

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


def _split(line: str) -> tuple[str, str, str]:
    """``name{labels} value [ts]`` -> (name, labels, value)."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        rest = line[close + 1:].split()
        return line[:brace], line[brace + 1:close], rest[0] if rest else "nan"
    parts = line.split()
    return parts[0], "", parts[1] if len(parts) > 1 else "nan"


def _int_label(labels: dict[str, str], key: str, most: int) -> int | None:
    """A positive whole label value, at most ``most``; None when absent, not a number, or not positive."""
    try:
        value = float(labels[key])
    except (KeyError, ValueError):
        return None
    if not value >= 1:  # NaN too
        return None
    return int(min(value, most))


def parse_metrics(text: str) -> ReplicaStats:
    stats = ReplicaStats()
    kv_seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if not line.startswith(_WANTED):
            continue
        name, labels, raw = _split(line)
        try:
            value = float(raw)
        except ValueError:
            continue
        if not 0.0 <= value <= _MAX_VALUE:  # NaN, infinities, negative or absurd: not a figure to act on
            continue
        if name in _SUMMED:
            attr = _SUMMED[name]
            if attr in stats.seen and name.startswith("vllm:gpu_prefix"):
                continue  # the current name was seen already; ignore the deprecated twin
            setattr(stats, attr, getattr(stats, attr) + value)
            stats.seen.add(attr)
        elif name in _MAXED:
            value = min(value, 1.0)
            if not kv_seen or value > stats.kv_usage:
                stats.kv_usage = value
            kv_seen = True
            stats.seen.add("kv_usage")
        elif name == "vllm:cache_config_info":
            lab = dict(_LABEL.findall(labels))
            stats.block_size = _int_label(lab, "block_size", MAX_BLOCK_SIZE) or stats.block_size
            blocks = _int_label(lab, "num_gpu_blocks", MAX_BLOCKS)
            if blocks:
                stats.num_gpu_blocks = min(MAX_BLOCKS, (stats.num_gpu_blocks or 0) + blocks)
            stats.seen.add("cache_config")
        elif name == "process_start_time_seconds":
            stats.start_time = value
    return stats
