"""KV-cache event ingestion: how fast the router applies a replica's events, and how late.

    python -m loadtest.bench_events [--blocks 200000] [--rate 10000] [--seconds 10]

1. Throughput: synthetic vLLM batches (``BlockStored`` chains of 16-token blocks, each continuing
   the previous chain up to 64 blocks, and ``BlockRemoved`` for the oldest blocks once the replica
   holds 16,384) encoded as vLLM 0.32 encodes them, decoded and applied in one process, into the
   memory index and into the Redis index (a real ``redis-server``; with the lease holder's map and
   position writes). Reported per core of the router process (its CPU time), with Redis's own CPU
   time beside it.
2. Lag at a steady rate: a stand-in replica publishes ``--rate`` blocks/s over ZMQ (``POST
   /sim/kv_flood``) to a real router, memory and Redis index in turn; the router's ``/admin``
   reports the lag from each batch's timestamp to the batch applied (p50, p99 over the last 1,024
   batches) and the batches it applied, against those published.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from router.index.fallback import FallbackIndex
from router.index.memory import MemoryIndex
from router.index.tiered import TieredIndex
from router.index.redis import RedisIndex
from router.store import Redis, Store
from router.config import IndexConfig
from router.kv_events.decode import DecodeStats, decode_frames
from router.kv_events.lease import Lease
from router.metrics import Metrics

from .cluster import redis_server, router, simulator, wait_redis
from .tiny_model import write_tokenizer

BLOCK = 16
CHAIN = 64
CAPACITY = 16_384


def synthetic_payloads(blocks: int, blocks_per_event: int = 16, events_per_batch: int = 4,
                       seed: int = 0) -> list[list[bytes]]:
    """Live messages (topic, seq, payload) carrying about ``blocks`` stored blocks and the removals that
    keep the replica at ``CAPACITY`` blocks."""
    rng = random.Random(seed)
    held: list[int] = []
    out = []
    parent: int | None = None
    depth = 0
    made = 0
    seq = 0
    while made < blocks:
        events: list[dict[str, Any]] = []
        for _ in range(events_per_batch):
            if depth >= CHAIN:
                parent, depth = None, 0
            hashes = [rng.getrandbits(64) for _ in range(blocks_per_event)]
            tokens = [rng.randrange(1024) for _ in range(blocks_per_event * BLOCK)]
            events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                           "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
                           "kv_cache_spec_kind": "full_attention"})
            held += hashes
            parent, depth = hashes[-1], depth + len(hashes)
            made += len(hashes)
            if len(held) > CAPACITY:
                gone, held = held[:len(held) - CAPACITY], held[len(held) - CAPACITY:]
                events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU", "group_idx": 0})
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        out.append([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _redis_cpu(info: str) -> float:
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return float(fields["used_cpu_sys"]) + float(fields["used_cpu_user"])


async def _ingest(index: TieredIndex, messages: list[list[bytes]], lease: Lease | None) -> tuple[float, float, int]:
    """Decode and apply every message; returns (seconds, router CPU seconds, blocks stored)."""
    stats = DecodeStats()
    stored = 0
    if lease is not None:
        await lease.acquire("r")
    t0, c0 = time.perf_counter(), _cpu()
    for frames in messages:
        batch = decode_frames(frames, stats)
        assert batch is not None
        applied = await index.apply_batch("r", 0, batch, lambda _r, _l: "m", CAPACITY)
        stored += applied.stored
        if lease is not None:
            changed, gone = index.source("r", 0).take_changes()
            await lease.save("r", 0, batch.seq, batch.ts, changed, gone)
    return time.perf_counter() - t0, _cpu() - c0, stored


async def throughput(blocks: int, redis_url: str | None) -> list[dict[str, Any]]:
    messages = synthetic_payloads(blocks)
    rows = []
    mem = TieredIndex(MemoryIndex())
    secs, cpu, stored = await _ingest(mem, messages, None)
    rows.append({"index": "memory", "blocks": stored, "seconds": secs, "router_cpu_s": cpu,
                 "blocks_per_s": stored / secs, "blocks_per_cpu_s": stored / cpu})
    await mem.close()
    if redis_url:
        store = Store(redis_url, "bench")
        shared = RedisIndex(store, timeout_s=1.0)
        cfg = IndexConfig(backend=redis_url, timeout_s=1.0)
        index = TieredIndex(FallbackIndex(shared, MemoryIndex(), cfg, Metrics()))
        await shared.start()
        admin = Redis(redis_url)
        lease = Lease(store, 30.0)
        for with_lease in (False, True):
            await admin.execute("FLUSHALL")
            index.drop_sources("r")
            before = _redis_cpu((await admin.execute("INFO", "cpu")).decode())
            secs, cpu, stored = await _ingest(index, messages, lease if with_lease else None)
            redis_cpu = _redis_cpu((await admin.execute("INFO", "cpu")).decode()) - before
            rows.append({"index": "redis" + (" + lease writes" if with_lease else ""), "blocks": stored,
                         "seconds": secs, "router_cpu_s": cpu, "redis_cpu_s": redis_cpu,
                         "blocks_per_s": stored / secs, "blocks_per_cpu_s": stored / cpu})
        await lease.close()
        await admin.close()
        await index.close()
        await store.close()
    return rows


def lag(rate: int, seconds: float, redis_url: str | None, log_dir: Path) -> list[dict[str, Any]]:
    root = write_tokenizer(log_dir / "tiny")
    rows = []
    for backend in ["memory"] + ([redis_url] if redis_url else []):
        sim = simulator(None, "tiny", "--root", str(root), "--block-size", str(BLOCK), "--kv-events",
                        "--num-gpu-blocks", str(CAPACITY), log_dir=log_dir).start()
        rt = None
        try:
            sim.wait_http()
            args = ["--index", backend] if backend != "memory" else []
            rt = router([sim.url], *args, log_dir=log_dir).start()
            rt.wait_http("/ready", timeout=20)
            with httpx.Client(timeout=10) as c:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    idx = c.get(rt.url + "/admin/replicas").json()["replicas"][0]["index"]
                    if idx["mode"] == "precise" and (backend == "memory" or (idx["events"] or {}).get("lease_held")):
                        break
                    time.sleep(0.1)
                c.post(sim.url + "/sim/kv_flood", json={"blocks_per_s": rate, "seconds": seconds}).raise_for_status()
                time.sleep(seconds + 1.0)
                state = c.get(sim.url + "/sim/state").json()["kv_events"]
                idx = c.get(rt.url + "/admin/replicas").json()["replicas"][0]["index"]["events"]
                src = idx["sources"][0]
                rows.append({"index": "memory" if backend == "memory" else "redis", "rate_blocks_per_s": rate,
                             "published_batches": state["next_seq"], "applied_batches": src["batches"],
                             "gaps": src["gaps"], "lag_p50_ms": 1000 * (idx["lag_p50_s"] or 0),
                             "lag_p99_ms": 1000 * (idx["lag_p99_s"] or 0)})
        finally:
            if rt is not None:
                rt.stop()
            sim.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_events", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=200_000, help="blocks stored in the throughput run")
    p.add_argument("--rate", type=int, default=10_000, help="blocks per second in the lag run")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the lag run")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--out", default="/tmp/kvroute-bench-events", help="logs and results.json here")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    redis = None
    try:
        redis_url = None
        if not args.no_redis:
            redis = redis_server(log_dir=out).start()
            wait_redis(redis)
            redis_url = f"redis://127.0.0.1:{redis.port}/0"
        rows = asyncio.run(throughput(args.blocks, redis_url))
        print(f"throughput ({args.blocks} blocks stored, 16 tokens each, cpu count {os.cpu_count()}):")
        for r in rows:
            extra = f", redis CPU {r['redis_cpu_s']:.2f} s" if "redis_cpu_s" in r else ""
            print(f"  {r['index']:<22} {r['blocks_per_s']:>9,.0f} blocks/s, {r['blocks_per_cpu_s']:>9,.0f} blocks per "
                  f"router CPU second{extra}")
        lags = lag(args.rate, args.seconds, redis_url, out)
        print(f"lag at {args.rate} blocks/s for {args.seconds:.0f} s:")
        for r in lags:
            print(f"  {r['index']:<8} applied {r['applied_batches']}/{r['published_batches']} batches, gaps {r['gaps']}, "
                  f"lag p50 {r['lag_p50_ms']:.1f} ms, p99 {r['lag_p99_ms']:.1f} ms")
        (out / "results.json").write_text(json.dumps({"throughput": rows, "lag": lags}, indent=2))
    finally:
        if redis is not None:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
