"""Capacity planning: from a model's ``config.json`` and a platform, the replicas to run (``kvroute plan``).

For each tensor-parallel size that divides the model's attention heads, one replica's memory is
split as vLLM splits it: every device gives ``memory x gpu_memory_utilization``; the weights (their
share of them), a reserve for activations and graphs, and the rest holds KV blocks. vLLM sizes its
cache per device and every device holds the same blocks, so::

    KV bytes per token per device = layers x 2 x ceil(KV heads / TP) x head dim x bytes per element
    num_gpu_blocks = floor(KV memory per device / (block size x KV bytes per token per device))

with MLA models (DeepSeek) caching one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer on
every device, and sliding-window layers holding at most their window of each sequence. On the CPU
the KV space is set outright (``VLLM_CPU_KVCACHE_SPACE``) and nothing else is taken from it.

Nothing is downloaded: the model is a local ``config.json`` or a folder holding one (and, when
there, ``model.safetensors.index.json`` or ``*.safetensors`` headers for the exact weight size).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import platforms
from .platforms import GB, GIB, Platform

# bytes per element by the names config.json, safetensors and vLLM use
DTYPE_BYTES = {"float32": 4, "F32": 4, "bfloat16": 2, "BF16": 2, "float16": 2, "F16": 2, "fp8": 1, "F8_E4M3": 1,
               "F8_E5M2": 1, "int8": 1, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "F64": 8, "BOOL": 1, "bf16": 2}


class PlanError(ValueError):
    """The model or the target cannot be planned for; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    """What capacity depends on, read from a Hugging Face ``config.json``."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied_embeddings: bool
    stored_dtype: str
    max_position: int | None
    # MLA (DeepSeek V2/V3): the cached latent per layer
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    # sliding-window attention: how many layers use it and the window in tokens
    sliding_window: int | None = None
    sliding_layers: int = 0
    # mixture of experts
    experts: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in a MoE model

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def read_config(path: str | Path) -> tuple[dict[str, Any], Path | None]:
    """The model's config.json as a dict, and its folder when ``path`` is one."""
    p = Path(path)
    folder = p if p.is_dir() else None
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise PlanError(f"{path}: no config.json there (give a local file or a model folder; nothing is downloaded)")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{file}: not a JSON object")
    return cfg, folder


