"""Many tenants on one fleet: what a flood of batch traffic does to interactive users, whether weights divide a
saturated fleet, and whether rate limits hold across routers.

    python -m loadtest.bench_tenants [--only flood,weights,budgets] [--seconds 60] [--out DIR]

Stand-in replicas (``loadtest.simulator``, fixed time to first token and between tokens, ``--max-num-seqs``
requests at once, the rest waiting) behind kvroute, with tenants named by the ``x-kvroute-tenant`` header:

- **flood**: 4 replicas of 16 slots; two interactive tenants at 1.25 requests/s each (open loop, streamed,
  24 output tokens). Run three times on the same arrival sequence: alone; with one batch tenant sending 20x
  their rate (50 requests/s, more than the fleet serves: saturated), with tenants configured
  (``interactive`` and ``batch``); and the same flood with no tenants configured, every request in one
  first-come-first-served queue (what a router without classes does). Reports the interactive tenants' TTFT
  p50/p99 and the batch tenant's served requests per second.
- **weights**: 2 routers on one Redis, one replica set; tenants of weight 3 and 1 in one class, each keeping
  more requests in flight than the fleet serves (closed loop, spread over both routers). Reports the tokens
  (prompt + completion, from the answers' usage) each was served over the measured window, and their ratio.
- **budgets**: 2 routers on one Redis; one tenant limited to 300 requests a minute, another to 60,000 tokens
  a minute, each sending twice that through both routers. After the first 10 s (the buckets' burst spent),
  reports what each was served over the next minute against its limit.

Writes ``loadtest/results/tenants/results.json`` and ``results.md`` and, with the default ``--out`` and every
scenario, its section of ``docs/benchmarks.md``; every process it starts is stopped by its PID; traffic stays on
127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from .cluster_bench import update_readme
from .cluster import Proc, free_ports, redis_server, router, simulator, wait_redis

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


class Outcome:
    __slots__ = ("tenant", "sent_at", "ended_at", "status", "ttft_s", "tokens", "code")

    def __init__(self, tenant: str, sent_at: float) -> None:
        self.tenant, self.sent_at, self.ended_at = tenant, sent_at, 0.0
        self.status, self.ttft_s, self.tokens, self.code = 0, None, 0, ""


async def one(client: httpx.AsyncClient, url: str, tenant: str, prompt: str, max_tokens: int,
              started: float) -> Outcome:
    """A streamed completion for ``tenant``: its status, time to first token and tokens served (usage)."""
    out = Outcome(tenant, time.perf_counter() - started)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"x-kvroute-tenant": tenant}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                text = await r.aread()
                try:
                    out.code = json.loads(text)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    out.code = "?"
                out.ended_at = time.perf_counter() - started
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if out.ttft_s is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    out.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    out.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    except httpx.HTTPError as e:
        out.code = e.__class__.__name__
    out.ended_at = time.perf_counter() - started
    return out


def poisson(rate: float, seconds: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


async def open_loop(urls: list[str], plan: list[tuple[float, str, str, int]]) -> list[Outcome]:
    """Each (at, tenant, prompt, max_tokens) sent at its time, through the routers in turn."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        started = time.perf_counter()

        async def at(i: int, when: float, tenant: str, prompt: str, max_tokens: int) -> Outcome:
            delay = when - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            return await one(client, urls[i % len(urls)], tenant, prompt, max_tokens, started)

        return list(await asyncio.gather(*(at(i, *p) for i, p in enumerate(plan))))


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(words))


