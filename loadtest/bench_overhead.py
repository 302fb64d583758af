"""Latency the gateway adds over going straight to a replica, and its CPU cost per request.

    python -m loadtest.bench_overhead [--requests 4000] [--concurrency 32]

Starts one simulated replica and one router on 127.0.0.1, then sends the same requests to
both, in alternating rounds (so drift on a noisy machine hits both sides alike), streaming and
not. Reports p50/p99 of time to first byte (streams) and of total latency, the difference
router - direct, and the router's CPU seconds per 1000 requests (from /proc). A concurrency-1
pass shows the added time to first byte of a lone stream (where Nagle's algorithm would show).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .cluster import router, simulator
from .h1client import H1Connection


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_load(port: int, body: bytes, n: int, concurrency: int) -> tuple[list[float], list[float]]:
    ttfb: list[float] = []
    total: list[float] = []
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        conn = H1Connection("127.0.0.1", port)
        try:
            while remaining > 0:
                remaining -= 1
                res = await conn.post("/v1/completions", body)
                if res.status != 200:
                    raise RuntimeError(f"status {res.status}: {res.body[:200]!r}")
                ttfb.append(res.ttfb)
                total.append(res.total)
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfb, total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000, help="requests per mode and kind, over all rounds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=50)
    p.add_argument("--itl-ms", type=float, default=5)
    p.add_argument("--lone", type=int, default=300, help="requests of the concurrency-1 pass")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)

    logs = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    sim = simulator(None, "tiny", "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
                    "--max-num-seqs", "1024", log_dir=logs).start()
    rt = router([sim.url], log_dir=logs)
    try:
        sim.wait_http()
        rt.start()
        rt.wait_http("/ready", timeout=20)
        bodies = {
            "stream": json.dumps({"model": "tiny", "prompt": "hello " * 50, "max_tokens": args.max_tokens,
                                  "stream": True}).encode(),
            "plain": json.dumps({"model": "tiny", "prompt": "hello " * 50, "max_tokens": args.max_tokens}).encode(),
        }
        ports = {"direct": sim.port, "router": rt.port}
        for kind in bodies:  # warm up connections and code paths
            for mode in ports:
                asyncio.run(run_load(ports[mode], bodies[kind], 200, args.concurrency))

        samples: dict[tuple[str, str], dict[str, list[float]]] = {
            (m, k): {"ttfb": [], "total": []} for m in ports for k in bodies}
        router_cpu = 0.0
        router_requests = 0
        per_round = max(1, args.requests // args.rounds)
        for rnd in range(args.rounds):
            order = list(ports) if rnd % 2 == 0 else list(reversed(ports))
            for kind in bodies:
                for mode in order:
                    before = cpu_seconds(rt.pid)
                    ttfb, total = asyncio.run(run_load(ports[mode], bodies[kind], per_round, args.concurrency))
                    if mode == "router":
                        router_cpu += cpu_seconds(rt.pid) - before
                        router_requests += per_round
                    samples[(mode, kind)]["ttfb"] += ttfb
                    samples[(mode, kind)]["total"] += total

        lone = {m: asyncio.run(run_load(ports[m], bodies["stream"], args.lone, 1))[0] for m in ports}
    finally:
        rt.stop()
        sim.stop()

    report: dict[str, object] = {"concurrency": args.concurrency, "requests_per_cell": per_round * args.rounds,
                                 "max_tokens": args.max_tokens, "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms}
    lines = [f"concurrency {args.concurrency}, {per_round * args.rounds} requests per cell, "
             f"replica: ttft {args.ttft_ms:g} ms + {args.max_tokens} tokens x {args.itl_ms:g} ms",
             "| request | metric | direct p50 | router p50 | added p50 | direct p99 | router p99 | added p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in bodies:
        for metric in (("ttfb", "total") if kind == "stream" else ("total",)):
            d = samples[("direct", kind)][metric]
            r = samples[("router", kind)][metric]
            row = {q: (pct(d, q) * 1e3, pct(r, q) * 1e3) for q in (50, 99)}
            report[f"{kind}_{metric}"] = {f"p{q}": {"direct_ms": a, "router_ms": b, "added_ms": b - a}
                                          for q, (a, b) in row.items()}
            lines.append(f"| {kind} | {metric} | {row[50][0]:.2f} ms | {row[50][1]:.2f} ms | "
                         f"{row[50][1] - row[50][0]:+.2f} ms | {row[99][0]:.2f} ms | {row[99][1]:.2f} ms | "
                         f"{row[99][1] - row[99][0]:+.2f} ms |")
    cpu_per_1000 = router_cpu / router_requests * 1000
    lone_added = (statistics.median(lone["router"]) - statistics.median(lone["direct"])) * 1e3
    report["router_cpu_s_per_1000_requests"] = cpu_per_1000
    report["lone_stream_ttfb_ms"] = {"direct": statistics.median(lone["direct"]) * 1e3,
                                     "router": statistics.median(lone["router"]) * 1e3, "added": lone_added}
    lines.append(f"router CPU: {cpu_per_1000:.2f} s per 1000 requests (streaming and not, mixed)")
    lines.append(f"concurrency 1, stream time to first byte, median: direct "
                 f"{report['lone_stream_ttfb_ms']['direct']:.2f} ms, router "
                 f"{report['lone_stream_ttfb_ms']['router']:.2f} ms, added {lone_added:+.2f} ms")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
