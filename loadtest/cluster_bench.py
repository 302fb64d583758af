"""Time to first token at cluster scale: routers side by side on one simulated cluster.

    python -m loadtest.cluster_bench [--config loadtest/cluster_bench.yaml] [--quick]

For each router in the configuration (commands in ``loadtest/routers.yaml``) and each offered rate, a
fresh simulated cluster is started (``loadtest.simulator --replicas N --profile P`` per group of
replicas: the engine model, empty caches, the tiny model's tokenizer and KV-cache events, as a real
vLLM fleet with events on would have), the router in front of it (several instances sharing a fresh
Redis where its command asks for one), and the same seeded request sequence is sent open loop at that
rate (``loadtest.load``; with several router instances, requests take turns). Shares per replica come
from the replicas' own request counters, so every router is measured alike. The rates are fractions
of the cluster's saturation throughput, measured first: a closed-loop run through kvroute with many
requests in flight. A router that is not installed is reported as skipped. ``pinned`` is no router: the
load generator sends each group (conversation) straight to replica number group mod N, the placement a
cache-aware router aims for without any router's time in it, and the report compares kvroute with it
as a reference. Results go to
``loadtest/results/<name>/``: ``results.json``, ``results.md`` with the targets checked and, with
matplotlib, ``ttft_p90.png`` and ``throughput.png`` (one line per router); a full run also replaces
its section of docs/benchmarks.md (between ``<!-- cluster-bench:<name> -->`` markers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from . import load
from .cluster import ROOT, Proc, free_port, free_ports, redis_server, simulator, wait_redis
from .profiles import PROFILES
from .tiny_model import write_tokenizer


@dataclass
class RouterSpec:
    """One line of the routers file: a command with placeholders, and how many instances run it; or
    ``{pinned: true}``, no router at all: each group or conversation sent straight to one replica."""

    name: str
    command: str
    instances: int = 1
    pinned: bool = False

    @classmethod
    def parse(cls, name: str, entry: str | dict[str, Any]) -> "RouterSpec":
        if isinstance(entry, str):
            return cls(name, entry)
        if entry.get("pinned"):
            return cls(name, "", 0, pinned=True)
        return cls(name, str(entry["command"]), int(entry.get("instances", 1)))

    @property
    def needs_redis(self) -> bool:
        return "{redis}" in self.command

    def argv(self, port: int, fleet: "Fleet", redis: str = "") -> list[str]:
        urls = fleet.urls
        of = dict(zip(urls, fleet.roles))
        text = self.command.format(python=shlex.quote(sys.executable), port=port, metrics_port=free_port(),
                                   urls=" ".join(urls), replica_args=" ".join(f"--replica {u}" for u in urls),
                                   prefill_args=" ".join(f"--prefill {u}" for u in urls if of.get(u) != "decode"),
                                   decode_args=" ".join(f"--decode {u}" for u in urls if of.get(u) != "prefill"),
                                   config=shlex.quote(str(fleet.config_path)),
                                   config_aggregated=shlex.quote(str(fleet.aggregated_path)), redis=redis)
        argv = shlex.split(text)
        argv[0] = _executable(argv[0]) or argv[0]
        return argv

    def installed(self) -> str | None:
        """The executable's name when it is missing."""
        if self.pinned:
            return None
        exe = shlex.split(self.command)[0]
        return None if exe.startswith("{python}") or _executable(exe) else exe


def _executable(name: str) -> str | None:
    """``name`` on PATH, or installed beside this Python (in its environment, not on PATH); None when neither."""
    if shutil.which(name):
        return name
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else None


