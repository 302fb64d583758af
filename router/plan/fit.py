"""The plan: for each tensor-parallel size, what one replica's memory holds after its weights, and the size
chosen."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .. import platforms
from ..platforms import GB, GIB, Platform
from .model import (DTYPE_BYTES, KvBytes, ModelShape, PlanError, Weights, gb, kv_bytes, read_config, shape_of,
                    weights)

# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    platform: str
    nodes: int = 1
    max_model_len: int = 8192
    dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    tp: int | None = None
    block_size: int | None = None
    device_memory_gb: float | None = None
    kv_cache_space_gib: float = 4.0  # cpu only
    reserve_gb: float | None = None
    seq_len: int | None = None  # typical sequence (prompt + output) for max_num_seqs; default max_model_len / 4
    min_full_sequences: int = 4
    prefill_nodes: int = 0  # of the nodes, this many serve prefill replicas and the rest decode; 0: every replica both


@dataclass(frozen=True)
class Option:
    """One tensor-parallel size on the target."""

    tp: int
    fits: bool
    why: str
    pp: int = 1  # pipeline stages, one node each (the slow path)
    replicas_per_node: int = 0  # with pp > 1: 0, the replica spans nodes
    replicas: int = 0
    kv_bytes_per_device: float = 0.0
    num_gpu_blocks: int = 0
    full_sequences: int = 0
    max_num_seqs: int = 0


@dataclass(frozen=True)
class Plan:
    model: str
    shape: ModelShape
    target: Target
    platform: Platform
    block_size: int
    weights: Weights
    element_bytes: int
    kv: KvBytes  # at TP 1
    options: list[Option]
    chosen: Option | None
    reason: str

    def tokens(self, o: Option) -> int:
        return o.num_gpu_blocks * self.block_size


def plan(model: str | Path, target: Target) -> Plan:
    try:
        pf = platforms.get(target.platform)
    except platforms.UnknownPlatform:
        raise PlanError(f"--platform {target.platform!r}: one of {', '.join(platforms.names())}") from None
    if target.dtype not in ("bf16", "fp8"):
        raise PlanError(f"--dtype {target.dtype!r}: bf16 or fp8")
    if target.dtype == "fp8" and not pf.fp8:
        raise PlanError(f"--dtype fp8 on {pf.name}: FP8 is not supported on Intel PVC (Aurora); use bf16")
    if target.kv_cache_dtype == "fp8" and not pf.fp8:
        raise PlanError(f"--kv-cache-dtype fp8 on {pf.name}: FP8 is not supported on Intel PVC (Aurora)")
    if not 0 < target.gpu_memory_utilization <= 1:
        raise PlanError("--gpu-memory-utilization must be in (0, 1]")
    if target.nodes < 1 or target.max_model_len < 1:
        raise PlanError("--nodes and --max-model-len must be at least 1")
    if not 0 <= target.prefill_nodes < target.nodes or (target.prefill_nodes and target.nodes < 2):
        raise PlanError(f"--prefill-nodes {target.prefill_nodes}: from 1 to --nodes - 1 ({target.nodes - 1}), "
                        "leaving nodes for decode; or 0 (no disaggregation)")
    cfg, folder = read_config(model)
    s = shape_of(cfg)
    if s.max_position is not None and target.max_model_len > int(s.max_position):
        raise PlanError(f"--max-model-len {target.max_model_len} is past the model's max_position_embeddings "
                        f"({s.max_position}); vLLM refuses it")
    block = target.block_size or pf.block_size
    if block % pf.block_multiple:
        raise PlanError(f"--block-size {block}: vLLM on {pf.name} needs a multiple of {pf.block_multiple}")
    element = DTYPE_BYTES["fp8"] if target.kv_cache_dtype == "fp8" else 2
    w = weights(s, folder, "fp8" if target.dtype == "fp8" else "bf16")
    memory = (target.device_memory_gb * GB) if target.device_memory_gb else pf.memory_bytes
    reserve = (target.reserve_gb * GB) if target.reserve_gb is not None else pf.reserve_bytes
    sizes = (target.tp,) if target.tp else pf.tp_sizes
    seq_len = target.seq_len or max(1, target.max_model_len // 4)

    def option(tp: int, pp: int = 1) -> Option:
        per_node = pf.node_devices_for_tp.get(tp, pf.devices_per_node) // tp
        kvb = kv_bytes(s, element, tp, pp)
        if s.heads % tp:
            return Option(tp, False, f"{s.heads} attention heads do not divide by TP {tp}", pp)
        if per_node == 0:
            return Option(tp, False, f"a node has {pf.devices_per_node} devices", pp)
        weights_share = w.bytes / (tp * pp)  # what each device of the replica holds
        if not pf.accelerator:
            kv_mem = target.kv_cache_space_gib * GIB
        else:
            kv_mem = memory * target.gpu_memory_utilization - weights_share - reserve
        if kv_mem <= 0:
            need = (weights_share + reserve) / target.gpu_memory_utilization
            return Option(tp, False, f"needs {gb(need)} per device at utilization {target.gpu_memory_utilization} "
                          f"(weights {gb(weights_share)} + reserve {gb(reserve)}); a device has {gb(memory)}", pp)
        per_block = block * kvb.per_token
        blocks = int(kv_mem // per_block)
        full = blocks // max(1, math.ceil(kvb.per_sequence(target.max_model_len) / per_block))
        typical = math.ceil(kvb.per_sequence(seq_len) / per_block)
        max_seqs = max(1, min(256, blocks // max(1, typical)))
        why = "fits" if full >= 1 else f"KV for one {target.max_model_len}-token sequence does not fit"
        if pp > 1:
            replicas, per_node = target.nodes // pp, 0
            why += f"; pipeline parallel over {pp} nodes is the slow path (0.05-0.1 token/s measured across Gaudi nodes)"
        else:
            replicas = per_node * target.nodes
        return Option(tp, full >= 1, why, pp, per_node, replicas, kv_mem, blocks, full, max_seqs)

    options = [option(tp) for tp in sizes]
    if not any(o.fits for o in options) and pf.accelerator:
        # one node is not enough: a replica over several nodes, each stage a full node
        top = max(sizes)
        for pp in range(2, target.nodes + 1):
            o = option(top, pp)
            options.append(o)
            if o.fits:
                break
    fitting = [o for o in options if o.fits]
    chosen: Option | None = None
    reason = "no tensor-parallel size fits: more devices per replica (pipeline parallelism), FP8 or a shorter " \
             "--max-model-len"
    if fitting:
        roomy = [o for o in fitting if o.full_sequences >= target.min_full_sequences and o.pp == 1]
        if roomy:
            chosen = roomy[0]
            reason = (f"the smallest TP holding at least {target.min_full_sequences} full-length sequences per "
                      f"replica: the most replicas, so the most routing choice for a prefix-cache workload")
        else:
            chosen = max(fitting, key=lambda o: o.full_sequences)
            reason = (f"no TP holds {target.min_full_sequences} full-length sequences; this one holds the most "
                      f"per replica")
    return Plan(str(model), s, target, pf, block, w, element, kv_bytes(s, element, 1), options, chosen, reason)
