"""``kvroute`` command line: ``serve``, ``check-config``, ``config-reference``."""

from __future__ import annotations

import argparse
import logging
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
                        help="prefix index: in this process (default) or shared through Redis")
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
    return p


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