@dataclass
class Fleet:
    """A simulated cluster: one simulator process per group of replicas, and a kvroute configuration that
    states each replica's platform and tensor-parallel size, as an operator would write it."""

    procs: list[Proc] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    config_path: Path = Path()
    aggregated_path: Path = Path()  # the same replicas, every one of role both (no request split)
    roles: list[str] = field(default_factory=list)  # each URL's role: both, prefill or decode

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def groups(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The cluster's groups of like replicas (``cluster.groups``, or the cluster itself as one group)."""
    c = cfg["cluster"]
    return c.get("groups") or [{k: c[k] for k in ("profile", "replicas", "num_gpu_blocks", "role") if k in c}]


def disaggregated(cfg: dict[str, Any]) -> bool:
    """Whether the cluster has replicas of role prefill or decode (each runs a KV connector then)."""
    return any(g.get("role", "both") != "both" for g in groups(cfg))


def start_cluster(cfg: dict[str, Any], out: Path, tag: str, root: Path) -> Fleet:
    c = cfg["cluster"]
    fleet = Fleet(config_path=out / f"kvroute-{tag}.yaml", aggregated_path=out / f"kvroute-{tag}-aggregated.yaml")
    replicas = []
    connector = disaggregated(cfg)
    try:
        for gi, g in enumerate(groups(cfg)):
            n, prof = int(g["replicas"]), PROFILES[g["profile"]]
            args = ["--replicas", str(n), "--profile", prof.name, "--time-scale", str(c.get("time_scale", 1.0)),
                    "--root", str(root)]
            if c.get("kv_events", True):
                args.append("--kv-events")
            if g.get("num_gpu_blocks"):
                args += ["--num-gpu-blocks", str(g["num_gpu_blocks"])]
            if c.get("max_model_len"):
                args += ["--max-model-len", str(c["max_model_len"])]
            if connector:  # as vllm --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
                args += ["--kv-connector", "NixlConnector"]
            for attempt in range(3):  # another process may take a port between the check and the bind
                base = free_ports(n)
                proc = simulator(base, "tiny", *args, log_dir=out, name=f"cluster-{tag}-{gi}").start()
                try:
                    proc.wait_http()
                    break
                except RuntimeError:
                    proc.stop()
                    if attempt == 2:
                        raise
            fleet.procs.append(proc)
            for i in range(n):
                url = f"http://127.0.0.1:{base + i}"
                httpx.get(url + "/health", timeout=10).raise_for_status()
                fleet.urls.append(url)
                fleet.roles.append(g.get("role", "both"))
                replicas.append({"url": url, "platform": prof.platform,
                                 "tensor_parallel_size": prof.tensor_parallel_size, "max_num_seqs": prof.max_num_seqs,
                                 "max_num_batched_tokens": prof.max_num_batched_tokens,
                                 **({"role": g["role"]} if g.get("role", "both") != "both" else {})})
    except BaseException:
        fleet.stop()
        raise
    fleet.config_path.write_text(yaml.safe_dump({"replicas": replicas}, sort_keys=False))
    whole = [{k: v for k, v in r.items() if k != "role"} for r in replicas]
    fleet.aggregated_path.write_text(yaml.safe_dump({"replicas": whole}, sort_keys=False))
    return fleet


@dataclass
class RouterRun:
    """A router's instances (and their Redis, if they share one) in front of a fleet."""

    procs: list[Proc]
    redis: Proc | None = None
    replicas: list[str] = field(default_factory=list)  # pinned: no router, the replicas themselves

    @property
    def target(self) -> str:
        return ",".join([p.url for p in self.procs] or self.replicas)

    @property
    def pinned(self) -> bool:
        return not self.procs

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
        if self.redis is not None:
            self.redis.stop()


def _ready(proc: Proc, deadline: float) -> bool:
    """It answers a request (every router under test, whatever its own health endpoint)."""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(proc.url + "/v1/chat/completions", timeout=10, json={
                "model": "tiny", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1})
            if r.status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc.popen is not None and proc.popen.poll() is not None:
            return False
        time.sleep(0.5)
    return False


def start_router(spec: RouterSpec, fleet: Fleet, out: Path) -> RouterRun:
    if spec.pinned:
        return RouterRun([], replicas=fleet.urls)
    run = RouterRun([])
    redis = ""
    if spec.needs_redis:
        run.redis = redis_server(log_dir=out).start()
        wait_redis(run.redis)
        redis = f"redis://127.0.0.1:{run.redis.port}/0"
    deadline = time.monotonic() + 60
    for i in range(spec.instances):
        port = free_port()
        name = spec.name if spec.instances == 1 else f"{spec.name}-{i}"
        run.procs.append(Proc(name, spec.argv(port, fleet, redis), port, log_path=out / f"router-{name}.log").start())
    for proc in run.procs:
        if not _ready(proc, deadline):
            tail = proc.log_tail(800)
            run.stop()
            raise RuntimeError(f"{proc.name} did not come up: {tail}")
    return run


def workload_args(cfg: dict[str, Any], rt: RouterRun, urls: list[str]) -> list[str]:
    w = cfg["workload"]
    args = ["--target", rt.target, "--replicas", ",".join(urls), "--workload", w["kind"],
            "--requests", str(cfg["requests_per_rate"]), "--words", "tiny-model"] + (["--pin"] if rt.pinned else [])
    for key in ("groups", "prompts_per_group", "system_tokens", "question_tokens", "output_tokens", "conversations",
                "turns", "think_s", "prefixes", "warmup", "trace_sample"):
        if key in w:
            args += ["--" + key.replace("_", "-"), str(w[key])]
    return args


def saturation(cfg: dict[str, Any], spec: RouterSpec, out: Path, root: Path) -> float:
    fleet = start_cluster(cfg, out, "saturation", root)
    rt = None
    try:
        rt = start_router(spec, fleet, out)
        args = load.parser().parse_args(workload_args(cfg, rt, fleet.urls) + [
            "--closed-loop", "--concurrency", str(cfg.get("saturation_concurrency", 128))])
        res = asyncio.run(load.run(args))
        return float(res["rows"][0]["achieved_rps"])
    finally:
        if rt is not None:
            rt.stop()
        fleet.stop()


def run_router(spec: RouterSpec, cfg: dict[str, Any], sat: float, out: Path, root: Path) -> dict[str, Any]:
    """Each rate on a fresh cluster and router: empty caches, the same request sequence."""
    rows = []
    for fraction in cfg["rates"]:
        fleet = start_cluster(cfg, out, spec.name, root)
        rt = None
        try:
            rt = start_router(spec, fleet, out)
            args = load.parser().parse_args(workload_args(cfg, rt, fleet.urls) +
                                            ["--rates", f"{fraction * sat:.3f}"])
            row = asyncio.run(load.run(args))["rows"][0]
            rows.append({**row, "load_fraction": fraction})
        finally:
            if rt is not None:
                rt.stop()
            fleet.stop()
    return {"router": spec.name, "rows": rows, **({"pinned": True} if spec.pinned else {})}


def describe(cfg: dict[str, Any]) -> str:
    c = cfg["cluster"]
    parts = [f"{g['replicas']} x `{g['profile']}`{' ' + g['role'] if g.get('role', 'both') != 'both' else ''} "
             f"({g.get('num_gpu_blocks') or PROFILES[g['profile']].num_gpu_blocks} "
             f"KV blocks of {PROFILES[g['profile']].block_size} tokens each)" for g in groups(cfg)]
    return " + ".join(parts) + f", time scale {c.get('time_scale', 1.0)}"


def _row_at(res: dict[str, Any], fraction: float) -> dict[str, Any] | None:
    return next((r for r in res["rows"] if abs(r["load_fraction"] - fraction) < 1e-9), None)


def verdicts(results: list[dict[str, Any]], mixed: bool = False, targets: dict[str, float] | None = None) -> list[str]:
    """kvroute (its defaults) against the best of the other routers, at 70% of saturation and at saturation, and
    every kvroute configuration of one or several instances against the reference where one ran. ``targets``
    (the configuration's ``targets``): ``vs_best_other``, the most kvroute's TTFT p90 at 70% may be as a share of
    the best other router's (0.5 unless set; ``null`` for none), and ``vs_pinned``, as a share of the reference's."""
    targets = {"vs_best_other": 0.5, **(targets or {})}
    ours = next((r for r in results if r["router"] == "kvroute"), None)
    others = [r for r in results if not r["router"].startswith("kvroute") and not r.get("pinned")]
    pinned = next((r for r in results if r.get("pinned")), None)
    if ours is None:
        return []
    out = []
    at70 = _row_at(ours, 0.7)
    best70 = min(((_row_at(o, 0.7), o["router"]) for o in others if _row_at(o, 0.7)),
                 key=lambda t: t[0]["ttft_p90_ms"] or float("inf"), default=(None, ""))
    if at70 and best70[0]:
        ratio = at70["ttft_p90_ms"] / best70[0]["ttft_p90_ms"]
        goal = targets.get("vs_best_other")
        verdict = f"target <= {goal:g}: {'met' if ratio <= goal else 'NOT met'}" if goal else "no target here"
        out.append(f"- At 70% of saturation, kvroute's TTFT p90 is {at70['ttft_p90_ms']:.0f} ms against "
                   f"{best70[0]['ttft_p90_ms']:.0f} ms for the best other router ({best70[1]}): {ratio:.2f}x "
                   f"({verdict}).")
    ref70 = _row_at(pinned, 0.7) if pinned else None
    if at70 and ref70 and ref70["ttft_p90_ms"]:
        goal = targets.get("vs_pinned")
        line = (f"- Reference, {pinned['router']} (each group or conversation sent straight to one replica, no "
                f"router): TTFT p90 {ref70['ttft_p90_ms']:.0f} ms at 70% of saturation; kvroute's is "
                f"{at70['ttft_p90_ms'] / ref70['ttft_p90_ms']:.2f}x that")
        ref = ref70["ttft_p90_ms"]
        several = [(r["router"], row["ttft_p90_ms"]) for r in results
                   if r["router"].startswith("kvroute-redis-") and (row := _row_at(r, 0.7))]
        line += "".join(f", {name}'s {p90 / ref:.2f}x" for name, p90 in several if p90)
        if goal:
            worst = max([at70["ttft_p90_ms"]] + [p90 or float("inf") for _, p90 in several])
            line += f" (target <= {goal:g} for each: {'met' if worst / ref <= goal else 'NOT met'})"
        line += "."
        if best70[0]:
            half = best70[0]["ttft_p90_ms"] / 2
            line += (f" Half the best other router's p90, {half:.0f} ms, is "
                     f"{'below' if half < ref70['ttft_p90_ms'] else 'above'} the reference's.")
        out.append(line)
    at100 = _row_at(ours, 1.0)
    best100 = max(((_row_at(o, 1.0), o["router"]) for o in others if _row_at(o, 1.0)),
                  key=lambda t: t[0]["output_tokens_per_s"], default=(None, ""))
    if at100 and best100[0]:
        ratio = at100["output_tokens_per_s"] / best100[0]["output_tokens_per_s"]
        out.append(f"- At saturation, kvroute delivers {at100['output_tokens_per_s']:.0f} output tokens/s against "
                   f"{best100[0]['output_tokens_per_s']:.0f} for the best other router ({best100[1]}): {ratio:.2f}x "
                   f"(target >= 1: {'met' if ratio >= 0.995 else 'NOT met'}).")
    errors = sum(r["errors"] for r in ours["rows"])
    worst = max((r["max_mean_share"] or 0.0) for r in ours["rows"])
    share = ("a mixed fleet: shares should follow capacity, the 1.3 target is for like replicas" if mixed
             else f"target <= 1.3: {'met' if worst <= 1.3 else 'NOT met'}")  # unlike replicas get unlike shares
    out.append(f"- kvroute: {errors} errors over all rates (target 0); max/mean requests per replica at most "
               f"{worst:.2f} ({share}).")
    return out


def trace_reference(cfg: dict[str, Any], root: Path) -> float | None:
    """A replayed trace's ideal hit rate (``loadtest/trace.py``): the same prompts rendered with the replicas'
    tokenizer and template, on one LRU cache as large as the whole fleet's KV memory."""
    w = cfg["workload"]
    if w["kind"] != "trace":
        return None
    from router.tokenizer import LocalTokenizer

    from . import trace
    tok = LocalTokenizer(str(root))
    every = int(w.get("trace_sample", load.parser().get_default("trace_sample")))
    entries = trace.sample(trace.read(), every, int(cfg["requests_per_rate"]))
    gs = groups(cfg)
    capacity = sum(int(g["replicas"]) * int(g.get("num_gpu_blocks") or PROFILES[g["profile"]].num_gpu_blocks)
                   for g in gs)
    block = PROFILES[gs[0]["profile"]].block_size

    def ids(text: str) -> list[int]:
        return list(tok.chat_ids({"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}))
    return trace.reference(entries, trace.Texts(load.VOCABULARIES["tiny-model"]), ids, capacity, block)


def trace_verdicts(results: list[dict[str, Any]], ideal: float | None) -> list[str]:
    """On a replayed production trace, at each load: kvroute's hit rate against the ideal placement's, its output
    throughput against the best other router's, its TTFT p90 against the best other router's."""
    ours = next((r for r in results if r["router"] == "kvroute"), None)
    others = [r for r in results if not r["router"].startswith("kvroute") and not r.get("pinned")]
    if ours is None or not ideal:
        return []
    out = []
    for row in ours["rows"]:
        f = row["load_fraction"]
        theirs = [(_row_at(o, f), o["router"]) for o in others if _row_at(o, f)]
        hit = (row["hit_rate"] or 0.0) / ideal
        line = (f"- At {f:.0%} of saturation: kvroute keeps {hit:.2f} of the ideal hit rate ({row['hit_rate']} of "
                f"{ideal:.4f}; target >= 0.95: {'met' if hit >= 0.95 else 'NOT met'})")
        for r, name in theirs:
            line += f", {name} {(r['hit_rate'] or 0.0) / ideal:.2f}"
        if theirs:
            tput = max(theirs, key=lambda t: t[0]["output_tokens_per_s"])
            ttft = min(theirs, key=lambda t: t[0]["ttft_p90_ms"] or float("inf"))
            tr = row["output_tokens_per_s"] / tput[0]["output_tokens_per_s"]
            line += (f"; output throughput {tr:.3f}x the best other router's ({tput[1]}; target >= 1, 0.5% "
                     f"allowed for noise: {'met' if tr >= 0.995 else 'NOT met'})")
            if ttft[0]["ttft_p90_ms"] and row["ttft_p90_ms"]:
                p = row["ttft_p90_ms"] / ttft[0]["ttft_p90_ms"]
                line += (f"; TTFT p90 {p:.2f}x the best other router's ({ttft[1]}; target < 1: "
                         f"{'met' if p < 1 else 'NOT met'})")
        out.append(line + ".")
    return out


def split_verdicts(results: list[dict[str, Any]]) -> list[str]:
    """kvroute splitting requests against the same replicas taking them whole (kvroute-aggregated), at 70%."""
    ours = next((r for r in results if r["router"] == "kvroute"), None)
    whole = next((r for r in results if r["router"] == "kvroute-aggregated"), None)
    a, b = (_row_at(ours, 0.7) if ours else None), (_row_at(whole, 0.7) if whole else None)
    if not a or not b or not a.get("itl_p99_ms") or not b.get("itl_p99_ms") or not b["ttft_p90_ms"]:
        return []
    itl, ttft = a["itl_p99_ms"] / b["itl_p99_ms"], a["ttft_p90_ms"] / b["ttft_p90_ms"]
    return [f"- Split against whole on the same replicas at 70% of saturation: inter-token latency p99 "
            f"{a['itl_p99_ms']:.0f} against {b['itl_p99_ms']:.0f} ms, {itl:.2f}x (target <= 0.5: "
            f"{'met' if itl <= 0.5 else 'NOT met'}); TTFT p90 {a['ttft_p90_ms']:.0f} against {b['ttft_p90_ms']:.0f} ms, "
            f"{ttft:.2f}x (target <= 1.2: {'met' if ttft <= 1.2 else 'NOT met'})."]


def report(cfg: dict[str, Any], sat: float, results: list[dict[str, Any]], skipped: dict[str, str],
           ideal: float | None = None) -> str:
    w = cfg["workload"]
    lines = [f"#### Cluster benchmark: {cfg['name']}", "",
             f"{describe(cfg)}; `{w['kind']}` workload ({', '.join(f'{k} {v}' for k, v in w.items() if k != 'kind')}), "
             f"{cfg['requests_per_rate']} requests per rate; saturation measured at {sat:.2f} requests/s. "
             f"Reproduce: `python -m loadtest.cluster_bench --config {cfg['_path']}`.", ""]
    lines += ["| router | load | offered req/s | achieved req/s | output tok/s | TTFT p50 / p90 / p99 ms | "
              "ITL p50 / p99 ms | hit rate | max/mean share | errors |", "|" + "---|" * 10]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {res['router']} | {r['load_fraction']:.0%} | {r['offered_rate']:.2f} | "
                         f"{r['achieved_rps']:.2f} | {r['output_tokens_per_s']:.0f} | {r['ttft_p50_ms']} / "
                         f"{r['ttft_p90_ms']} / {r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r.get('itl_p99_ms')} | "
                         f"{r['hit_rate']} | {r['max_mean_share']} | {r['errors']} |")
    for name, why in skipped.items():
        lines.append(f"\nSkipped {name}: {why}.")
    if ideal is not None:
        lines.append(f"\nIdeal hit rate (the same prompts in arrival order on one LRU cache as large as the fleet's "
                     f"KV memory): {ideal:.4f}.")
    found = (verdicts(results, mixed=len(groups(cfg)) > 1, targets=cfg.get("targets")) + split_verdicts(results)
             + trace_verdicts(results, ideal))
    if found:
        lines += ["", "Targets:", ""] + found
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
            style = {"linestyle": "--", "color": "black"} if res.get("pinned") else {}  # the reference
            ax.plot(xs, ys, marker="o", label=res["router"], **style)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        if key == "ttft_p90_ms":
            ax.set_yscale("log")  # tens of milliseconds and tens of seconds on one plot
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(fname)
    return made


def update_readme(readme: Path, name: str, text: str, bench: str = "cluster-bench") -> None:
    """Replace the text between ``<!-- BENCH:NAME -->`` and ``<!-- /BENCH:NAME -->`` (appended to the file, markers
    and all, the first time)."""
    begin, end = f"<!-- {bench}:{name} -->", f"<!-- /{bench}:{name} -->"
    body = readme.read_text()
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in body and end in body:
        body = body[:body.index(begin)] + block + body[body.index(end) + len(end):]
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.cluster_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "loadtest" / "cluster_bench.yaml", help="the cluster, "
                   "workload, rates and routers (default: loadtest/cluster_bench.yaml; see also cluster_bench_*.yaml)")
    p.add_argument("--routers", type=Path, default=ROOT / "loadtest" / "routers.yaml", help="each router's command "
                   "(default: loadtest/routers.yaml)")
    p.add_argument("--only", action="append", help="only these routers (the flag repeated, or names separated by "
                   "commas); with a stored run of the same configuration in the output folder, they are added to it "
                   "(or replace their earlier rows) at its saturation")
    p.add_argument("--quick", action="store_true", help="a fifth of the groups and requests, three rates (to try "
                   "the set-up; docs/benchmarks.md is left alone)")
    p.add_argument("--out", type=Path, help="results here (default: loadtest/results/NAME); docs/benchmarks.md is updated "
                   "only with the default")
    args = p.parse_args(argv)
    # Each cluster and router runs in a session of its own; on SIGTERM, unwind so that they are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cfg = yaml.safe_load(args.config.read_text())
    path = args.config.resolve()
    cfg["_path"] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    specs = {name: RouterSpec.parse(name, entry) for name, entry in yaml.safe_load(args.routers.read_text()).items()}
    if args.only:
        args.only = [name for names in args.only for name in names.split(",") if name]
        unknown = [name for name in args.only if name not in cfg["routers"]]
        if unknown:
            p.error(f"--only: {', '.join(unknown)} not among this configuration's routers ({', '.join(cfg['routers'])})")
    if args.quick:
        w = cfg["workload"]
        for key in ("groups", "conversations", "warmup"):  # the warm-up is one prompt per group
            if key in w:
                w[key] = max(2, w[key] // 5)
        cfg["requests_per_rate"] = max(20, cfg["requests_per_rate"] // 5)
        cfg["rates"] = [0.2, 0.7, 1.0]
    out = args.out or ROOT / "loadtest" / "results" / cfg["name"]
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    root = write_tokenizer(logs / "tiny-model")
    started = time.monotonic()
    stored = out / "results.json"
    earlier: dict[str, Any] = json.loads(stored.read_text()) if args.only and stored.exists() else {}
    if earlier.get("config", {}).get("name") != cfg["name"]:
        earlier = {}
    if earlier:  # add these routers to a stored run: same saturation, so the same rates
        sat = float(earlier["saturation_rps"])
        sys.stderr.write(f"saturation: {sat:.2f} requests/s (from {stored})\n")
    else:
        sat = saturation(cfg, specs["kvroute"], logs, root)
        sys.stderr.write(f"saturation: {sat:.2f} requests/s\n")
    results, skipped = [], {}
    for name in cfg["routers"]:
        if args.only and name not in args.only:
            continue
        spec = specs.get(name)
        if spec is None:
            skipped[name] = "not in the routers file"
            continue
        missing = spec.installed()
        if missing:
            skipped[name] = f"`{missing}` is not installed (pip install '.[bench]')"
            continue
        sys.stderr.write(f"{name}:\n")
        try:
            results.append(run_router(spec, cfg, sat, logs, root))
        except RuntimeError as e:
            skipped[name] = str(e).splitlines()[0]
    if earlier:
        ran = {r["router"] for r in results} | set(skipped)
        kept = {r["router"]: r for r in earlier["results"] if r["router"] not in ran}
        kept.update({r["router"]: r for r in results})
        results = [kept[name] for name in cfg["routers"] if name in kept]
        skipped = {**{k: v for k, v in earlier.get("skipped", {}).items() if k not in kept}, **skipped}
    made = plots(results, out)
    ideal = trace_reference(cfg, root)
    text = report(cfg, sat, results, skipped, ideal)
    text += f"\nWall time: {time.monotonic() - started:.0f} s"
    text += f" (adding {', '.join(args.only)} to a stored run).\n" if earlier else ".\n"
    (out / "results.md").write_text(text + "".join(f"\n![{m}]({m})\n" for m in made))
    (out / "results.json").write_text(json.dumps({"config": cfg, "saturation_rps": sat, "results": results,
                                                  "skipped": skipped, "ideal_hit_rate": ideal}, indent=2))
    if not args.quick and args.out is None:
        rel = out.relative_to(ROOT)
        update_readme(ROOT / "docs" / "benchmarks.md", cfg["name"],
                      text + "".join(f"\n![{m}](../{rel / m})\n" for m in made))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
