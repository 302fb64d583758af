"""A plan as a table, as kvroute's replica list, as ``vllm serve`` commands and as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import platforms
from .fit import Plan
from .model import PlanError, gb

# -- output -----------------------------------------------------------------------------------


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def table(p: Plan) -> str:
    s, t = p.shape, p.target
    lines = [
        f"model: {p.model} ({s.model_type}, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, "
        f"{s.kv_heads} KV heads{', MLA' if s.mla else ''}{f', {s.experts} experts' if s.experts else ''})",
        f"weights: {gb(p.weights.bytes)} at {t.dtype} ({_count(p.weights.parameters)} parameters, from "
        f"{p.weights.source})",
        f"KV bytes per token: {p.kv.per_token:,} = {p.kv.formula}",
        f"KV for one {t.max_model_len:,}-token sequence: {gb(p.kv.per_sequence(t.max_model_len))}",
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
        lines.append(f"| {size} | {o.replicas_per_node or f'1 per {o.pp} nodes'} | {o.replicas} | {gb(o.kv_bytes_per_device)} | "
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


def roles(p: Plan) -> list[str]:
    """The roles the plan's replicas take: ``both``, or ``prefill`` and ``decode`` with ``--prefill-nodes``."""
    return ["prefill", "decode"] if p.target.prefill_nodes else ["both"]


def _role_of(p: Plan, node: int) -> str:
    if not p.target.prefill_nodes:
        return "both"
    return "prefill" if node < p.target.prefill_nodes else "decode"


def kvroute_config(p: Plan, base_port: int = 8100) -> dict[str, Any]:
    """A kvroute configuration for the chosen option (NODE-i stands for each node's address)."""
    o = p.chosen
    if o is None:
        raise PlanError(p.reason)
    if p.target.prefill_nodes % o.pp:
        raise PlanError(f"--prefill-nodes {p.target.prefill_nodes}: a replica of pipeline-parallel size {o.pp} spans "
                        f"{o.pp} nodes; give a multiple of {o.pp}")
    replicas = []
    for node in range(0, p.target.nodes - o.pp + 1, o.pp):  # a pipeline-parallel replica's head node
        role = _role_of(p, node)
        for i in range(max(1, o.replicas_per_node)):
            replicas.append({
                "name": f"node{node}-r{i}", "url": f"http://NODE-{node}:{base_port + i}",
                "platform": p.platform.name, "tensor_parallel_size": o.tp, "pipeline_parallel_size": o.pp,
                "max_num_seqs": o.max_num_seqs,
                "block_size": p.block_size, "num_gpu_blocks": o.num_gpu_blocks,
                **({"role": role} if role != "both" else {})})
    return {"replicas": replicas}


NIXL_SIDE_CHANNEL_BASE_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default; one per replica on a node


def serve_commands(p: Plan, model_path: str | None = None, base_port: int = 8100,
                   kv_events_base_port: int = 5557) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of ``vllm serve`` for each replica of one node (a pipeline-parallel replica: the
    command on its head node). With ``--prefill-nodes`` every replica gets vLLM's NixlConnector and its side
    channel on the node's address: ``kv_role: kv_both``, as a prefill and a decode replica both run it (the
    kv_transfer_params kvroute sets with each request say which side a replica plays), so the commands are the
    same for both roles."""
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
        if p.target.prefill_nodes:
            transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                        "kv_buffer_device": p.platform.kv_buffer_device}
            argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
            env = {**env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "$(hostname -i)",
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_BASE_PORT + i)}
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
        "roles": roles(p),
        "vllm_serve": [{"env": env, "argv": argv} for env, argv in commands],
    }
