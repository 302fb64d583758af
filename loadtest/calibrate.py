"""The ``cpu`` profile, measured: step times of this machine's real vLLM CPU replicas, and a side-by-side check.

    python -m loadtest.calibrate measure     # fit the engine's step costs to real replicas
    python -m loadtest.calibrate check       # same workload: real replicas against simulated ``cpu`` ones

Everything is read from vLLM's own clocks (its time-to-first-token, queue, prefill and decode
histograms), with 3 real replicas of the tiny model (``deploy/setup-vllm.sh``) running at once behind
kvroute, as the real-vLLM benchmarks run them: on 2 cores they slow each other down, and the profile
stands for that machine, not for one quiet replica.

``measure``: prompts of distinct token ids (nothing cached) of 128 to 2048 tokens, 4 at a time, give
the prefill time per token (a least-squares line through vLLM's mean prefill time per length); 128
output tokens of one and of four requests decoding at once on each replica give a decode step's fixed
time and its cost per sequence; a shared-prefix workload of its own (8 groups x 6 prompts, 768-token
system prompts) gives what a step with prefill costs beyond its tokens (``prefill_base_s``) and the API
server's own time per request (time to first token less queue and prefill: ``frontend_s``). It prints
the profile's figures for ``loadtest/profiles.py``.

``check`` runs another shared-prefix workload (12 groups x 6 prompts, 1024-token system prompts, seed 5)
through kvroute against 3 real replicas (once to warm them up, then 3 times measured: the median run
counts, since one run's median TTFT varies up to twofold on this machine), then against 3 simulated
replicas with ``--profile cpu`` and the tiny model's tokenizer (same token counts), and compares
vLLM's prefix-cache hit rate and the median time to first token. The profile should reproduce the
hit rate within 2 points (a ``vllm``-marked test checks it) and the median TTFT within 25% (it does not:
see the README).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from . import vllm_cluster
from .cluster import Proc, free_port, router, simulator

BLOCK = 128
BLOCKS = 104


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 20 for i in range(n)]


def _mean(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """Mean of a vLLM histogram's observations between two scrapes."""
    n = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
    return (after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)) / n if n else 0.0


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def _frontend(before: dict[str, float], after: dict[str, float], prefill: float) -> float:
    """Arrival at the API server to the first token, less the engine's queue and prefill: the API server's own
    time (parsing, tokenizing, handing over, sharing the cores), which no engine step accounts for."""
    return (_mean(before, after, "vllm:time_to_first_token_seconds") - prefill
            - _mean(before, after, "vllm:request_queue_time_seconds"))


def _summed(urls: list[str]) -> dict[str, float]:
    found = [vllm_cluster.metrics(u) for u in urls]
    return {k: sum(f.get(k, 0.0) for f in found) for k in found[0]}


async def _prefill_sweep(router_url: str, urls: list[str], clients: int = 4, per_length: int = 12
                         ) -> tuple[list[int], list[float], list[float]]:
    """Distinct prompts (nothing cached) of 128 to 2048 tokens, ``clients`` at a time through the router, 4 output
    tokens each: per length, the mean prefill time and the API server's own time, by vLLM's clocks."""
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(ids: list[int]) -> None:
            r = await c.post(router_url + "/v1/completions", json={
                "model": vllm_cluster.MODEL_NAME, "prompt": ids, "max_tokens": 4, "ignore_eos": True})
            if r.status_code != 200:
                raise RuntimeError(f"{len(ids)}-token prompt: {r.status_code} {r.text[:300]}")

        async def batch(prompts: list[list[int]]) -> None:
            for i in range(0, len(prompts), clients):
                await asyncio.gather(*(one(ids) for ids in prompts[i:i + clients]))

        await batch([_ids(i, 64 << (i % 4)) for i in range(4 * len(urls))])  # warm: new replicas compile
        xs, prefill, frontend = [], [], []
        seed = 100
        for n in (128, 512, 1024, 2048):
            before = _summed(urls)
            await batch([_ids(seed + i, n) for i in range(per_length)])
            seed += per_length
            after = _summed(urls)
            pre = _mean(before, after, "vllm:request_prefill_time_seconds")
            xs.append(n)
            prefill.append(pre)
            frontend.append(_frontend(before, after, pre))
    return xs, prefill, frontend


