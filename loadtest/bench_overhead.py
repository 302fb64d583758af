"""Latency the gateway adds over going straight to a replica, and its CPU cost per request.

    python -m loadtest.bench_overhead [--requests 4096] [--concurrency 32]
    python -m loadtest.bench_overhead --instant [--instant-requests 20000]

Starts one simulated replica and one router on 127.0.0.1 and sends the same requests to both
over kept-alive client connections, in blocks that alternate direct/router (so drift on a noisy
machine hits both sides alike), streaming and not. The router gets a core of its own, as it
would in a deployment; the replica and this load generator share the other. Reports p50/p99 of
time to first byte (streams) and of whole-response latency, router minus direct, and the
router's CPU seconds per 1000 requests (from /proc). Two more passes: a lone stream at
concurrency 1 (where Nagle's algorithm would show as ~40 ms), and a burst of new clients after
the router sat idle (new upstream connections).

``--instant`` measures the router where it is the bottleneck instead: an instant replica
(:mod:`loadtest.instant`, captured vLLM bytes, tens of microseconds per request) behind the router,
non-streaming requests with 8000-character prompts at concurrency 32, for the least-loaded and
cache-aware policies with 1 and 2 worker processes (2 workers with a cache-aware policy share a
local redis-server), then streams of the captured 6 completion events with ``proxy.stream_failover`` on (the default:
the router reads every event it relays, to continue a broken stream elsewhere) and off. It reports requests
per second, the router's CPU seconds per 1000 requests
(parent and workers), and latency; with one worker the router has a core of its own, with two they
share both cores with the replica and the load generator. Then the streaming relay: paced streams
(the simulated replica, 16 events 5 ms apart) direct and through the router, events per second each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from .cluster import Proc, free_port, redis_server, router, simulator, wait_redis
from .h1client import H1Connection


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_load(port: int, body: bytes, n: int, concurrency: int,
                   conns: list[H1Connection] | None = None) -> tuple[list[float], list[float]]:
    """Send ``n`` requests over ``concurrency`` connections (kept open if ``conns`` is given)."""
    ttfb: list[float] = []
    total: list[float] = []
    remaining = n
    own = conns is None
    pool = conns if conns is not None else [H1Connection("127.0.0.1", port) for _ in range(concurrency)]

    async def worker(conn: H1Connection) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            res = await conn.post("/v1/completions", body)
            if res.status != 200:
                raise RuntimeError(f"status {res.status}: {res.body[:200]!r}")
            ttfb.append(res.ttfb)
            total.append(res.total)

    try:
        await asyncio.gather(*(worker(c) for c in pool[:concurrency]))
    finally:
        if own:
            for c in pool:
                await c.close()
    return ttfb, total


def _pin(proc_argv: list[str], cpu: int | str | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *proc_argv] if cpu is not None else proc_argv


async def measure(args: argparse.Namespace, ports: dict[str, int], router_pid: int,
                  bodies: dict[str, bytes]) -> dict[str, object]:
    conns = {m: [H1Connection("127.0.0.1", p) for _ in range(args.concurrency)] for m, p in ports.items()}
    samples: dict[tuple[str, str], dict[str, list[float]]] = {
        (m, k): {"ttfb": [], "total": []} for m in ports for k in bodies}
    for kind in bodies:  # warm up connections and code paths
        for mode in ports:
            await run_load(ports[mode], bodies[kind], 4 * args.concurrency, args.concurrency, conns[mode])
    router_cpu = 0.0
    router_requests = 0
    blocks = max(1, args.requests // args.block)
    for i in range(blocks):
        order = list(ports) if i % 2 == 0 else list(reversed(ports))
        for kind in bodies:
            for mode in order:
                before = cpu_seconds(router_pid)
                ttfb, total = await run_load(ports[mode], bodies[kind], args.block, args.concurrency, conns[mode])
                if mode == "router":
                    router_cpu += cpu_seconds(router_pid) - before
                    router_requests += args.block
                samples[(mode, kind)]["ttfb"] += ttfb
                samples[(mode, kind)]["total"] += total
    for mode in ports:
        for c in conns[mode]:
            await c.close()
    # A burst of new clients after the router sat idle longer than proxy.upstream_idle_s: both the
    # client connections and the router's upstream connections are new.
    cold: dict[str, list[float]] = {}
    for mode in ports:
        await asyncio.sleep(args.idle_before_burst)
        cold[mode] = (await run_load(ports[mode], bodies["stream"], args.concurrency, args.concurrency))[0]
    lone_conns = {m: [H1Connection("127.0.0.1", p)] for m, p in ports.items()}
    lone: dict[str, list[float]] = {m: [] for m in ports}
    for i in range(args.lone // 20):  # blocks of 20 (~3 s): shorter than the replica's 5 s keep-alive
        for mode in (list(ports) if i % 2 == 0 else list(reversed(ports))):
            lone[mode] += (await run_load(ports[mode], bodies["stream"], 20, 1, lone_conns[mode]))[0]
    for mode in ports:
        await lone_conns[mode][0].close()
    return {"samples": samples, "cpu": router_cpu, "router_requests": router_requests, "cold": cold, "lone": lone}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the workers)."""
    total = cpu_seconds(pid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid:
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return total


def instant(args: argparse.Namespace) -> int:
    """The router as the bottleneck: requests/s and CPU per request against an instant replica."""
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    logs = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    port = free_port()
    replica = Proc("instant", [sys.executable, "-m", "loadtest.instant", "--port", str(port)], port,
                   log_path=logs / "instant.log")
    replica.argv = _pin(replica.argv, 0 if pin else None)
    redis = redis_server(log_dir=logs)
    body = json.dumps({"model": "tiny", "prompt": ("The quick brown fox jumps over the lazy dog. " * 178)[:8000],
                       "max_tokens": 16}).encode()
    rows = []
    try:
        replica.start()
        replica.wait_http()
        redis.start()
        wait_redis(redis)
        direct = asyncio.run(_throughput(port, body, args.instant_requests, args.concurrency))
        rows.append(("direct (the instant replica alone)", "-", direct, None))
        runs: list[tuple[str, int, list[str], bytes]] = []
        for workers in args.workers:
            for policy in ("least-loaded", "cache-aware"):
                extra = ["--policy", policy]
                if workers > 1 and policy == "cache-aware":
                    extra += ["--index", f"redis://127.0.0.1:{redis.port}/0"]
                runs.append((policy, workers, extra, body))
        # Streams: what reading each event for a possible mid-stream failover costs, beside the relay alone
        streamed = json.dumps({"model": "tiny", "prompt": ("The quick brown fox jumps over the lazy dog. " * 89)[:4000],
                               "max_tokens": 16, "stream": True}).encode()
        runs += [("cache-aware, streams (6 events)", 1, ["--policy", "cache-aware"], streamed),
                 ("cache-aware, streams, stream_failover off", 1,
                  ["--policy", "cache-aware", "--set", "proxy.stream_failover=false"], streamed)]
        for label, workers, extra, request in runs:
            extra = [*extra, "--set", "queue.max_size=4096"] + (["--workers", str(workers)] if workers > 1 else [])
            rt = router([replica.url], *extra, log_dir=logs)
            rt.argv = _pin(rt.argv, (1 if workers == 1 else "0,1") if pin else None)
            try:
                rt.start()
                rt.wait_http("/ready", timeout=20)
                asyncio.run(_throughput(rt.port, request, 2000, args.concurrency))  # warm up
                before = tree_cpu_seconds(rt.pid)
                res = asyncio.run(_throughput(rt.port, request, args.instant_requests, args.concurrency))
                cpu = tree_cpu_seconds(rt.pid) - before
            finally:
                rt.stop()
            rows.append((label, str(workers), res, cpu / args.instant_requests * 1000))
        stream = _paced_streams(args, logs, pin)
    finally:
        replica.stop()
        redis.stop()
    lines = [f"instant replica, non-streaming, 8000-character prompts, concurrency {args.concurrency}, "
             f"{args.instant_requests} requests per row; "
             + ("1 worker on a core of its own, 2 workers unpinned" if pin else "no CPU pinning"), "",
             "| policy | workers | requests/s | router CPU per 1000 requests | p50 | p99 |",
             "|---|---|---|---|---|---|"]
    report: dict[str, object] = {"rows": []}
    for policy, workers, res, cpu in rows:
        lines.append(f"| {policy} | {workers} | {res['rps']:.0f} | {'-' if cpu is None else f'{cpu:.3f} s'} | "
                     f"{res['p50'] * 1e3:.2f} ms | {res['p99'] * 1e3:.2f} ms |")
        report["rows"].append({"policy": policy, "workers": workers, "cpu_s_per_1000": cpu, **res})  # type: ignore[union-attr]
    lines += ["", f"- streaming relay, {stream['concurrency']} paced streams of {stream['events']} events: "
              f"direct {stream['direct']:.0f} events/s, router {stream['router']:.0f} events/s "
              f"({stream['router'] / stream['direct']:.3f}x)"]
    report["stream"] = stream
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


async def _throughput(port: int, body: bytes, n: int, concurrency: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    _, total = await run_load(port, body, n, concurrency)
    elapsed = loop.time() - started
    return {"rps": n / elapsed, "p50": pct(total, 50), "p99": pct(total, 99)}


def _paced_streams(args: argparse.Namespace, logs: Path, pin: bool) -> dict[str, float]:
    """Events per second that paced streams deliver, straight from a replica and through the router."""
    sim = simulator(None, "tiny", "--ttft-ms", "5", "--itl-ms", "5", "--max-num-seqs", "1024", log_dir=logs)
    rt = router([sim.url], log_dir=logs)
    rt.argv = _pin(rt.argv, 1 if pin else None)
    events = 16
    body = json.dumps({"model": "tiny", "prompt": "hello " * 50, "max_tokens": events, "stream": True}).encode()
    out: dict[str, float] = {"concurrency": args.concurrency, "events": events + 1}
    try:
        sim.start()
        sim.wait_http()
        rt.start()
        rt.wait_http("/ready", timeout=20)
        for mode, port in (("direct", sim.port), ("router", rt.port), ("direct", sim.port), ("router", rt.port)):
            res = asyncio.run(_throughput(port, body, 32 * args.concurrency, args.concurrency))
            out[mode] = max(out.get(mode, 0.0), res["rps"] * (events + 1))
    finally:
        rt.stop()
        sim.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4096, help="requests per mode and kind")
    p.add_argument("--block", type=int, default=256, help="requests per block; blocks alternate direct/router")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=50)
    p.add_argument("--itl-ms", type=float, default=5)
    p.add_argument("--lone", type=int, default=400, help="requests of the concurrency-1 pass")
    p.add_argument("--idle-before-burst", type=float, default=6.0)
    p.add_argument("--no-pin", action="store_true",
                   help="do not give the router a core of its own (by default: router on CPU 1, the rest on CPU 0)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("--instant", action="store_true",
                   help="measure requests/s and CPU per request against an instant replica instead (see above)")
    p.add_argument("--instant-requests", type=int, default=20000, help="requests per row of --instant")
    p.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                   help="worker counts for --instant, comma-separated (default 1,2)")
    args = p.parse_args(argv)
    if args.instant:
        return instant(args)

    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    logs = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    sim = simulator(None, "tiny", "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
                    "--max-num-seqs", "1024", log_dir=logs)
    rt = router([sim.url], log_dir=logs)
    sim.argv = _pin(sim.argv, 0 if pin else None)
    rt.argv = _pin(rt.argv, 1 if pin else None)
    try:
        sim.start()
        sim.wait_http()
        rt.start()
        rt.wait_http("/ready", timeout=20)
        bodies = {
            "stream": json.dumps({"model": "tiny", "prompt": "hello " * 50, "max_tokens": args.max_tokens,
                                  "stream": True}).encode(),
            "plain": json.dumps({"model": "tiny", "prompt": "hello " * 50, "max_tokens": args.max_tokens}).encode(),
        }
        ports = {"direct": sim.port, "router": rt.port}
        res = asyncio.run(measure(args, ports, rt.pid, bodies))
    finally:
        rt.stop()
        sim.stop()

    samples = res["samples"]
    n = len(samples[("router", "stream")]["ttfb"])
    report: dict[str, object] = {"concurrency": args.concurrency, "requests_per_cell": n, "pinned": pin,
                                 "max_tokens": args.max_tokens, "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms}
    lines = [f"concurrency {args.concurrency}, {n} requests per cell in blocks of {args.block} alternating "
             f"direct/router, replica: ttft {args.ttft_ms:g} ms + {args.max_tokens} tokens x {args.itl_ms:g} ms, "
             + ("router on its own core" if pin else "no CPU pinning"),
             "",
             "| request | metric | direct p50 | router p50 | added p50 | direct p99 | router p99 | added p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in bodies:
        for metric in (("ttfb", "total") if kind == "stream" else ("total",)):
            d = samples[("direct", kind)][metric]
            r = samples[("router", kind)][metric]
            row = {q: (pct(d, q) * 1e3, pct(r, q) * 1e3) for q in (50, 99)}
            report[f"{kind}_{metric}"] = {f"p{q}": {"direct_ms": a, "router_ms": b, "added_ms": b - a}
                                          for q, (a, b) in row.items()}
            name = {"ttfb": "time to first byte", "total": "whole response"}[metric]
            lines.append(f"| {'streaming' if kind == 'stream' else 'non-streaming'} | {name} | {row[50][0]:.2f} ms "
                         f"| {row[50][1]:.2f} ms | {row[50][1] - row[50][0]:+.2f} ms | {row[99][0]:.2f} ms | "
                         f"{row[99][1]:.2f} ms | {row[99][1] - row[99][0]:+.2f} ms |")
    cpu_per_1000 = res["cpu"] / res["router_requests"] * 1000
    report["router_cpu_s_per_1000_requests"] = cpu_per_1000
    lone, cold = res["lone"], res["cold"]
    med = {m: statistics.median(v) * 1e3 for m, v in lone.items()}
    report["lone_stream_ttfb_ms"] = {**med, "added": med["router"] - med["direct"]}
    cmed = {m: statistics.median(v) * 1e3 for m, v in cold.items()}
    report["cold_burst_ttfb_ms"] = {**cmed, "added": cmed["router"] - cmed["direct"]}
    lines += ["",
              f"- router CPU: {cpu_per_1000:.2f} s per 1000 requests (half streaming, half not)",
              f"- concurrency 1, streaming time to first byte, median: direct {med['direct']:.2f} ms, "
              f"router {med['router']:.2f} ms, added {med['router'] - med['direct']:+.2f} ms",
              f"- burst of {args.concurrency} new clients after {args.idle_before_burst:g} s idle (new upstream "
              f"connections too), time to first byte, median: direct {cmed['direct']:.2f} ms, router "
              f"{cmed['router']:.2f} ms, added {cmed['router'] - cmed['direct']:+.2f} ms"]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