def shape_of(cfg: dict[str, Any]) -> ModelShape:
    """The model's shape; multimodal configs are read through their ``text_config``."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    merged = {**cfg, **text}
    try:
        layers = int(_first(merged, "num_hidden_layers", "n_layer", "num_layers"))
        hidden = int(_first(merged, "hidden_size", "n_embd", "d_model"))
        heads = int(_first(merged, "num_attention_heads", "n_head"))
    except (TypeError, ValueError):
        raise PlanError("config.json lacks num_hidden_layers, hidden_size or num_attention_heads") from None
    kv_heads = int(_first(merged, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(_first(merged, "head_dim", default=hidden // heads))
    intermediate = int(_first(merged, "intermediate_size", "ffn_dim", default=4 * hidden))
    window = _first(merged, "sliding_window")
    sliding = 0
    if window is not None and _first(merged, "use_sliding_window", default=True) is not False:
        types = merged.get("layer_types")
        if isinstance(types, list) and types:
            sliding = sum(1 for t in types if t == "sliding_attention")
        elif _first(merged, "sliding_window_pattern") is not None:
            # every n-th layer is global (Gemma 3: pattern 6 -> 5 sliding, 1 full)
            n = int(merged["sliding_window_pattern"])
            sliding = layers - layers // n
        elif merged.get("model_type") in ("gemma2",):
            sliding = layers // 2  # alternating local and global layers
        else:
            sliding = layers
            if merged.get("max_window_layers") is not None and merged.get("model_type", "").startswith("qwen"):
                sliding = max(0, layers - int(merged["max_window_layers"]))
        if sliding == 0:
            window = None
    experts = int(_first(merged, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0)
    return ModelShape(
        model_type=str(merged.get("model_type", "unknown")),
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=int(_first(merged, "vocab_size", default=32000)), intermediate=intermediate,
        # transformers' default differs by model: Gemma ties its output layer to the embeddings
        tied_embeddings=bool(_first(merged, "tie_word_embeddings",
                                    default=str(merged.get("model_type", "")).startswith("gemma"))),
        stored_dtype=str(_first(merged, "torch_dtype", "dtype", default="bfloat16")),
        max_position=_first(merged, "max_position_embeddings"),
        kv_lora_rank=_first(merged, "kv_lora_rank"),
        qk_rope_head_dim=int(_first(merged, "qk_rope_head_dim", default=0)),
        qk_nope_head_dim=int(_first(merged, "qk_nope_head_dim", default=0)),
        v_head_dim=int(_first(merged, "v_head_dim", default=0)),
        q_lora_rank=_first(merged, "q_lora_rank"),
        sliding_window=int(window) if window is not None else None, sliding_layers=sliding,
        experts=experts, shared_experts=int(_first(merged, "n_shared_experts", default=0) or 0),
        expert_intermediate=int(_first(merged, "moe_intermediate_size", default=intermediate if experts else 0)),
        shared_expert_intermediate=int(_first(merged, "shared_expert_intermediate_size", default=0) or 0),
        dense_layers=int(_first(merged, "first_k_dense_replace", default=0) or 0),
    )


# -- weights ----------------------------------------------------------------------------------


def parameters(s: ModelShape) -> int:
    """Parameters from the architecture (attention, MLP or experts, embeddings, norms)."""
    if s.mla:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        q = (s.hidden * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * s.heads * qk) if s.q_lora_rank \
            else s.hidden * s.heads * qk
        kv = s.hidden * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank \
            + s.kv_lora_rank * s.heads * (s.qk_nope_head_dim + s.v_head_dim)
        attn = q + kv + s.heads * s.v_head_dim * s.hidden
    else:
        attn = s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)
    dense_mlp = 3 * s.hidden * s.intermediate
    if s.experts:
        shared = s.shared_experts * 3 * s.hidden * s.expert_intermediate + 3 * s.hidden * s.shared_expert_intermediate
        moe_mlp = s.experts * 3 * s.hidden * s.expert_intermediate + shared + s.hidden * s.experts
        mlp_total = s.dense_layers * dense_mlp + (s.layers - s.dense_layers) * moe_mlp
    else:
        mlp_total = s.layers * dense_mlp
    embeddings = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
    return s.layers * (attn + 2 * s.hidden) + mlp_total + embeddings + s.hidden


def _safetensors_bytes(folder: Path) -> tuple[int, int] | None:
    """(parameters, bytes) from the safetensors headers in ``folder``, when there are any."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    params = size = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                return None
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__" or not isinstance(t, dict):
                continue
            count = math.prod(t.get("shape") or [1])
            params += count
            size += count * DTYPE_BYTES.get(t.get("dtype", ""), 2)
    return params, size


@dataclass(frozen=True)
class Weights:
    bytes: float
    parameters: float
    source: str


def weights(s: ModelShape, folder: Path | None, dtype: str) -> Weights:
    """The weights' size at ``dtype``: from the checkpoint when it is there, else from the architecture."""
    per = DTYPE_BYTES[dtype]
    stored = DTYPE_BYTES.get(s.stored_dtype, 2)
    if folder is not None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                total = json.loads(index.read_text())["metadata"]["total_size"]
                params = total / stored
                return Weights(params * per, params, f"{index.name} (total_size {total:,} bytes at {s.stored_dtype})")
            except (OSError, ValueError, KeyError, TypeError):
                pass
        found = _safetensors_bytes(folder)
        if found is not None:
            params, _ = found
            return Weights(params * per, params, "the safetensors headers")
    params = parameters(s)
    return Weights(params * per, params, "the architecture in config.json (estimate)")


# -- KV cache ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvBytes:
    """KV-cache bytes per token on one device of a TP group, split by attention kind."""

    full: int  # per token, layers that keep every token
    sliding: int  # per token, layers that keep only the window
    window: int | None
    formula: str

    @property
    def per_token(self) -> int:
        return self.full + self.sliding

    def per_sequence(self, length: int) -> int:
        kept = length if self.window is None else min(length, self.window)
        return self.full * length + self.sliding * kept


