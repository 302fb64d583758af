"""Cost of one routing decision (prompt key + index lookup + scoring) with a large index.

    python -m loadtest.bench_decision [--entries 1000000] [--decisions 300]

Fills the prefix index with about ``--entries`` (block, replica) entries over 3 replicas, then
times complete cache-aware decisions, in process, through the components a router process assembles
(:class:`router.gateway.Gateway`: the tiered index over the in-process or the Redis one, behind its
fallback), for prompts of 1k, 8k and 32k tokens (4 bytes
per token, KV blocks of 16 tokens), half of them sharing an indexed prefix, on both backends: the
in-process index and Redis on loopback (a temporary redis-server). Also reports Redis memory per
(block, replica) entry (``used_memory`` difference / entries), and the prompt key of chat requests
with the tiny model's tokenizer (the default wherever a model's tokenizer is found), encoded by pieces
between its added tokens (the default) and whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from router.config import RouterConfig
from router.gateway import Gateway
from router.index import PrefixIndex
from router.index.redis import RedisIndex
from router.prefix import key_for
from router.request import RouteRequest
from router.store import Redis

from .cluster import redis_server, wait_redis
from .tiny_model import write_tokenizer
from .workloads import text

BLOCK = 16
SIZES = (1024, 8192, 32768)


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def used_memory(client: Redis | str) -> float:
    """Redis's ``used_memory`` in bytes."""
    own = isinstance(client, str)
    r = Redis(client) if isinstance(client, str) else client
    try:
        info = (await r.execute("INFO", "memory")).decode()
    finally:
        if own:
            await r.close()
    return float(next(line for line in info.splitlines() if line.startswith("used_memory:")).split(":")[1])


def make_gateway(n: int, backend: str) -> Gateway:
    """A router process's components, assembled as ``kvroute serve`` assembles them (:class:`router.gateway.Gateway`),
    with ``n`` replicas marked ready (no health check runs) and no KV events (none is published here)."""
    config = RouterConfig.model_validate({
        "replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"], "block_size": BLOCK,
                      "num_gpu_blocks": 10_000_000} for i in range(n)],
        "index": {"backend": backend, "timeout_s": 1.0}, "kv_events": {"enabled": False}})
    gw = Gateway(config)
    for r in gw.pool:
        gw.pool.health.mark_success(r)
    return gw


async def bench(backend: str, entries: int, decisions: int, seed: int) -> dict[str, dict[str, float]]:
    gw = make_gateway(3, backend)
    decider, pool, policy, keys = gw.decider, gw.pool, gw.policy, gw.decider.keys
    assert keys is not None and decider.index is not None
    replicas = list(pool)
    rng = random.Random(seed)
    await decider.start()
    # filled where the decisions read: the gateway's own index in process, the shared store's keys with Redis
    # (the gateway records there in the background; this writes them at once)
    index: PrefixIndex = decider.index if gw.store is None else RedisIndex(gw.store, 1.0)
    # fill: 32k-token prompts (2048 blocks each), spread over the replicas
    prefixes = []
    filled = 0
    while filled < entries:
        prompt = text(rng, SIZES[-1] * 4)
        prefixes.append(prompt)
        key = await keys.key("/v1/completions", {"prompt": prompt}, "m")
        assert key is not None
        chain = key.chains(BLOCK)[0]
        await index.record("m", replicas[len(prefixes) % 3].name, chain, 10_000_000)
        filled += len(chain)
    out: dict[str, dict[str, float]] = {}
    for size in SIZES:
        times = []
        for i in range(decisions):
            if i % 2 == 0:  # shares an indexed prefix (the first half of the prompt)
                base = rng.choice(prefixes)[: size * 2]
                prompt = base + text(rng, size * 4 - len(base))
            else:
                prompt = text(rng, size * 4)
            payload = {"model": "m", "prompt": prompt}
            t0 = time.perf_counter()
            req = RouteRequest(model="m", request_id="b", endpoint="/v1/completions", payload=payload,
                               body_size=len(prompt))
            await decider.prepare(req)
            policy.choose(req, pool.views())
            times.append(time.perf_counter() - t0)
        out[str(size)] = {"p50_ms": pct(times, 50) * 1e3, "p99_ms": pct(times, 99) * 1e3,
                          "mean_ms": statistics.mean(times) * 1e3}
    out["entries"] = {"count": float(filled)}
    if gw.store is not None:
        out["entries"]["redis_used_memory"] = await used_memory(gw.store.client)
    await decider.close()
    if gw.store is not None:
        await gw.store.close()
    return out


