"""The store's Redis client against redis-py's, on one Redis and on a Redis Cluster.

    python -m loadtest.bench_store [--calls 6000] [--out loadtest/results/store]

Both clients send the same calls to the same local servers (a ``redis-server``, and a Redis Cluster
of 3 masters and 3 replicas started here): ``GET`` of a small key, and the prefix index's lookup
(``router.index.redis``'s script over 8 replicas' sets for a 64-block chain, 32 of them held), at
concurrency 1 (one call after the other: the router's latency) and 64 (calls in flight at once: the
router under load). Reported: the client's CPU per call (``time.process_time``: the servers run in
other processes) and the wall time per call. redis-py is needed (``pip install redis``, in the
``bench`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from router.index.redis import _LOOKUP, RedisIndex
from router.store import Store

from .cluster import RedisCluster, redis_server, wait_redis

CHAIN = list(range(1, 65))
REPLICAS = [f"replica-{i}" for i in range(8)]


async def prepare(url: str) -> tuple[list[str], list[Any]]:
    """Index entries for the lookup; returns its keys and arguments."""
    index = RedisIndex.from_url(url, namespace="bench-store", timeout_s=1.0)
    try:
        for r in REPLICAS:
            await index.record("m", r, CHAIN[:32], 100_000)
        keys = [index.key("m", r) for r in REPLICAS]
        args = [RedisIndex._packed(CHAIN), "r" * len(REPLICAS), repr(time.time())]
        await index.client.execute("SET", "{m}small", "x")
        return keys, args
    finally:
        await index.close()


async def measure(call: Callable[[], Awaitable[Any]], calls: int, concurrency: int) -> dict[str, float]:
    for _ in range(50):  # connections open, scripts loaded
        await call()

    async def worker(n: int) -> None:
        for _ in range(n):
            await call()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    done = calls // concurrency * concurrency
    return {"cpu_us_per_call": round((time.process_time() - cpu) / done * 1e6, 1),
            "wall_us_per_call": round((time.perf_counter() - wall) / done * 1e6, 1)}


async def ours(url: str, keys: list[str], args: list[Any], calls: int) -> dict[str, Any]:
    store = Store(url)
    client = store.client
    sha = client.script(_LOOKUP)
    out: dict[str, Any] = {}
    try:
        for c in (1, 64):
            out[f"get@{c}"] = await measure(lambda: client.execute("GET", "{m}small"), calls, c)
            out[f"lookup@{c}"] = await measure(lambda: client.evalsha(sha, keys, args), calls, c)
    finally:
        await store.close()
    return out


async def redis_py(url: str, cluster: bool, keys: list[str], args: list[Any], calls: int) -> dict[str, Any]:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster as PyCluster

    if cluster:
        nodes = [ClusterNode(h, int(p)) for h, p in (a.split(":") for a in url.removeprefix("redis://").split(","))]
        client: Any = PyCluster(startup_nodes=nodes)
    else:
        client = aioredis.Redis.from_url(url)
    out: dict[str, Any] = {}
    try:
        sha = await client.script_load(_LOOKUP)
        for c in (1, 64):
            out[f"get@{c}"] = await measure(lambda: client.get("{m}small"), calls, c)
            out[f"lookup@{c}"] = await measure(lambda: client.evalsha(sha, len(keys), *keys, *args), calls, c)
    finally:
        await client.aclose()
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | client | GET CPU µs (c=1 / c=64) | lookup CPU µs (c=1 / c=64) | lookup wall µs (c=1 / c=64) |",
             "|---|---|---|---|---|"]
    for r in rows:
        m = r["results"]
        lines.append(f"| {r['server']} | {r['client']} | {m['get@1']['cpu_us_per_call']} / "
                     f"{m['get@64']['cpu_us_per_call']} | {m['lookup@1']['cpu_us_per_call']} / "
                     f"{m['lookup@64']['cpu_us_per_call']} | {m['lookup@1']['wall_us_per_call']} / "
                     f"{m['lookup@64']['wall_us_per_call']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/store"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    single = redis_server(log_dir=work).start()
    cluster = RedisCluster(work)
    rows: list[dict[str, Any]] = []
    try:
        wait_redis(single)
        cluster.start()
        for server, url in (("redis", f"redis://127.0.0.1:{single.port}"), ("redis-cluster", cluster.url)):
            keys, args = asyncio.run(prepare(url))
            rows.append({"server": server, "client": "kvroute store",
                         "results": asyncio.run(ours(url, keys, args, a.calls))})
            rows.append({"server": server, "client": "redis-py",
                         "results": asyncio.run(redis_py(url, server == "redis-cluster", keys, args, a.calls))})
    finally:
        cluster.stop()
        single.stop()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    md = table(rows)
    (a.out / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
