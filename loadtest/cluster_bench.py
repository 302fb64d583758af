"""Time to first token at cluster scale: routers side by side on one simulated cluster.

    python -m loadtest.cluster_bench [--config loadtest/cluster_bench.yaml] [--quick]

For each router in the configuration (commands in ``loadtest/routers.yaml``) and each offered rate, a
fresh simulated cluster is started (``loadtest.simulator --replicas N --profile P``: the engine model,
empty caches), the router in front of it, and the same seeded request sequence is sent open loop at
that rate (``loadtest.load``). Shares per replica come from the replicas' own request counters, so
every router is measured alike. The rates are fractions of the cluster's saturation throughput, measured
first: a closed-loop run through kvroute with many requests in flight. A router that is not
installed is reported as skipped. Results go to ``loadtest/results/<name>/``: ``results.json``,
``results.md`` and, with matplotlib, ``ttft_p90.png`` and ``throughput.png`` (one line per router).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from . import load
from .cluster import ROOT, Proc, free_port, free_ports, simulator


def router_command(template: str, port: int, urls: list[str]) -> list[str]:
    text = template.format(python=shlex.quote(sys.executable), port=port, metrics_port=free_port(),
                           urls=" ".join(urls), replica_args=" ".join(f"--replica {u}" for u in urls))
    argv = shlex.split(text)
    beside = Path(sys.executable).parent / argv[0]  # installed in this environment, not on PATH
    if shutil.which(argv[0]) is None and beside.exists():
        argv[0] = str(beside)
    return argv


def start_cluster(cfg: dict[str, Any], out: Path, tag: str) -> tuple[Proc, list[str]]:
    c = cfg["cluster"]
    n = int(c["replicas"])
    base = free_ports(n)
    args = ["--replicas", str(n), "--profile", c["profile"], "--time-scale", str(c.get("time_scale", 1.0))]
    if c.get("num_gpu_blocks"):
        args += ["--num-gpu-blocks", str(c["num_gpu_blocks"])]
    proc = simulator(base, "tiny", *args, log_dir=out, name=f"cluster-{tag}").start()
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    proc.wait_http()
    for u in urls:
        httpx.get(u + "/health", timeout=10).raise_for_status()
    return proc, urls


def start_router(name: str, template: str, urls: list[str], out: Path) -> Proc:
    port = free_port()
    argv = router_command(template, port, urls)
    proc = Proc(name, argv, port, log_path=out / f"router-{name}.log").start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ready: it answers a request
        try:
            r = httpx.post(proc.url + "/v1/chat/completions", timeout=10, json={
                "model": "tiny", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1})
            if r.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.popen is not None and proc.popen.poll() is not None:
            break
        time.sleep(0.5)
    proc.stop()
    raise RuntimeError(f"{name} did not come up: {proc.log_tail(800)}")


def workload_args(cfg: dict[str, Any], target: str, urls: list[str]) -> list[str]:
    w = cfg["workload"]
    args = ["--target", target, "--replicas", ",".join(urls), "--workload", w["kind"],
            "--requests", str(cfg["requests_per_rate"])]
    for key in ("groups", "prompts_per_group", "system_tokens", "question_tokens", "output_tokens", "conversations",
                "turns", "think_s", "prefixes"):
        if key in w:
            args += ["--" + key.replace("_", "-"), str(w[key])]
    return args


def saturation(cfg: dict[str, Any], templates: dict[str, str], out: Path) -> float:
    cluster, urls = start_cluster(cfg, out, "saturation")
    rt = None
    try:
        rt = start_router("kvroute", templates["kvroute"], urls, out)
        args = load.parser().parse_args(workload_args(cfg, rt.url, urls) + [
            "--closed-loop", "--concurrency", str(cfg.get("saturation_concurrency", 128))])
        res = asyncio.run(load.run(args))
        return float(res["rows"][0]["achieved_rps"])
    finally:
        if rt is not None:
            rt.stop()
        cluster.stop()


def run_router(name: str, template: str, cfg: dict[str, Any], rates: list[float], out: Path) -> dict[str, Any]:
    """Each rate on a fresh cluster and router: empty caches, the same request sequence."""
    rows = []
    for rate in rates:
        cluster, urls = start_cluster(cfg, out, name)
        rt = None
        try:
            rt = start_router(name, template, urls, out)
            args = load.parser().parse_args(workload_args(cfg, rt.url, urls) + ["--rates", f"{rate:.3f}"])
            rows += asyncio.run(load.run(args))["rows"]
        finally:
            if rt is not None:
                rt.stop()
            cluster.stop()
    return {"router": name, "rows": rows}


def report(cfg: dict[str, Any], sat: float, results: list[dict[str, Any]], skipped: dict[str, str]) -> str:
    c = cfg["cluster"]
    w = cfg["workload"]
    lines = [f"## Cluster benchmark: {cfg['name']}", "",
             f"{c['replicas']} simulated `{c['profile']}` replicas ({c.get('num_gpu_blocks') or 'profile'} KV blocks "
             f"each, time scale {c.get('time_scale', 1.0)}), `{w['kind']}` workload "
             f"({', '.join(f'{k} {v}' for k, v in w.items() if k != 'kind')}), {cfg['requests_per_rate']} requests per "
             f"rate, saturation measured at {sat:.2f} requests/s.", ""]
    lines += ["| router | offered req/s | achieved req/s | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 ms | "
              "hit rate | max/mean share | errors |", "|" + "---|" * 9]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {res['router']} | {r['offered_rate']:.2f} | {r['achieved_rps']:.2f} | "
                         f"{r['output_tokens_per_s']:.0f} | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} / {r['ttft_p99_ms']} | "
                         f"{r['itl_p50_ms']} | {r['hit_rate']} | {r['max_mean_share']} | {r['errors']} |")
    for name, why in skipped.items():
        lines.append(f"\nSkipped {name}: {why}.")
    return "\n".join(lines) + "\n"


def plots(results: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for key, label, fname in (("ttft_p90_ms", "TTFT p90 (ms)", "ttft_p90.png"),
                              ("output_tokens_per_s", "output tokens/s", "throughput.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for res in results:
            xs = [r["offered_rate"] for r in res["rows"]]
            ys = [r[key] for r in res["rows"]]
            ax.plot(xs, ys, marker="o", label=res["router"])
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(fname)
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.cluster_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "loadtest" / "cluster_bench.yaml")
    p.add_argument("--routers", type=Path, default=ROOT / "loadtest" / "routers.yaml")
    p.add_argument("--only", action="append", help="only these routers")
    p.add_argument("--quick", action="store_true", help="a fifth of the groups and requests, three rates (to try "
                   "the set-up)")
    p.add_argument("--out", type=Path, help="results here (default: loadtest/results/NAME)")
    args = p.parse_args(argv)
    cfg = yaml.safe_load(args.config.read_text())
    templates = yaml.safe_load(args.routers.read_text())
    if args.quick:
        w = cfg["workload"]
        if "groups" in w:
            w["groups"] = max(2, w["groups"] // 5)
        cfg["requests_per_rate"] = max(20, cfg["requests_per_rate"] // 5)
        cfg["rates"] = [0.2, 0.7, 1.0]
    out = args.out or ROOT / "loadtest" / "results" / cfg["name"]
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    sat = saturation(cfg, templates, logs)
    sys.stderr.write(f"saturation: {sat:.2f} requests/s\n")
    rates = [round(f * sat, 3) for f in cfg["rates"]]
    results, skipped = [], {}
    for name in cfg["routers"]:
        if args.only and name not in args.only:
            continue
        template = templates.get(name)
        if template is None:
            skipped[name] = "not in the routers file"
            continue
        exe = router_command(template, 0, [])[0]
        if shutil.which(exe) is None and not Path(exe).exists():
            skipped[name] = f"`{exe}` is not installed (pip install '.[bench]')"
            continue
        sys.stderr.write(f"{name}:\n")
        try:
            results.append(run_router(name, template, cfg, rates, logs))
        except RuntimeError as e:
            skipped[name] = str(e).splitlines()[0]
    text = report(cfg, sat, results, skipped)
    made = plots(results, out)
    text += "".join(f"\n![{m}]({m})\n" for m in made)
    text += f"\nWall time: {time.monotonic() - started:.0f} s.\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"config": cfg, "saturation_rps": sat, "results": results,
                                                  "skipped": skipped}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