def kv_bytes(s: ModelShape, element_bytes: int, tp: int = 1, pp: int = 1) -> KvBytes:
    if s.mla:
        latent = s.kv_lora_rank + s.qk_rope_head_dim
        per_layer = latent * element_bytes
        formula = (f"MLA: layers {s.layers} x (kv_lora_rank {s.kv_lora_rank} + qk_rope_head_dim {s.qk_rope_head_dim})"
                   f" x {element_bytes} B (one latent, on every device)")
    else:
        heads = math.ceil(s.kv_heads / tp)
        per_layer = 2 * heads * s.head_dim * element_bytes
        shown = f"ceil({s.kv_heads} KV heads / TP {tp}) = {heads}" if tp > 1 else f"{s.kv_heads} KV heads"
        formula = f"layers {s.layers} x 2 x {shown} x head dim {s.head_dim} x {element_bytes} B"
    if s.sliding_layers:
        formula += (f"; {s.sliding_layers} of the layers use a {s.sliding_window}-token sliding window "
                    f"and keep at most that much of a sequence")
    if pp > 1:
        formula += f"; / PP {pp} (each pipeline stage holds its share of the layers)"
    return KvBytes(math.ceil(s.full_layers / pp) * per_layer, math.ceil(s.sliding_layers / pp) * per_layer,
                   s.sliding_window, formula)


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
            return Option(tp, False, f"needs {_gb(need)} per device at utilization {target.gpu_memory_utilization} "
                          f"(weights {_gb(weights_share)} + reserve {_gb(reserve)}); a device has {_gb(memory)}", pp)
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


