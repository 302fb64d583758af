"""Predicted against measured time to first token, per platform profile: the cluster benchmark's default workload
(loadtest/cluster_bench.yaml) on a simulated cluster of each profile, through kvroute as shipped (predictions
corrected online by what each replica measured) and through kvroute with ``prediction.correct=false``.

    python -m loadtest.bench_prediction [--profiles gaudi2-tp8,cpu] [--rates 0.5,1.0] [--quick]

Each answer's error is |predicted - measured| / measured, with the prediction from its
``x-kvroute-predicted-ttft-ms`` header and the time to first token as the load generator measured it; the table
gives their median per run. Each profile's cluster keeps the default's cache size in tokens (8 replicas x 15,360),
and its rates are fractions of the saturation kvroute measures on it first. Results go to
``loadtest/results/prediction/``; a full run replaces the section of docs/benchmarks.md between
``<!-- bench:prediction -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .cluster import ROOT
from .cluster_bench import RouterSpec, run_router, saturation, update_readme
from .profiles import PROFILES
from .tiny_model import write_tokenizer

ROUTERS = ("kvroute", "kvroute-uncorrected")
CACHE_TOKENS = 120 * 128  # the default cluster's KV cache per replica, in tokens


def profile_config(base: dict[str, Any], profile: str) -> dict[str, Any]:
    cfg = json.loads(json.dumps(base))
    cfg["name"] = f"prediction-{profile}"
    cfg["cluster"]["profile"] = profile
    cfg["cluster"]["num_gpu_blocks"] = CACHE_TOKENS // PROFILES[profile].block_size
    return cfg


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| profile | offered (of saturation) | router | median TTFT error | median measured / predicted | "
           "TTFT p50 / p90 ms | hit rate | output tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error'] * 100:.1f}%"
        out.append(f"| {r['profile']} | {r['fraction']:g} ({r['rps']:.2f} req/s) | {r['router']} | {err} | {r['ratio']} | "
                   f"{r['ttft_p50_ms']:g} / {r['ttft_p90_ms']:g} | {r['hit_rate']} | {r['output_tokens_per_s']:g} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_prediction", description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated (default: every profile)")
    p.add_argument("--rates", default="0.5,1.0", help="offered loads as fractions of saturation")
    p.add_argument("--quick", action="store_true", help="a fifth of the groups and requests (docs left alone)")
    p.add_argument("--out", type=Path, help="results here (default: loadtest/results/prediction; docs/benchmarks.md "
                   "is updated only with the default)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    base = yaml.safe_load((ROOT / "loadtest" / "cluster_bench.yaml").read_text())
    base["rates"] = [float(x) for x in args.rates.split(",")]
    if args.quick:
        w = base["workload"]
        w["groups"] = w["warmup"] = max(2, w["groups"] // 5)
        base["requests_per_rate"] = max(20, base["requests_per_rate"] // 5)
    routers = yaml.safe_load((ROOT / "loadtest" / "routers.yaml").read_text())
    specs = [RouterSpec.parse(name, routers[name]) for name in ROUTERS]
    out = args.out or ROOT / "loadtest" / "results" / "prediction"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = write_tokenizer(logs / "tiny-model")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for profile in args.profiles.split(","):
        cfg = profile_config(base, profile)
        sat = saturation(cfg, specs[0], logs, root)
        sys.stderr.write(f"{profile}: saturation {sat:.2f} requests/s\n")
        for spec in specs:
            sys.stderr.write(f"{profile} {spec.name}:\n")
            for r in run_router(spec, cfg, sat, logs, root)["rows"]:
                rows.append({"profile": profile, "router": spec.name, "fraction": r["load_fraction"],
                             "rps": r["offered_rate"], "error": r["ttft_prediction_error"],
                             "ratio": r["ttft_prediction_ratio"],
                             "ttft_p50_ms": r["ttft_p50_ms"], "ttft_p90_ms": r["ttft_p90_ms"],
                             "hit_rate": r["hit_rate"], "output_tokens_per_s": r["output_tokens_per_s"],
                             "errors": r["errors"]})
    rows.sort(key=lambda r: (r["profile"], r["fraction"], r["router"]))
    shipped = [r["error"] for r in rows if r["router"] == "kvroute" and r["error"] is not None]
    text = ("Workload: loadtest/cluster_bench.yaml (shared prefix, 42 groups x 8 prompts of 2,048 + 64 tokens, 64 "
            f"out, {base['requests_per_rate']} requests per run after a warm-up of one prompt per group), 8 simulated "
            "replicas per profile.\n\n" + table(rows))
    if shipped:
        text += (f"\nkvroute as shipped: median error {min(shipped) * 100:.1f}% to {max(shipped) * 100:.1f}% over "
                 f"{len(shipped)} runs (target: at most 20% on every profile).\n")
    text += f"\nCommand: `python -m loadtest.bench_prediction{' ' + ' '.join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ''}`; wall time {time.monotonic() - started:.0f} s.\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"rows": rows, "rates": base["rates"]}, indent=2))
    if not args.quick and args.out is None:
        update_readme(ROOT / "docs" / "benchmarks.md", "prediction", text, bench="bench")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