def decode_step(url: str, concurrent: int) -> float:
    """Seconds per decode step with ``concurrent`` requests decoding together, by vLLM's own clock (its
    decode-time histogram): a busy API server delivers streamed tokens in bursts."""
    before = vllm_cluster.metrics(url)

    async def one(ac: httpx.AsyncClient, i: int) -> None:
        body = {"model": vllm_cluster.MODEL_NAME, "prompt": _ids(1000 + 10 * concurrent + i, 64),
                "max_tokens": 128, "ignore_eos": True}
        (await ac.post(url + "/v1/completions", json=body)).raise_for_status()

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as ac:
            await asyncio.gather(*(one(ac, i) for i in range(concurrent)))

    asyncio.run(main())
    after = vllm_cluster.metrics(url)
    return _mean(before, after, "vllm:request_decode_time_seconds") / 127


def measure(urls: list[str], model: Path, out: Path) -> dict[str, float]:
    """Step costs and the API server's time per request, by vLLM's own clocks (its histograms), with every replica
    on this machine at once and kvroute in front, as the benchmarks that the profile stands in for run them."""
    from concurrent.futures import ThreadPoolExecutor

    rt = router(urls, "--policy", "round-robin", log_dir=out).start()
    try:
        rt.wait_http("/ready", timeout=30)
        xs, prefill, frontend = asyncio.run(_prefill_sweep(rt.url, urls))
    finally:
        rt.stop()
    slope, intercept = _line(xs, prefill)
    with ThreadPoolExecutor(len(urls)) as pool:  # each replica decoding at once
        one_seq = statistics.mean(pool.map(lambda u: decode_step(u, 1), urls))
        four = statistics.mean(pool.map(lambda u: decode_step(u, 4), urls))
    per_seq = max(0.0, (four - one_seq) / 3)
    base = max(0.0, one_seq - per_seq)
    # A shared-prefix workload of its own (not the check's): what a prefill step costs beyond its tokens and what
    # the API server adds, with the replicas as busy as the benchmarks keep them.
    w = calibration_run(urls, model, out)
    return {"prefill_s_per_token": slope, "prefill_intercept_s": intercept,
            "sweep_frontend_s": statistics.median(frontend),
            "decode_step_1_s": one_seq, "decode_step_4_s": four, "decode_s_per_seq": per_seq, "base_s": base,
            "frontend_s": w["frontend_s"],
            "prefill_base_s": max(0.0, w["prefill_s"] - base - slope * w["uncached_tokens"])}


def calibration_run(urls: list[str], model: Path, out: Path, runs: int = 3) -> dict[str, float]:
    """A shared-prefix workload through kvroute (8 groups x 6 prompts, 768-token system prompts, seed 11; the check
    uses another), 4 clients, 4 output tokens, ``runs`` times from empty caches: the medians over the runs of vLLM's
    own mean prefill time, the API server's time (time to first token less queue and prefill) and the uncached
    tokens per request. One run says little: on this machine the same run's times vary twofold from one to the next."""
    from router.tokenizer import LocalTokenizer

    from .bench_vllm import run_policy, shared_prefix

    convs = shared_prefix(LocalTokenizer(model), 8, 6, 768, 64, seed=11)
    found: list[dict[str, float]] = []
    for i in range(runs):
        before = _summed(urls)
        asyncio.run(run_policy(f"calibration-{i}", ["--policy", "cache-aware"], 1, urls, convs, 4, 4, out))
        after = _summed(urls)
        n = after["vllm:request_prefill_time_seconds_count"] - before["vllm:request_prefill_time_seconds_count"]
        pre = _mean(before, after, "vllm:request_prefill_time_seconds")
        uncached = (after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
                    - after["vllm:prefix_cache_hits_total"] + before["vllm:prefix_cache_hits_total"])
        found.append({"prefill_s": pre, "uncached_tokens": uncached / n if n else 0.0,
                      "frontend_s": _frontend(before, after, pre)})
    return {k: statistics.median(f[k] for f in found) for k in found[0]}