class Bench:
    def __init__(self, out: Path, seconds: float) -> None:
        self.out = out
        self.seconds = seconds
        self.procs: list[Proc] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="kvroute-tenants-"))

    def start(self, proc: Proc, path: str = "/health") -> Proc:
        self.procs.append(proc)
        proc.start()
        proc.wait_http(path, timeout=30)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def sims(self, n: int, *args: str) -> list[str]:
        port = free_ports(n)
        self.start(simulator(port, MODEL, "--replicas", str(n), *args, log_dir=self.tmp))
        return [f"http://127.0.0.1:{port + i}" for i in range(n)]

    def router(self, urls: list[str], max_num_seqs: int, config: dict[str, Any], *args: str) -> Proc:
        path = self.tmp / f"router-{len(self.procs)}.yaml"
        path.write_text(yaml.safe_dump({"replicas": [{"url": u, "max_num_seqs": max_num_seqs} for u in urls],
                                        **config}))
        return self.start(router([], "--config", str(path), *args, log_dir=self.tmp), "/ready")

    # -- flood ----------------------------------------------------------------------------------

    def flood(self) -> dict[str, Any]:
        seconds = self.seconds
        rng = random.Random(7)
        interactive: list[tuple[float, str, str, int]] = []
        for i, tenant in enumerate(("chat-a", "chat-b")):
            interactive += [(t, tenant, prompt(rng, 64), 24) for t in poisson(1.25, seconds, seed=i)]
        batch = [(t, "batch-jobs", prompt(rng, 64), 24) for t in poisson(50.0, seconds, seed=9)]
        tenants = {"tenants": [{"name": "chat-a", "class": "interactive"}, {"name": "chat-b", "class": "interactive"},
                               {"name": "batch-jobs", "class": "batch"}]}
        runs = {}
        for label, plan, config in (("alone", interactive, tenants), ("flood, tenants", interactive + batch, tenants),
                                    ("flood, one queue", interactive + batch, {"tenancy": {"header": None}})):
            urls = self.sims(4, "--max-num-seqs", "16", "--ttft-ms", "400", "--itl-ms", "40")
            rt = self.router(urls, 16, config)
            plan = sorted(plan)
            print(f"flood: {label}: {len(plan)} requests over {seconds:g} s", flush=True)
            results = asyncio.run(open_loop([rt.url], plan))
            self.stop()
            chat = [r for r in results if r.tenant != "batch-jobs"]
            ttfts = [r.ttft_s for r in chat if r.ttft_s is not None]
            jobs = [r for r in results if r.tenant == "batch-jobs"]
            done_in_window = [r for r in jobs if r.status == 200 and r.ended_at <= seconds]
            runs[label] = {
                "interactive_requests": len(chat), "interactive_ok": sum(r.status == 200 for r in chat),
                "interactive_ttft_p50_ms": _ms(_pct(ttfts, 50)), "interactive_ttft_p99_ms": _ms(_pct(ttfts, 99)),
                "batch_requests": len(jobs), "batch_ok": sum(r.status == 200 for r in jobs),
                "batch_served_per_s": round(len(done_in_window) / seconds, 2),
                "batch_refused": _codes(jobs),
            }
        alone = runs["alone"]["interactive_ttft_p99_ms"]
        flooded = runs["flood, tenants"]["interactive_ttft_p99_ms"]
        return {"runs": runs, "p99_ratio": round(flooded / alone, 3) if alone and flooded else None}

    # -- weights --------------------------------------------------------------------------------

    def weights(self) -> dict[str, Any]:
        redis = self.start_redis()
        urls = self.sims(4, "--max-num-seqs", "8", "--ttft-ms", "100", "--itl-ms", "20")
        config = {"tenants": [{"name": "heavy", "class": "standard", "weight": 3},
                              {"name": "light", "class": "standard", "weight": 1}]}
        routers = [self.router(urls, 8, config, "--index", redis) for _ in range(2)]
        result = asyncio.run(self._closed([r.url for r in routers], {"heavy": 48, "light": 48}, self.seconds))
        self.stop()
        served = result["tokens"]
        ratio = served["heavy"] / served["light"] if served.get("light") else None
        return {**result, "ratio": round(ratio, 3) if ratio else None}

    async def _closed(self, urls: list[str], concurrency: dict[str, int], seconds: float,
                      warmup: float = 5.0) -> dict[str, Any]:
        """Each tenant keeps ``concurrency[tenant]`` requests in flight for ``warmup + seconds``; counts the tokens
        of the answers that ended inside the last ``seconds``."""
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
        tokens: dict[str, int] = {t: 0 for t in concurrency}
        requests: dict[str, int] = {t: 0 for t in concurrency}
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            started = time.perf_counter()
            end = started + warmup + seconds
            rng = random.Random(3)

            async def worker(tenant: str, i: int) -> None:
                while time.perf_counter() < end:
                    r = await one(client, urls[i % len(urls)], tenant, prompt(rng, 64), 32, started)
                    if r.status != 200:
                        await asyncio.sleep(0.05)
                    if r.status == 200 and time.perf_counter() - started > warmup and time.perf_counter() < end:
                        tokens[tenant] += r.tokens
                        requests[tenant] += 1

            await asyncio.gather(*(worker(t, i) for t, n in concurrency.items() for i in range(n)))
        return {"tokens": tokens, "requests": requests, "seconds": seconds}

    # -- budgets --------------------------------------------------------------------------------

    def budgets(self) -> dict[str, Any]:
        redis = self.start_redis()
        urls = self.sims(4, "--max-num-seqs", "64", "--ttft-ms", "20", "--itl-ms", "5")
        rpm, tpm = 300.0, 60_000.0
        config = {"tenants": [{"name": "by-requests", "class": "standard", "requests_per_minute": rpm},
                              {"name": "by-tokens", "class": "standard", "tokens_per_minute": tpm}]}
        routers = [self.router(urls, 64, config, "--index", redis) for _ in range(2)]
        warmup, window = 10.0, max(60.0, self.seconds)
        rng = random.Random(5)
        # twice the limits: 10 requests/s against 5; requests of ~100 tokens (64 words, 32 completion tokens)
        # at 20/s against 1,000 tokens/s
        plan = [(t, "by-requests", prompt(rng, 64), 32) for t in poisson(2 * rpm / 60, warmup + window, seed=1)]
        plan += [(t, "by-tokens", prompt(rng, 64), 32) for t in poisson(20.0, warmup + window, seed=2)]
        print(f"budgets: {len(plan)} requests over {warmup + window:g} s", flush=True)
        results = asyncio.run(open_loop([r.url for r in routers], sorted(plan)))
        self.stop()
        out: dict[str, Any] = {"window_s": window, "warmup_s": warmup}
        for tenant, limit, unit in (("by-requests", rpm, "requests"), ("by-tokens", tpm, "tokens")):
            inside = [r for r in results if r.tenant == tenant and warmup <= r.sent_at < warmup + window]
            ok = [r for r in inside if r.status == 200]
            served = len(ok) if unit == "requests" else sum(r.tokens for r in ok)
            per_minute = served * 60.0 / window
            out[tenant] = {"limit_per_minute": limit, "unit": unit, "served_per_minute": round(per_minute, 1),
                           "ratio": round(per_minute / limit, 4), "sent": len(inside), "refused": _codes(inside)}
        return out

    def start_redis(self) -> str:
        proc = redis_server(log_dir=self.tmp)
        self.procs.append(proc)
        proc.start()
        wait_redis(proc)
        return f"redis://127.0.0.1:{proc.port}"


