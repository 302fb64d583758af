"""The ``cpu`` profile, measured: step times of this machine's real vLLM CPU replicas, and a side-by-side check.

    python -m loadtest.calibrate measure     # fit the engine's step costs to real replicas
    python -m loadtest.calibrate check       # same workload: real replicas against simulated ``cpu`` ones

Everything is read from vLLM's own clocks (its time-to-first-token, queue, prefill and decode
histograms) and from the client's, with 3 real replicas of the tiny model (``deploy/setup-vllm.sh``)
running at once behind kvroute, as the real-vLLM benchmarks run them.

``measure``: prompts of distinct token ids (nothing cached) of 128 to 2048 tokens, 4 at a time, give
the prefill time per token (a least-squares line through vLLM's mean prefill time per length); 128
output tokens of one and of four requests decoding at once on each replica give a decode step's fixed
time and its cost per sequence; a shared-prefix workload of its own (8 groups x 6 prompts, 768-token
system prompts) gives what a step with prefill costs beyond its tokens (``prefill_base_s``) and the time
a client waits beyond the engine's queue and prefill. The same workload against simulated replicas with
those step costs and no API-server time, taking turns with the real ones three times, tells how much of
that wait the router and the simulator's own HTTP path already account for; the rest (the median of the
paired differences) is the profile's ``frontend_s``. It prints the profile's figures
for ``loadtest/profiles.py``.

``check`` runs another shared-prefix workload (12 groups x 6 prompts, 1024-token system prompts, seed 5)
through kvroute against 3 real replicas (once to warm them up, then ``measure``), against 3 simulated
``cpu`` replicas as ``loadtest/profiles.py`` stores the profile and against 3 with the figures ``measure``
just found on this machine, the three taking turns 5 times (the median run of each counts), and compares
vLLM's prefix-cache hit rate and the median time to first token. A profile should reproduce the hit
rate within 2 points and the median TTFT within 25% (``tests/vllm/test_calibration.py``, ``vllm`` marker), taken
turn by turn: the median over the turns of its TTFT p50 over real vLLM's in the same turn.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from . import vllm_cluster
from .cluster import free_ports, router, simulator

if TYPE_CHECKING:
    from .bench_vllm import RunResult

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
            "vllm_frontend_s": w["frontend_s"], "beyond_engine_s": w["beyond_engine_s"],
            "prefill_base_s": max(0.0, w["prefill_s"] - base - slope * w["uncached_tokens"])}


def calibration_run(urls: list[str], model: Path, out: Path, runs: int = 3) -> dict[str, float]:
    """A shared-prefix workload through kvroute (8 groups x 6 prompts, 768-token system prompts, seed 11; the check
    uses another), 4 clients, 4 output tokens, ``runs`` times from empty caches: the medians over the runs of vLLM's
    own mean prefill time, the API server's time by vLLM's clock (time to first token less queue and prefill), the
    time a client waits beyond the engine's queue and prefill (``beyond_engine_s``: the API server's time before and
    after vLLM's clock, kvroute, the sockets) and the uncached tokens per request."""
    from router.tokenizer import LocalTokenizer

    from .bench_vllm import run_policy, shared_prefix

    convs = shared_prefix(LocalTokenizer(model), 8, 6, 768, 64, seed=11)
    found: list[dict[str, float]] = []
    for i in range(runs):
        before = _summed(urls)
        r = asyncio.run(run_policy(f"calibration-{i}", ["--policy", "cache-aware"], 1, urls, convs, 4, 4, out))
        after = _summed(urls)
        n = after["vllm:request_prefill_time_seconds_count"] - before["vllm:request_prefill_time_seconds_count"]
        pre = _mean(before, after, "vllm:request_prefill_time_seconds")
        uncached = (after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
                    - after["vllm:prefix_cache_hits_total"] + before["vllm:prefix_cache_hits_total"])
        client = statistics.mean(s.ttfb_s for s in r.sent)
        found.append({"prefill_s": pre, "uncached_tokens": uncached / n if n else 0.0,
                      "frontend_s": _frontend(before, after, pre),
                      "beyond_engine_s": client - pre - _mean(before, after, "vllm:request_queue_time_seconds")})
    return {k: statistics.median(f[k] for f in found) for k in found[0]}


def step_flags(m: dict[str, float], frontend_s: float) -> tuple[str, ...]:
    """The simulator's flags for measured step costs and API server time (on top of ``--profile cpu``)."""
    return ("--step-base-ms", f"{m['base_s'] * 1e3:.4g}", "--step-prefill-us-per-token",
            f"{m['prefill_s_per_token'] * 1e6:.4g}", "--step-decode-us-per-seq", f"{m['decode_s_per_seq'] * 1e6:.4g}",
            "--step-prefill-base-ms", f"{m['prefill_base_s'] * 1e3:.4g}", "--frontend-ms", f"{frontend_s * 1e3:.4g}")


def fit_frontend(m: dict[str, float], real: list[str], model: Path, out: Path, runs: int = 3) -> float:
    """The simulator's ``frontend_s`` for measured step costs: the time a client waits beyond the engine's queue and
    prefill on the ``real`` replicas, less what it waits beyond them on simulated ones with no frontend time (the
    router, the simulator's own HTTP path), on the same calibration workload. The two take turns ``runs`` times and
    the median of the paired differences counts: the machine's speed moves from minute to minute, and a
    difference of two runs made minutes apart once put 20 ms too much into the profile."""
    differences = []
    with simulated(model, out, *step_flags(m, 0.0)) as sim:
        for _ in range(runs):
            on_real = calibration_run(real, model, out, runs=1)
            on_sim = calibration_run(sim, model, out, runs=1)
            differences.append(on_real["beyond_engine_s"] - on_sim["beyond_engine_s"])
    return max(0.0, statistics.median(differences))


