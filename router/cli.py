"""``kvroute`` command line: ``serve``, ``check-config``, ``config-reference``, ``plan``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

import yaml

from . import __version__, logs
from .config import POLICIES, ConfigError, RouterConfig, load_config, parse_replica_spec, reference, set_path

log = logging.getLogger("kvroute")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing gateway for vLLM replicas.")
    p.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def config_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", metavar="FILE", help="YAML configuration file (also KVROUTE_CONFIG)")
        sp.add_argument("--replica", action="append", default=[], metavar="[NAME=]URL",
                        help="a vLLM replica; repeat for several (replaces the file's list)")
        sp.add_argument("--policy", choices=POLICIES, help="routing policy (default: cache-aware)")
        sp.add_argument("--index", metavar="memory|redis://HOST:PORT/DB",
                        help="where the index and other shared state live: in this process (default), or a "
                             "Redis or Redis Cluster shared by routers (several nodes: redis://H1:P1,H2:P2)")
        sp.add_argument("--workers", type=int, metavar="N",
                        help="worker processes sharing the port (default: 1; more need --index redis://... "
                             "with a cache-aware policy)")
        sp.add_argument("--host", help="listen address (default: 127.0.0.1)")
        sp.add_argument("--port", type=int, help="listen port (default: 8000)")
        sp.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
        sp.add_argument("--log-json", action="store_true", default=None, help="log one JSON object per line")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="set any config field, e.g. --set proxy.stream_idle_timeout_s=30")

    serve = sub.add_parser("serve", help="run the gateway")
    config_flags(serve)
    check = sub.add_parser("check-config", help="validate the configuration and print it (keys masked)")
    config_flags(check)
    sub.add_parser("config-reference", help="print the configuration reference (Markdown table)")
    plan_flags(sub.add_parser("plan", help="size replicas for a model on a platform: KV blocks, TP, the kvroute "
                                          "config and the vllm serve commands",
                              description="From a model's config.json (a local file or folder; never downloaded) "
                                          "and a target, compute weights, KV bytes per token, the tensor-parallel "
                                          "sizes that fit, KV blocks per replica and replicas per node; print a "
                                          "table, a kvroute configuration and each replica's vllm serve command."))
    return p


def plan_flags(sp: argparse.ArgumentParser) -> None:
    from . import platforms

    sp.add_argument("model", help="config.json, or the model's folder (safetensors headers give the exact weights)")
    sp.add_argument("--platform", required=True, choices=platforms.names())
    sp.add_argument("--nodes", type=int, default=1, help="nodes to fill (default: 1)")
    sp.add_argument("--max-model-len", type=int, default=8192, help="vLLM's --max-model-len (default: 8192)")
    sp.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="weights (default: bf16)")
    sp.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="KV cache elements: auto = 2 bytes (bf16), fp8 = 1 byte")
    sp.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's (default: 0.9)")
    sp.add_argument("--tp", type=int, help="only this tensor-parallel size")
    sp.add_argument("--block-size", type=int, help="KV block size (default: the platform's)")
    sp.add_argument("--device-memory-gb", type=float, help="memory per device (default: the platform's)")
    sp.add_argument("--reserve-gb", type=float,
                    help="per device for activations and graphs (default: 4 on Gaudi, 2 elsewhere, 0 on cpu)")
    sp.add_argument("--kv-cache-space-gib", type=float, default=4.0, help="cpu: VLLM_CPU_KVCACHE_SPACE (default: 4)")
    sp.add_argument("--seq-len", type=int, help="typical prompt + output tokens, for max_num_seqs "
                                                "(default: a quarter of --max-model-len)")
    sp.add_argument("--min-full-sequences", type=int, default=4,
                    help="full-length sequences a replica must hold to be chosen (default: 4)")
    sp.add_argument("--base-port", type=int, default=8100, help="first replica's port on each node (default: 8100)")
    sp.add_argument("--prefill-nodes", type=int, default=0,
                    help="disaggregated prefill and decode: the first this many nodes serve prefill replicas, the "
                         "rest decode, over vLLM's NixlConnector (default: 0, every replica both)")
    sp.add_argument("--format", choices=("text", "json"), default="text")


def run_plan(args: argparse.Namespace) -> int:
    import json

    from . import plan as planner

    target = planner.Target(
        platform=args.platform, nodes=args.nodes, max_model_len=args.max_model_len, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization, tp=args.tp,
        block_size=args.block_size, device_memory_gb=args.device_memory_gb, kv_cache_space_gib=args.kv_cache_space_gib,
        reserve_gb=args.reserve_gb, seq_len=args.seq_len, min_full_sequences=args.min_full_sequences,
        prefill_nodes=args.prefill_nodes)
    try:
        p = planner.plan(args.model, target)
    except planner.PlanError as e:
        sys.stderr.write(f"kvroute plan: {e}\n")
        return 2
    try:
        commands = planner.serve_commands(p, base_port=args.base_port) if p.chosen is not None else []
        config = planner.kvroute_config(p, args.base_port) if p.chosen is not None else None
    except planner.PlanError as e:
        sys.stderr.write(f"kvroute plan: {e}\n")
        return 2
    if args.format == "json":
        sys.stdout.write(json.dumps(planner.as_dict(p, config, commands), indent=2) + "\n")
        return 0 if p.chosen is not None else 1
    sys.stdout.write(planner.table(p) + "\n")
    if p.chosen is None:
        return 1
    sys.stdout.write("\n# kvroute.yaml (NODE-i: each node's address)\n")
    sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
    if args.prefill_nodes:
        sys.stdout.write(f"\n# on each node, prefill ({_nodes_of(config, 'prefill')}) and decode "
                         f"({_nodes_of(config, 'decode')}) alike, one line per replica (kvroute gives the roles)\n")
    else:
        sys.stdout.write("\n# on each node, one line per replica\n")
    for env, argv in commands:
        sys.stdout.write(planner.shell(env, argv) + "\n")
    return 0


def _nodes_of(config: dict[str, Any], role: str) -> str:
    """Which nodes (NODE-i) hold the replicas of ``role`` in a planned configuration."""
    nodes = list(dict.fromkeys(r["url"].split("NODE-")[1].split(":")[0] for r in config["replicas"]
                               if r.get("role") == role))
    return f"NODE-{nodes[0]}" if len(nodes) == 1 else f"NODE-{nodes[0]} to NODE-{nodes[-1]}"


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
        set_path(out, field.strip(), yaml.safe_load(value) if value else value)
    if args.replica:
        out["replicas"] = [parse_replica_spec(s) for s in args.replica]
    for key in ("policy", "host", "port", "workers"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.index:
        out.setdefault("index", {})["backend"] = args.index
    if args.log_level:
        out.setdefault("log", {})["level"] = args.log_level
    if args.log_json:
        out.setdefault("log", {})["json"] = True
    return out


def load(args: argparse.Namespace) -> RouterConfig:
    return load_config(args.config, overrides=_overrides(args))


def serve(config: RouterConfig) -> int:
    logs.setup(config.log.level, config.log.json_format)
    if not config.replicas:
        log.warning("no replicas configured: every request will get 503")
    if config.workers > 1:
        from . import workers

        return workers.run(config)
    from .server import run_server

    return run_server(config)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config-reference":
        sys.stdout.write(reference() + "\n")
        return 0
    if args.command == "plan":
        try:
            return run_plan(args)
        except BrokenPipeError:  # the reader (head, less) has what it wanted
            sys.stdout = open(os.devnull, "w")
            return 0
    try:
        config = load(args)
        from .workers import check

        check(config)  # the policy's stages and parameters, and what several workers need
    except ConfigError as e:
        sys.stderr.write(f"kvroute: {e}\n")
        return 2
    if args.command == "check-config":
        sys.stdout.write(yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False))
        return 0
    return serve(config)