CHAT_SIZES = (1024, 8192)


def bench_chat(decisions: int, seed: int, segments: bool, folder: Path) -> dict[str, dict[str, float]]:
    """Prompt keys of chat requests with the model's tokenizer (the default wherever it is found): a system
    prompt of ``size`` tokens shared by 8 requests in a row, plus a 64-word question."""
    from router.tokenizer import LocalTokenizer

    tokenizer = LocalTokenizer(folder, reuse=segments)
    counter = LocalTokenizer(folder, reuse=False)
    rng = random.Random(seed)
    out: dict[str, dict[str, float]] = {}
    for size in CHAT_SIZES:
        systems = [text(rng, size * 4) for _ in range(16)]
        times = []
        for i in range(decisions):
            messages = [{"role": "system", "content": systems[(i // 8) % len(systems)]},
                        {"role": "user", "content": text(rng, 256)}]
            t0 = time.perf_counter()
            key_for("/v1/chat/completions", {"model": "m", "messages": messages}, "m", tokenizer=tokenizer)
            times.append(time.perf_counter() - t0)
        out[str(size)] = {"p50_ms": pct(times, 50) * 1e3, "p99_ms": pct(times, 99) * 1e3,
                          "mean_ms": statistics.mean(times) * 1e3,
                          "system_tokens": statistics.mean(len(counter.encode(x, False)) for x in systems)}
    out["encoding"] = tokenizer.describe()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_decision", description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--decisions", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    report: dict[str, object] = {}
    report["memory"] = asyncio.run(bench("memory", args.entries, args.decisions, args.seed))
    redis = redis_server(log_dir=Path(tempfile.mkdtemp(prefix="kvroute-bench-"))).start()
    try:
        wait_redis(redis)
        baseline = asyncio.run(used_memory(f"redis://127.0.0.1:{redis.port}/0"))
        result = asyncio.run(bench(f"redis://127.0.0.1:{redis.port}/0", args.entries, args.decisions, args.seed))
        used = result["entries"]["redis_used_memory"] - baseline
        result["entries"]["bytes_per_entry"] = used / result["entries"]["count"]
        report["redis"] = result
    finally:
        redis.stop()
    lines = [f"{int(report['memory']['entries']['count'])} indexed (block, replica) entries, 3 replicas, "
             f"{args.decisions} decisions per size (half sharing an indexed prefix), blocks of {BLOCK} tokens",
             "", "| prompt tokens | memory p50 | memory p99 | redis p50 | redis p99 |", "|---|---|---|---|---|"]
    for size in SIZES:
        m, r = report["memory"][str(size)], report["redis"][str(size)]  # type: ignore[index]
        lines.append(f"| {size} | {m['p50_ms']:.3f} ms | {m['p99_ms']:.3f} ms | {r['p50_ms']:.3f} ms | "
                     f"{r['p99_ms']:.3f} ms |")
    lines.append(f"\nRedis memory: {report['redis']['entries']['bytes_per_entry']:.1f} bytes per (block, replica) "
                 "entry")  # type: ignore[index]
    folder = write_tokenizer(Path(tempfile.mkdtemp(prefix="kvroute-bench-")) / "tiny-model")
    for segments in (True, False):
        report["chat_segments" if segments else "chat_whole"] = bench_chat(args.decisions, args.seed, segments, folder)
    lines += ["", f"Chat prompt keys with the tiny model's tokenizer, {args.decisions} per size, each system prompt "
              "shared by 8 requests in a row:", "",
              "| system prompt (characters / tokens) | by pieces p50 | p99 | whole p50 | p99 |", "|---|---|---|---|---|"]
    for size in CHAT_SIZES:
        a, b = report["chat_segments"][str(size)], report["chat_whole"][str(size)]  # type: ignore[index]
        lines.append(f"| {size * 4} / {a['system_tokens']:.0f} | {a['p50_ms']:.3f} ms | {a['p99_ms']:.3f} ms | {b['p50_ms']:.3f} ms | "
                     f"{b['p99_ms']:.3f} ms |")
    lines.append(f"\nBy pieces: {report['chat_segments']['encoding']}")  # type: ignore[index]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