def profile_text(m: dict[str, float]) -> str:
    return ("StepCost(base_s={base_s:.4g}, prefill_s_per_token={prefill_s_per_token:.4g}, "
            "decode_s_per_seq={decode_s_per_seq:.4g}, prefill_base_s={prefill_base_s:.4g}), "
            "frontend_s={frontend_s:.4g}".format(**m))


@contextmanager
def simulated(model: Path, out: Path, *flags: str) -> Iterator[list[str]]:
    """Three simulated ``cpu`` replicas in one process (``flags`` on top of the profile), while the block runs: their
    URLs."""
    port = free_ports(3)
    proc = simulator(port, vllm_cluster.MODEL_NAME, "--replicas", "3", "--profile", "cpu", "--root", str(model),
                     "--num-gpu-blocks", str(BLOCKS), "--kv-events", *flags, log_dir=out).start()
    try:
        proc.wait_http()
        yield [f"http://127.0.0.1:{port + i}" for i in range(3)]
    finally:
        proc.stop()


def _summary(found: list[RunResult], real: list[RunResult]) -> dict[str, float]:
    """The median run's figures, and the median over the turns of this side's TTFT p50 over real vLLM's in the
    same turn (the runs of a turn are a minute apart; the machine's speed moves more than that between turns)."""
    ttfts = sorted(r.latency(50) for r in found)
    return {"hit_rate": statistics.median(r.hit_rate for r in found), "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p50_min_ms": ttfts[0], "ttft_p50_max_ms": ttfts[-1],
            "ttft_p50_vs_real": statistics.median(s.latency(50) / r.latency(50) for s, r in zip(found, real))}


def check(out: Path, runs: int = 5) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """One shared-prefix workload through kvroute: real replicas (measured first, on its own calibration workload),
    and simulated ``cpu`` ones twice: as ``loadtest/profiles.py`` stores the profile, and with the figures just
    measured on this machine; the three take turns ``runs`` times. Returns each one's summary (the median run),
    and the figures measured."""
    from router.tokenizer import LocalTokenizer

    from .bench_vllm import run_policy, shared_prefix

    home = vllm_cluster.setup()
    model = vllm_cluster.model_dir(home)
    convs = shared_prefix(LocalTokenizer(model), 12, 6, 1024, 64, seed=5)

    found: dict[str, list[RunResult]] = {"real vLLM": [], "stored cpu profile": [],
                                         "cpu profile measured in this run": []}
    procs = vllm_cluster.start_for_benchmarks(home, 3, BLOCKS, out)
    try:
        urls = [p.url for p in procs]
        # once to warm the replicas up (a new vLLM CPU replica compiles on its first requests), then measured
        asyncio.run(run_policy("warm", ["--policy", "cache-aware"], 1, urls, convs, 4, 4, out))
        measured = measure(urls, model, out)
        measured["frontend_s"] = fit_frontend(measured, urls, model, out)
        # The real replicas wait idle while the simulated ones run and the runs take turns: this machine's speed
        # moves from one minute to the next (a check once found real vLLM's median 40% above what the measurement
        # made a minute before predicted), and taking turns lets that weigh on both sides alike.
        with simulated(model, out) as stored, \
                simulated(model, out, *step_flags(measured, measured["frontend_s"])) as fitted:
            sides = (("real vLLM", "real", urls), ("stored cpu profile", "sim-stored", stored),
                     ("cpu profile measured in this run", "sim-measured", fitted))
            for i in range(runs):
                for name, short, side in sides:
                    found[name].append(asyncio.run(run_policy(
                        f"{short}-{i}", ["--policy", "cache-aware"], 1, side, convs, 4, 4, out)))
    finally:
        for p in procs:
            p.stop(timeout=15)
    results = {name: _summary(runs_of, found["real vLLM"]) for name, runs_of in found.items()}
    return results, measured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["measure", "check"])
    p.add_argument("--replicas", type=int, default=3, help="real replicas measured at once (measure): 3, as the "
                   "real-vLLM benchmarks and the check run them, sharing this machine's cores")
    args = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="kvroute-calibrate-"))
    if args.what == "measure":
        home = vllm_cluster.setup()
        model = vllm_cluster.model_dir(home)
        procs = vllm_cluster.start_for_benchmarks(home, args.replicas, BLOCKS, out)
        try:
            urls = [p.url for p in procs]
            m = measure(urls, model, out)
            m["frontend_s"] = fit_frontend(m, urls, model, out)
        finally:
            for proc in procs:
                proc.stop(timeout=15)
        for k, v in m.items():
            print(f"{k}: {v * 1e3:.3f} ms" if not k.endswith("per_token") else f"{k}: {v * 1e6:.2f} us")
        print("as a profile:", profile_text(m))
        return 0
    res, measured = check(out)
    real = res["real vLLM"]
    for name, r in res.items():
        print(f"{name}: hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_ms']:.1f} ms (runs: "
              f"{r['ttft_p50_min_ms']:.1f} to {r['ttft_p50_max_ms']:.1f} ms)"
              + ("" if r is real else f"; hit rate difference {abs(real['hit_rate'] - r['hit_rate']) * 100:.1f} "
                 f"points (target <= 2), TTFT p50 over real vLLM's turn by turn: median "
                 f"{r['ttft_p50_vs_real']:.2f} (target 0.75-1.25; of the medians {r['ttft_p50_ms'] / real['ttft_p50_ms']:.2f})"))
    print("measured in this run:", profile_text(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