def start_replicas(home: Path, n: int, out: Path) -> list[Proc]:
    """Real replicas as the benchmarks run them: KV-cache events, prompt token details, the dev endpoints (cache
    reset between runs)."""
    return vllm_cluster.start([
        vllm_cluster.replica(home, num_gpu_blocks=BLOCKS, log_dir=out, name=f"vllm-{i}", dev_mode=True,
                             extra=(*vllm_cluster.kv_events_args(), "--enable-prompt-tokens-details"))
        for i in range(n)], timeout=900)


def check(out: Path, runs: int = 3) -> dict[str, dict[str, float]]:
    """Same shared-prefix workload through kvroute: real replicas, then simulated ``cpu`` ones."""
    from router.tokenizer import LocalTokenizer

    from .bench_vllm import run_policy, shared_prefix

    home = vllm_cluster.setup()
    model = vllm_cluster.model_dir(home)
    tok = LocalTokenizer(model)
    convs = shared_prefix(tok, 12, 6, 1024, 64, seed=5)
    results: dict[str, dict[str, float]] = {}
    procs = start_replicas(home, 3, out)
    try:
        # once to warm the replicas up (a new vLLM CPU replica compiles on its first requests), then measured
        # ``runs`` times, each from empty caches: the median run counts (one run's median TTFT varies twofold)
        urls = [p.url for p in procs]
        asyncio.run(run_policy("warm", ["--policy", "cache-aware"], 1, urls, convs, 4, 4, out))
        found = [asyncio.run(run_policy(f"real-{i}", ["--policy", "cache-aware"], 1, urls, convs, 4, 4, out))
                 for i in range(runs)]
        ttfts = sorted(r.latency(50) for r in found)
        results["real vLLM"] = {"hit_rate": statistics.median(r.hit_rate for r in found),
                                "ttft_p50_ms": statistics.median(ttfts), "ttft_p50_min_ms": ttfts[0],
                                "ttft_p50_max_ms": ttfts[-1]}
    finally:
        for p in procs:
            p.stop(timeout=15)
    port = free_port()
    sims = simulator(port, vllm_cluster.MODEL_NAME, "--replicas", "3", "--profile", "cpu", "--root", str(model),
                     "--num-gpu-blocks", str(BLOCKS), "--kv-events", log_dir=out).start()
    try:
        sims.wait_http()
        urls = [f"http://127.0.0.1:{port + i}" for i in range(3)]
        r = asyncio.run(run_policy("sim", ["--policy", "cache-aware"], 1, urls, convs, 4, 4, out))
        results["simulated cpu profile"] = {"hit_rate": r.hit_rate, "ttft_p50_ms": r.latency(50)}
    finally:
        sims.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["measure", "check"])
    p.add_argument("--replicas", type=int, default=3, help="real replicas measured at once (measure): 3, as the "
                   "real-vLLM benchmarks and the check run them, sharing this machine's cores")
    args = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="kvroute-calibrate-"))
    if args.what == "measure":
        home = vllm_cluster.setup()
        procs = start_replicas(home, args.replicas, out)
        try:
            m = measure([p.url for p in procs], vllm_cluster.model_dir(home), out)
        finally:
            for proc in procs:
                proc.stop(timeout=15)
        for k, v in m.items():
            print(f"{k}: {v * 1e3:.3f} ms" if not k.endswith("per_token") else f"{k}: {v * 1e6:.2f} us")
        print("as a profile: StepCost(base_s={base_s:.4g}, prefill_s_per_token={prefill_s_per_token:.4g}, "
              "decode_s_per_seq={decode_s_per_seq:.4g}, prefill_base_s={prefill_base_s:.4g}), "
              "frontend_s={frontend_s:.4g}".format(**m))
        return 0
    res = check(out)
    for name, r in res.items():
        spread = (f" (runs: {r['ttft_p50_min_ms']:.0f} to {r['ttft_p50_max_ms']:.0f} ms)"
                  if "ttft_p50_min_ms" in r else "")
        print(f"{name}: hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_ms']:.0f} ms{spread}")
    real, sim = res["real vLLM"], res["simulated cpu profile"]
    print(f"hit rate difference {abs(real['hit_rate'] - sim['hit_rate']) * 100:.1f} points (target <= 2), median TTFT "
          f"ratio {sim['ttft_p50_ms'] / real['ttft_p50_ms']:.2f} (target 0.75-1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