# -- output -----------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:,.1f} MB"


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def table(p: Plan) -> str:
    s, t = p.shape, p.target
    lines = [
        f"model: {p.model} ({s.model_type}, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, "
        f"{s.kv_heads} KV heads{', MLA' if s.mla else ''}{f', {s.experts} experts' if s.experts else ''})",
        f"weights: {_gb(p.weights.bytes)} at {t.dtype} ({_count(p.weights.parameters)} parameters, from "
        f"{p.weights.source})",
        f"KV bytes per token: {p.kv.per_token:,} = {p.kv.formula}",
        f"KV for one {t.max_model_len:,}-token sequence: {_gb(p.kv.per_sequence(t.max_model_len))}",
        f"platform: {p.platform.source}; block size {p.block_size}; "
        + (f"KV space {t.kv_cache_space_gib:g} GiB" if not p.platform.accelerator
           else f"gpu_memory_utilization {t.gpu_memory_utilization}") + f"; {t.nodes} node(s)",
        "",
        "| TP x PP | replicas per node | replicas | KV per device | num_gpu_blocks | cached tokens per replica "
        "| full-length sequences | max_num_seqs | fleet cache (tokens) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in p.options:
        size = f"{o.tp}" if o.pp == 1 else f"{o.tp} x {o.pp}"
        if not o.fits:
            lines.append(f"| {size} | - | - | - | - | - | - | - | {o.why} |")
            continue
        lines.append(f"| {size} | {o.replicas_per_node or f'1 per {o.pp} nodes'} | {o.replicas} | {_gb(o.kv_bytes_per_device)} | "
                     f"{o.num_gpu_blocks:,} | {p.tokens(o):,} | {o.full_sequences:,} | {o.max_num_seqs} | "
                     f"{p.tokens(o) * o.replicas:,} |")
    lines.append("")
    lines.append("More replicas give the router more choice and more engines working in parallel; larger ones hold "
                 "more of the working set each (a prefix cached on one replica only helps requests sent there).")
    if p.chosen is not None:
        size = f"TP {p.chosen.tp}" + (f" x PP {p.chosen.pp}" if p.chosen.pp > 1 else "")
        lines.append(f"chosen: {size} ({p.reason})")
    else:
        lines.append(f"chosen: none ({p.reason})")
    return "\n".join(lines)


def kvroute_config(p: Plan, base_port: int = 8100) -> dict[str, Any]:
    """A kvroute configuration for the chosen option (NODE-i stands for each node's address)."""
    o = p.chosen
    if o is None:
        raise PlanError(p.reason)
    replicas = []
    for node in range(0, p.target.nodes - o.pp + 1, o.pp):  # a pipeline-parallel replica's head node
        for i in range(max(1, o.replicas_per_node)):
            replicas.append({
                "name": f"node{node}-r{i}", "url": f"http://NODE-{node}:{base_port + i}",
                "platform": p.platform.name, "tensor_parallel_size": o.tp, "pipeline_parallel_size": o.pp,
                "max_num_seqs": o.max_num_seqs,
                "block_size": p.block_size, "num_gpu_blocks": o.num_gpu_blocks})
    return {"replicas": replicas}


def serve_commands(p: Plan, model_path: str | None = None, base_port: int = 8100,
                   kv_events_base_port: int = 5557) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of ``vllm serve`` for each replica of one node (a pipeline-parallel replica: the
    command on its head node)."""
    o = p.chosen
    if o is None:
        raise PlanError(p.reason)
    t = p.target
    out = []
    model = model_path or (str(Path(p.model).parent) if p.model.endswith(".json") else p.model)
    for i in range(max(1, o.replicas_per_node)):
        port = base_port + i
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{kv_events_base_port + 2 * i}",
                  "replay_endpoint": f"tcp://*:{kv_events_base_port + 2 * i + 1}", "topic": "kv"}
        argv = ["vllm", "serve", model, "--port", str(port),
                "--tensor-parallel-size", str(o.tp), "--block-size", str(p.block_size),
                "--max-model-len", str(t.max_model_len), "--max-num-seqs", str(o.max_num_seqs),
                "--enable-prefix-caching", "--kv-events-config", json.dumps(events, separators=(",", ":"))]
        if p.platform.accelerator:
            argv += ["--gpu-memory-utilization", str(t.gpu_memory_utilization), "--dtype", "bfloat16"]
        if t.kv_cache_dtype == "fp8":
            argv += ["--kv-cache-dtype", "fp8"]
        if o.pp > 1:  # on the head node of a Ray cluster spanning the replica's nodes
            argv += ["--pipeline-parallel-size", str(o.pp), "--distributed-executor-backend", "ray"]
        env, extra = p.platform.launch(platforms.Launch(i, o.tp, o.max_num_seqs, o.num_gpu_blocks, t.max_model_len,
                                                        p.block_size, t.dtype, t.kv_cache_space_gib))
        argv += extra
        out.append((env, argv))
    return out


def shell(env: dict[str, str], argv: list[str]) -> str:
    import shlex

    def quote(v: str) -> str:
        return v if v.startswith("$(") else shlex.quote(v)

    return " ".join([*(f"{k}={quote(v)}" for k, v in env.items()), *(shlex.quote(a) for a in argv)])


def as_dict(p: Plan, config: dict[str, Any] | None,
            commands: list[tuple[dict[str, str], list[str]]]) -> dict[str, Any]:
    """The plan as JSON-ready data (``kvroute plan --format json``)."""
    return {
        "model": p.model, "platform": p.platform.name, "block_size": p.block_size,
        "weights_bytes": p.weights.bytes, "weights_source": p.weights.source, "parameters": p.weights.parameters,
        "kv_bytes_per_token": p.kv.per_token, "kv_formula": p.kv.formula,
        "kv_bytes_per_sequence": p.kv.per_sequence(p.target.max_model_len),
        "options": [{"tp": o.tp, "pp": o.pp, "fits": o.fits, "why": o.why, "replicas_per_node": o.replicas_per_node,
                     "replicas": o.replicas, "kv_bytes_per_device": o.kv_bytes_per_device,
                     "num_gpu_blocks": o.num_gpu_blocks, "full_sequences": o.full_sequences,
                     "max_num_seqs": o.max_num_seqs} for o in p.options],
        "chosen": None if p.chosen is None else {"tp": p.chosen.tp, "pp": p.chosen.pp, "reason": p.reason},
        "kvroute_config": config,
        "vllm_serve": [{"env": env, "argv": argv} for env, argv in commands],
    }
