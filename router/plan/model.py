"""A model's shape from its ``config.json``; its weights' size; what its KV cache takes per token."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..platforms import GB

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


def gb(x: float) -> str:
    """A byte count for people: GB, or MB below a tenth of one."""
    return f"{x / GB:,.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:,.1f} MB"