def _pct(values: list[float], q: float) -> float | None:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else None


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _codes(results: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            out[r.code or str(r.status)] = out.get(r.code or str(r.status), 0) + 1
    return out


def markdown(results: dict[str, Any], command: str) -> str:
    lines = ["#### Tenants: the latest run", "", f"Reproduce: `{command}`.", ""]
    flood = results.get("flood")
    if flood:
        lines += ["Flood (two interactive tenants at 1.25 requests/s each; one batch tenant at 20x their rate, "
                  "50 requests/s, on 4 stand-in replicas of 16 slots that serve about 47 requests/s):", "",
                  "| run | interactive TTFT p50 / p99 ms | interactive answered | batch served req/s | batch refused |",
                  "|---|---|---|---|---|"]
        for label, r in flood["runs"].items():
            lines.append(f"| {label} | {r['interactive_ttft_p50_ms']} / {r['interactive_ttft_p99_ms']} | "
                         f"{r['interactive_ok']}/{r['interactive_requests']} | {r['batch_served_per_s']} | "
                         f"{r['batch_refused'] or '-'} |")
        lines += ["", f"Interactive TTFT p99 under the flood, tenants configured: {flood['p99_ratio']}x the run "
                  "without it (target <= 1.5).", ""]
    weights = results.get("weights")
    if weights:
        lines += [f"Weights 3:1, two tenants each keeping 48 requests in flight through 2 routers on one Redis "
                  f"(4 replicas of 8 slots), over {weights['seconds']:g} s: tokens served heavy "
                  f"{weights['tokens']['heavy']}, light {weights['tokens']['light']}, ratio {weights['ratio']} "
                  "(target 3 +- 10%).", ""]
    budgets = results.get("budgets")
    if budgets:
        lines += [f"Budgets across 2 routers on one Redis, each tenant sending twice its limit; served over "
                  f"{budgets['window_s']:g} s after the first {budgets['warmup_s']:g} s:", "",
                  "| tenant | limit per minute | served per minute | ratio | refused |", "|---|---|---|---|---|"]
        for tenant in ("by-requests", "by-tokens"):
            b = budgets[tenant]
            lines.append(f"| {tenant} | {b['limit_per_minute']:g} {b['unit']} | {b['served_per_minute']} | "
                         f"{b['ratio']} | {b['refused']} |")
        lines += ["", "Target: within 5% of the limit.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="flood,weights,budgets", help="scenarios, comma-separated")
    p.add_argument("--seconds", type=float, default=60.0, help="length of each measured run")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "tenants")
    args = p.parse_args(argv)
    bench = Bench(args.out, args.seconds)
    results: dict[str, Any] = {}
    try:
        for name in args.only.split(","):
            results[name] = getattr(bench, name)()
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    finally:
        bench.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    command = "python -m loadtest.bench_tenants" + (f" --only {args.only}" if args.only != p.get_default("only")
                                                    else "")
    (args.out / "results.md").write_text(markdown(results, command) + "\n")
    if args.out == p.get_default("out") and args.only == p.get_default("only"):
        update_readme(ROOT / "docs" / "benchmarks.md", "tenants", markdown(results, command), bench="bench")
    print(markdown(results, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
