"""What a large fleet costs a router: CPU per request, decision time, idle CPU, memory, time to ready.

    python -m loadtest.bench_fleet [--sizes 8,64,256,1024] [--routers kvroute,kvroute-redis-4,sglang-router]
                                   [--requests 2000] [--concurrency 16] [--settle-s 12] [--idle-s 20] [--rounds 1]
                                   [--set FIELD=VALUE]

For each fleet size one simulator process hosts N instant replicas (``--ttft-ms 0 --itl-ms 0``) on
consecutive ports, serving the tiny model's tokenizer as their root, as a new user would set them up.
Each router is started in front of them with nothing but the replica list (kvroute: a YAML file of
their URLs); ``kvroute-redis`` adds a Redis index (a redis-server started for it), ``kvroute-redis-4`` runs
four instances on one Redis, sharing their index and load, with the client's connections spread over
them; ``kvroute-cluster`` and ``kvroute-cluster-4`` the same on a Redis Cluster (3 masters, 3 replicas,
started for it). The run measures, router by router, on the same request sequence:

- time until the router reports every replica ready (kvroute's ``/ready`` count; other routers: their
  first answered request; with four instances, until the last one is);
- idle CPU: the router's CPU over ``--idle-s`` seconds with no traffic, from ``--settle-s`` seconds after it
  was ready (kvroute measures what its checks cost in its first 10 s and keeps to its budget after), as a
  share of one core (per instance);
- the load: ``--requests`` non-streaming completions of ~1,000-token prompts from 64 prefix groups at
  ``--concurrency`` (``--prompt-tokens``, ``--shared-tokens`` and ``--groups`` change them: 12,000-token
  prompts sharing their first 11,000 with earlier ones are ``--prompt-tokens 12000 --shared-tokens 11000``), sent over kept-alive connections; router CPU seconds per 1,000 requests (from
  /proc, all instances together), client latency p50/p99, the router's RSS after the run (the largest
  instance), and kvroute's own decision time (``kvroute_decision_seconds``, of the first instance) p50/p99.

Writes ``loadtest/results/fleet/results.json`` and ``results.md`` (``--out`` changes the folder).
Every process it starts is stopped by its PID at the end; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench_overhead import pct, tree_cpu_seconds
from .cluster import HTTP, Proc, RedisCluster, free_port, free_ports, redis_server, simulator, wait_redis
from .h1client import H1Connection
from .load import VOCABULARIES, words
from .tiny_model import write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def workload(n: int, groups: int = 64, system_tokens: int = 960, question_tokens: int = 40,
             seed: int = 0) -> list[bytes]:
    """``n`` completions bodies: ``groups`` shared heads of ~``system_tokens``, each with its own question of
    ~``question_tokens``."""
    rng = random.Random(seed)
    vocab = VOCABULARIES["tiny-model"]
    heads = [words(rng, system_tokens, vocab) for _ in range(groups)]
    out = []
    for _ in range(n):
        g = rng.randrange(groups)
        out.append(json.dumps({"model": MODEL, "prompt": heads[g] + words(rng, question_tokens, vocab),
                               "max_tokens": 4, "stream": False}).encode())
    return out


async def drive(ports: list[int], bodies: list[bytes], concurrency: int) -> tuple[list[float], int]:
    """Send every body, ``concurrency`` at a time over kept-alive connections spread over the routers' ``ports``:
    latencies and failures."""
    latencies: list[float] = []
    failed = 0
    queue = list(reversed(bodies))
    conns = [H1Connection("127.0.0.1", ports[i % len(ports)]) for i in range(concurrency)]

    async def worker(conn: H1Connection) -> None:
        nonlocal failed
        while queue:
            body = queue.pop()
            try:
                res = await asyncio.wait_for(conn.post("/v1/completions", body), 60)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                failed += 1
                await conn.close()
                continue
            if res.status != 200:
                failed += 1
            latencies.append(res.total)

    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    return latencies, failed


def kvroute_config(path: Path, urls: list[str], port: int, extra: dict[str, Any]) -> None:
    lines = [f"port: {port}", "replicas:"]
    lines += [f"  - name: r{i}\n    url: {u}" for i, u in enumerate(urls)]
    for key, value in extra.items():
        lines.append(f"{key}: {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")


def start_router(kind: str, urls: list[str], logs: Path, redis: str | None = None,
                 settings: list[str] | None = None) -> Proc:
    port = free_port()
    if kind == "kvroute":
        cfg = logs / f"kvroute-{len(urls)}-{port}.yaml"
        kvroute_config(cfg, urls, port, {})
        argv = [sys.executable, "-m", "router", "serve", "--config", str(cfg)]
        if redis:
            argv += ["--index", redis]
        for setting in settings or []:
            argv += ["--set", setting]
    elif kind in ("sglang-router", "vllm-router"):
        exe = shutil.which(kind) or str(Path(sys.executable).parent / kind)
        argv = [exe, "launch"] if kind == "sglang-router" else [exe]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                 "--prometheus-port", str(free_port()), "--worker-urls", *urls]
    else:
        raise ValueError(f"unknown router {kind!r}")
    return Proc(f"{kind}-{len(urls)}", argv, port, log_path=logs / f"{kind}-{len(urls)}-{port}.log").start()


def wait_ready(proc: Proc, kind: str, n: int, timeout: float, probe: bytes) -> float:
    """Seconds from start until the router routes to all ``n`` replicas (kvroute) or answers (others)."""
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        if proc.popen is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited: {proc.log_tail()}")
        try:
            if kind == "kvroute":
                r = HTTP.get(proc.url + "/ready", timeout=2.0)
                if r.status_code == 200 and r.json().get("ready_replicas") == n:
                    return time.monotonic() - started
            else:
                r = HTTP.post(proc.url + "/v1/completions", content=probe,
                              headers={"content-type": "application/json"}, timeout=5.0)
                if r.status_code == 200:
                    return time.monotonic() - started
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name}: not every replica ready in {timeout:.0f} s")


def decision_quantiles(proc: Proc) -> tuple[float | None, float | None]:
    """p50 and p99 of ``kvroute_decision_seconds`` (upper bucket bounds), from the router's /metrics."""
    try:
        text = HTTP.get(proc.url + "/metrics", timeout=5.0).text
    except Exception:
        return None, None
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith("kvroute_decision_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None, None
    total = buckets[-1][1]

    def q(share: float) -> float:
        return next(le for le, count in buckets if count >= share * total)
    return q(0.5), q(0.99)


# What each name in --routers runs: (router, instances, shared Redis index)
# setup -> (router, instances, shared store: None, "redis" or "redis-cluster")
SETUPS: dict[str, tuple[str, int, str | None]] = {
    "kvroute": ("kvroute", 1, None),
    "kvroute-redis": ("kvroute", 1, "redis"),
    "kvroute-redis-4": ("kvroute", 4, "redis"),
    "kvroute-cluster": ("kvroute", 1, "redis-cluster"),
    "kvroute-cluster-4": ("kvroute", 4, "redis-cluster"),
    "sglang-router": ("sglang-router", 1, None),
    "vllm-router": ("vllm-router", 1, None),
}


def measure(setup: str, urls: list[str], bodies: list[bytes], args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    kind, instances, shared = SETUPS[setup]
    redis: Proc | None = None
    cluster: RedisCluster | None = None
    store: str | None = None
    procs: list[Proc] = []
    try:
        if shared == "redis":
            redis = redis_server(log_dir=logs).start()
            wait_redis(redis)
            store = f"redis://127.0.0.1:{redis.port}/0"
        elif shared == "redis-cluster":
            work = logs / f"cluster-{setup}-{len(urls)}"
            work.mkdir()
            cluster = RedisCluster(work).start()
            store = cluster.url
        started = time.monotonic()
        procs = [start_router(kind, urls, logs, store, args.set) for _ in range(instances)]
        for proc in procs:
            wait_ready(proc, kind, len(urls), args.ready_timeout_s, bodies[0])
        ready_s = time.monotonic() - started
        time.sleep(args.settle_s)  # the first health round's stragglers; kvroute's control budget measured

        def cpu() -> float:
            return sum(tree_cpu_seconds(p.pid) for p in procs)
        cpu0 = cpu()
        time.sleep(args.idle_s)
        idle = (cpu() - cpu0) / args.idle_s / instances
        ports = [p.port for p in procs]
        asyncio.run(drive(ports, bodies[: args.concurrency * 4], args.concurrency))  # connections, caches
        cpu0 = cpu()
        t0 = time.monotonic()
        latencies, failed = asyncio.run(drive(ports, bodies, args.concurrency))
        wall = time.monotonic() - t0
        used = cpu() - cpu0
        d50, d99 = decision_quantiles(procs[0]) if kind == "kvroute" else (None, None)
        return {"router": setup, "replicas": len(urls), "ready_s": round(ready_s, 2), "idle_cpu": round(idle, 4),
                "cpu_per_1000_s": round(used / len(bodies) * 1000, 3), "requests_per_s": round(len(bodies) / wall, 1),
                "p50_ms": round(pct(latencies, 50) * 1000, 2), "p99_ms": round(pct(latencies, 99) * 1000, 2),
                "failed": failed, "rss_mb": round(max(rss_mb(p.pid) for p in procs), 1),
                "decision_p50_ms": None if d50 is None else d50 * 1000,
                "decision_p99_ms": None if d99 is None else d99 * 1000}
    finally:
        for proc in procs:
            proc.stop()
        if redis is not None:
            redis.stop()
        if cluster is not None:
            cluster.stop()


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    out = ["# Fleet benchmark", "", f"Command: `{command}`", "", f"Run {time.strftime('%Y-%m-%d %H:%M')}", "",
           "| router | replicas | ready (s) | idle CPU | CPU per 1000 (s) | req/s | p50 (ms) | p99 (ms) | "
           "decision p50/p99 (ms) | RSS (MB) | failed |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dec = "-" if r["decision_p50_ms"] is None else f"{r['decision_p50_ms']:g} / {r['decision_p99_ms']:g}"
        out.append(f"| {r['router']} | {r['replicas']} | {r['ready_s']} | {r['idle_cpu'] * 100:.1f}% | "
                   f"{r['cpu_per_1000_s']} | {r['requests_per_s']} | {r['p50_ms']} | {r['p99_ms']} | {dec} | "
                   f"{r['rss_mb']} | {r['failed']} |")
    if max((r.get("round", 1) for r in rows), default=1) > 1:
        out += ["", *medians(rows)]
    return "\n".join(out) + "\n"


def medians(rows: list[dict[str, Any]]) -> list[str]:
    """Each router's medians per fleet size over the rounds, and its CPU per request at the largest size over that at
    the smallest, round by round (with their median: the figure least moved by the machine's drift) and of the
    medians."""
    out = ["Medians over the rounds:", "",
           "| router | replicas | rounds | idle CPU | CPU per 1000 (s) |", "|---|---|---|---|---|"]
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["router"], r["replicas"]), []).append(r)
    for (router, n), runs in by.items():
        out.append(f"| {router} | {n} | {len(runs)} | {statistics.median(r['idle_cpu'] for r in runs) * 100:.1f}% | "
                   f"{statistics.median(r['cpu_per_1000_s'] for r in runs):.3f} |")
    out.append("")
    for router in dict.fromkeys(r["router"] for r in rows):
        sizes = sorted({n for (name, n) in by if name == router})
        if len(sizes) < 2:
            continue
        small, large = by[(router, sizes[0])], by[(router, sizes[-1])]
        pairs = [b["cpu_per_1000_s"] / a["cpu_per_1000_s"] for a, b in zip(small, large) if a["cpu_per_1000_s"]]
        med = statistics.median(r["cpu_per_1000_s"] for r in large) / statistics.median(
            r["cpu_per_1000_s"] for r in small)
        out.append(f"- {router}: CPU per request at {sizes[-1]} replicas over that at {sizes[0]}: "
                   f"{' / '.join(f'{x:.2f}' for x in pairs)} round by round (median {statistics.median(pairs):.2f}: "
                   f"each round's two sizes ran within a minute of each other), {med:.2f} of the medians.")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,1024", help="fleet sizes, comma-separated")
    p.add_argument("--routers", default="kvroute,kvroute-redis-4,sglang-router",
                   help="routers, comma-separated: " + ", ".join(SETUPS) + " (-4: four instances on one Redis, the "
                   "requests spread over them)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt (about)")
    p.add_argument("--shared-tokens", type=int, default=960,
                   help="of those, the head each prefix group shares (the rest is the request's own)")
    p.add_argument("--groups", type=int, default=64, help="prefix groups")
    p.add_argument("--settle-s", type=float, default=12.0,
                   help="seconds between ready and the idle CPU measurement (kvroute's control budget is measured "
                        "in its first 10 s)")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of idle CPU measurement")
    p.add_argument("--ready-timeout-s", type=float, default=120.0)
    p.add_argument("--rounds", type=int, default=1, help="measure every router and size this many times, the sizes "
                   "in turn (8, 1024, 8, 1024, ...), and report each one's medians: this machine's speed drifts "
                   "by tens of percent within minutes")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a kvroute setting (kvroute serve --set), e.g. health.max_requests_per_s=200")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "fleet")
    args = p.parse_args(argv)
    if not 0 < args.shared_tokens < args.prompt_tokens:
        p.error("--shared-tokens must be between 0 and --prompt-tokens")
    bodies = workload(args.requests, args.groups, args.shared_tokens, args.prompt_tokens - args.shared_tokens)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-fleet-") as tmp:
        logs = Path(tmp)
        root = write_tokenizer(logs / "tiny-model")
        sims: list[Proc] = []
        fleets: list[list[str]] = []
        try:
            for n in [int(s) for s in args.sizes.split(",")]:  # every fleet up at once: rounds alternate sizes
                base = free_ports(n)
                sims.append(simulator(base, MODEL, "--replicas", str(n), "--ttft-ms", "0", "--itl-ms", "0",
                                      "--root", str(root), log_dir=logs, name=f"sim-{n}").start())
                deadline = time.monotonic() + 60
                for i in (0, n - 1):
                    s = Proc("sim", [], base + i)
                    s.wait_http(timeout=max(1.0, deadline - time.monotonic()))
                fleets.append([f"http://127.0.0.1:{base + i}" for i in range(n)])
            setups = []
            for setup in args.routers.split(","):
                kind = SETUPS[setup][0]
                if kind != "kvroute" and not (shutil.which(kind) or (Path(sys.executable).parent / kind).exists()):
                    print(f"{kind}: not installed (pip install '.[bench]'), skipped", file=sys.stderr)
                else:
                    setups.append(setup)
            for round_ in range(1, args.rounds + 1):
                for urls in fleets:
                    for setup in setups:
                        row = measure(setup, urls, bodies, args, logs)
                        row["round"] = round_
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            for sim in sims:
                sim.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    command = "python -m loadtest.bench_fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "results.md").write_text(markdown(rows, command.strip()))
    print(markdown(rows, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
