"""A load generator for OpenAI-compatible endpoints: open loop at given rates, or closed loop.

    python -m loadtest.load --target http://127.0.0.1:8000 --rates 2,4,8 --requests 200 \\
        --workload shared-prefix --groups 8 --prompts-per-group 16 --system-tokens 1024 --question-tokens 64 \\
        --output-tokens 64 [--replicas URL,URL,...] [--out DIR]

Open loop (default): requests start at Poisson arrival times at each offered rate (requests/s),
whatever the answers do, so queueing shows as it would with independent users. ``--closed-loop
--concurrency C`` keeps C requests in flight instead. The request sequence is seeded: every target
gets the same prompts in the same order. ``--warmup N`` sends the sequence's first N requests first,
unmeasured (steady state instead of empty caches).

Workloads, each with the parameters of the tool it comes from, so that results compare:

- ``shared-prefix`` (inference-perf's ``shared_prefix``): groups x prompts per group, each prompt a
  group's system prompt and its own question; groups interleaved;
- ``generated-shared-prefix`` (SGLang's ``generated-shared-prefix``): the same shape, SGLang's defaults;
- ``multi-turn``: conversations whose every turn resends the history plus a new message, with a think
  time between a turn's answer and the next turn;
- ``prefix-repetition`` (vLLM's ``prefix_repetition``): a few prefixes, each prompt one of them plus
  its own suffix;
- ``trace``: a production trace replayed (Mooncake's conversation trace by default, ``loadtest/trace.py``):
  one conversation in ``--trace-sample``, prompts sharing the blocks the trace says they share, arriving at
  the trace's times scaled to each offered rate.

Lengths are in tokens: of the stand-in replica's byte mode by default (4 bytes per token: three
letters and a space), of the tiny model's tokenizer with ``--words tiny-model``; against another
model they are approximate. ``--target`` takes several routers, comma-separated, in turn; ``--pin`` sends
each group (conversation, prefix) to one of them instead, with the replicas as targets a reference
placement that no router stands in front of. Reported
per rate: time to first token p50/p90/p99, inter-token latency p50/p90, end-to-end latency p50/p90,
output tokens/s, requests/s achieved, errors, each replica's share of the requests
(``x-kvroute-replica``), and with ``--replicas`` the prefix-cache hit rate by the replicas' own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import httpx

from . import trace, vllm_cluster
from .tiny_model import WORDS

SYLLABLES = [a + b + c + " " for a in "bcdfgklmnprstvz" for b in "aeiou" for c in "bdgklmnprstx"]
VOCABULARIES = {
    # one token each in the stand-in's byte mode (4 bytes per token): three letters and a space
    "syllables": SYLLABLES,
    # one token each for the tiny model's tokenizer (loadtest/tiny_model.py): a space and a word it learned
    "tiny-model": [" " + w for w in WORDS],
}


def words(rng: random.Random, tokens: int, vocabulary: list[str] = SYLLABLES) -> str:
    """``tokens`` tokens: words of ``vocabulary`` (one of ``VOCABULARIES``), each one token."""
    return "".join(rng.choice(vocabulary) for _ in range(tokens))


@dataclass
class Turn:
    messages: list[dict[str, str]]
    max_tokens: int
    conversation: int = -1  # turns of one conversation go in order, ``think_s`` after the previous answer
    think_s: float = 0.0
    affinity: int = -1  # what its cache depends on: its group, conversation or prefix (``--pin``)
    at_s: float = -1.0  # its arrival in a replayed trace (scaled to the offered rate); -1: Poisson arrivals


def shared_prefix(groups: int, prompts_per_group: int, system_tokens: int, question_tokens: int,
                  output_tokens: int, seed: int = 0, vocabulary: list[str] = SYLLABLES) -> list[Turn]:
    rng = random.Random(seed)
    systems = [words(rng, system_tokens, vocabulary) for _ in range(groups)]
    out = []
    for _ in range(prompts_per_group):
        order = list(range(groups))
        rng.shuffle(order)
        for g in order:
            out.append(Turn([{"role": "system", "content": systems[g]},
                             {"role": "user", "content": words(rng, question_tokens, vocabulary)}], output_tokens,
                            affinity=g))
    return out


def multi_turn(conversations: int, turns: int, system_tokens: int, user_tokens: int, output_tokens: int,
               think_s: float, seed: int = 0, vocabulary: list[str] = SYLLABLES) -> list[Turn]:
    rng = random.Random(seed)
    system = words(rng, system_tokens, vocabulary)
    out = []
    for c in range(conversations):
        history = [{"role": "system", "content": system}]
        for _ in range(turns):
            history.append({"role": "user", "content": words(rng, user_tokens, vocabulary)})
            out.append(Turn(list(history), output_tokens, conversation=c, think_s=think_s, affinity=c))
            history.append({"role": "assistant", "content": words(rng, output_tokens, vocabulary)})
    return out


def replay(every: int, limit: int, vocabulary: list[str] = SYLLABLES, path: Path = trace.TRACE) -> list[Turn]:
    """Mooncake's conversation trace (``loadtest/trace.py``): one conversation in ``every``, the first ``limit``
    requests, each a chat of one user message of the trace's length and shared blocks, arriving as in the trace."""
    texts = trace.Texts(vocabulary)
    return [Turn([{"role": "user", "content": texts.prompt(e)}], max(1, e.output_tokens), affinity=e.conversation,
                 at_s=e.at_s) for e in trace.sample(trace.read(path), every, limit)]


def prefix_repetition(prompts: int, prefixes: int, prefix_tokens: int, suffix_tokens: int, output_tokens: int,
                      seed: int = 0, vocabulary: list[str] = SYLLABLES) -> list[Turn]:
    rng = random.Random(seed)
    heads = [words(rng, prefix_tokens, vocabulary) for _ in range(prefixes)]
    out = []
    for _ in range(prompts):
        h = rng.randrange(prefixes)  # the same draws as rng.choice(heads)
        out.append(Turn([{"role": "user", "content": heads[h] + words(rng, suffix_tokens, vocabulary)}],
                        output_tokens, affinity=h))
    return out


# -- one request ------------------------------------------------------------------------------


@dataclass
class Result:
    sent_at: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    status: int = 0
    error: str | None = None
    replica: str = ""
    predicted_ttft_s: float | None = None  # kvroute's prediction for it (x-kvroute-predicted-ttft-ms)


async def send(client: httpx.AsyncClient, target: str, model: str, turn: Turn, started: float) -> Result:
    body = {"model": model, "messages": turn.messages, "max_tokens": turn.max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = Result(sent_at=time.perf_counter() - started)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", target + "/v1/chat/completions", json=body) as r:
            res.status = r.status_code
            res.replica = r.headers.get("x-kvroute-replica", "")
            predicted = r.headers.get("x-kvroute-predicted-ttft-ms")
            if predicted is not None:
                res.predicted_ttft_s = float(predicted) / 1e3
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk.get("error"))[:200]
                    continue
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", 0)
        res.e2e_s = time.perf_counter() - t0
    except httpx.HTTPError as e:
        res.error = e.__class__.__name__
    return res


# -- a run at one rate ------------------------------------------------------------------------


def arrivals(rate: float, n: int, seed: int, turns: list[Turn] | None = None) -> Iterator[float]:
    """Poisson arrivals at ``rate``; a replayed trace's own arrival times, scaled to ``rate`` on average."""
    if turns and all(t.at_s >= 0 for t in turns):
        t0 = turns[0].at_s
        span = turns[-1].at_s - t0
        scale = len(turns) / rate / span if span > 0 else 0.0
        yield from ((t.at_s - t0) * scale for t in turns)
        return
    rng = random.Random(seed)
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        yield t


class Progress:
    def __init__(self, label: str, total: int, stream: Any = sys.stderr) -> None:
        self.label, self.total, self.done, self.stream = label, total, 0, stream
        self.shown = -1

    def tick(self) -> None:
        self.done += 1
        pct = 100 * self.done // self.total
        if pct != self.shown and self.stream.isatty() or self.done == self.total:
            self.shown = pct
            bar = "#" * (pct // 4)
            self.stream.write(f"\r{self.label} [{bar:<25}] {self.done}/{self.total}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


@dataclass(frozen=True)
class Targets:
    """Where each turn goes. Turn ``i`` goes to ``urls[i % len(urls)]``: with several routers, consecutive turns
    of a conversation meet different ones, as behind a load balancer. Pinned, it goes to
    ``urls[turn.affinity % len(urls)]``: with the replicas as the URLs, every group or conversation stays on
    one replica with no router in between, the placement a cache-aware router aims for, as a reference."""

    urls: list[str]
    pinned: bool = False

    def __call__(self, i: int, turn: Turn) -> str:
        if self.pinned and turn.affinity >= 0:
            return self.urls[turn.affinity % len(self.urls)]
        return self.urls[i % len(self.urls)]


async def run_open(targets: Targets, model: str, turns: list[Turn], rate: float, seed: int,
                   client: httpx.AsyncClient, label: str) -> tuple[list[Result], float]:
    """Each turn starts at its Poisson arrival time; a conversation's next turn waits for the previous
    answer plus the think time (then it is not earlier than its arrival either)."""
    started = time.perf_counter()
    progress = Progress(label, len(turns))
    previous: dict[int, asyncio.Task[Result]] = {}

    async def one(i: int, turn: Turn, at: float, before: asyncio.Task[Result] | None) -> Result:
        if before is not None:
            await before
            await asyncio.sleep(turn.think_s)
        delay = at - (time.perf_counter() - started)
        if delay > 0:
            await asyncio.sleep(delay)
        res = await send(client, targets(i, turn), model, turn, started)
        progress.tick()
        return res

    tasks = []
    for i, (turn, at) in enumerate(zip(turns, arrivals(rate, len(turns), seed, turns))):
        before = previous.get(turn.conversation) if turn.conversation >= 0 else None
        task = asyncio.create_task(one(i, turn, at, before))
        if turn.conversation >= 0:
            previous[turn.conversation] = task
        tasks.append(task)
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - started


async def run_closed(targets: Targets, model: str, turns: list[Turn], concurrency: int,
                     client: httpx.AsyncClient, label: str) -> tuple[list[Result], float]:
    started = time.perf_counter()
    progress = Progress(label, len(turns))
    queue = list(reversed(list(enumerate(turns))))
    results: list[Result] = []

    async def worker() -> None:
        while queue:
            i, turn = queue.pop()
            results.append(await send(client, targets(i, turn), model, turn, started))
            progress.tick()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - started


# -- report -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def counters(replicas: list[str]) -> dict[str, tuple[float, float, float]]:
    """Per replica: prefix-cache hits, queries and finished requests, by its own /metrics."""
    out = {}
    for url in replicas:
        m = vllm_cluster.metrics(url)
        out[url] = (m.get("vllm:prefix_cache_hits_total", 0.0), m.get("vllm:prefix_cache_queries_total", 0.0),
                    m.get("vllm:request_success_total", 0.0))
    return out


@dataclass
class Summary:
    offered_rate: float | None
    concurrency: int | None
    requests: int
    errors: int
    achieved_rps: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    hit_rate: float | None
    share: dict[str, int]
    max_mean_share: float | None
    # the median of |predicted - measured| / measured time to first token, over the answers kvroute predicted
    ttft_prediction_error: float | None = None
    ttft_prediction_ratio: float | None = None  # and the median of measured / predicted (above 1: predicted too soon)


def summarize(results: list[Result], wall: float, rate: float | None, concurrency: int | None,
              hit_rate: float | None, served: dict[str, int] | None = None) -> Summary:
    """``served``: requests per replica by the replicas' counters (any router); else ``x-kvroute-replica``."""
    ok = [r for r in results if r.error is None and r.status == 200]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 2)

    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    errs = [abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in ok
            if r.predicted_ttft_s is not None and r.ttft_s]
    share: dict[str, int] = dict(served or {})
    if not share:
        for r in results:
            if r.replica:
                share[r.replica] = share.get(r.replica, 0) + 1
    return Summary(rate, concurrency, len(results), len(results) - len(ok), round(len(ok) / wall, 3),
                   round(sum(r.output_tokens for r in ok) / wall, 1), ms(pct(ttft, 50)), ms(pct(ttft, 90)),
                   ms(pct(ttft, 99)), ms(pct(itl, 50)), ms(pct(itl, 90)), ms(pct(itl, 99)), ms(pct(e2e, 50)),
                   ms(pct(e2e, 90)),
                   None if hit_rate is None else round(hit_rate, 4), dict(sorted(share.items())),
                   round(max(share.values()) / statistics.mean(share.values()), 3) if share else None,
                   round(statistics.median(errs), 4) if errs else None,
                   round(statistics.median(r.ttft_s / r.predicted_ttft_s for r in ok
                                           if r.predicted_ttft_s and r.ttft_s), 4) if errs else None)


def markdown(title: str, rows: list[Summary]) -> str:
    head = ("| offered | requests/s | output tokens/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | "
            "end-to-end p50 / p90 ms | hit rate | max/mean share | errors |")
    lines = [f"### {title}", "", head, "|" + "---|" * 9]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    for s in rows:
        offered = f"{s.offered_rate:g} req/s" if s.offered_rate is not None else f"{s.concurrency} in flight"
        lines.append(f"| {offered} | {f(s.achieved_rps)} | {f(s.output_tokens_per_s)} | {f(s.ttft_p50_ms)} / "
                     f"{f(s.ttft_p90_ms)} / {f(s.ttft_p99_ms)} | {f(s.itl_p50_ms)} / {f(s.itl_p90_ms)} / {f(s.itl_p99_ms)} | "
                     f"{f(s.e2e_p50_ms)} / {f(s.e2e_p90_ms)} | {f(s.hit_rate)} | {f(s.max_mean_share)} | {s.errors} |")
    return "\n".join(lines) + "\n"


def build_workload(args: argparse.Namespace) -> list[Turn]:
    w = args.workload
    vocab = VOCABULARIES[args.words]
    if w == "shared-prefix":
        return shared_prefix(args.groups, args.prompts_per_group, args.system_tokens, args.question_tokens,
                             args.output_tokens, args.seed, vocab)
    if w == "generated-shared-prefix":  # SGLang's defaults unless given
        return shared_prefix(args.groups or 64, args.prompts_per_group or 16, args.system_tokens or 2048,
                             args.question_tokens or 128, args.output_tokens or 256, args.seed, vocab)
    if w == "multi-turn":
        return multi_turn(args.conversations, args.turns, args.system_tokens, args.question_tokens,
                          args.output_tokens, args.think_s, args.seed, vocab)
    if w == "trace":
        return replay(args.trace_sample, args.requests or 0, vocab, args.trace_file)
    return prefix_repetition(args.requests or 256, args.prefixes, args.system_tokens, args.question_tokens,
                             args.output_tokens, args.seed, vocab)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    turns = build_workload(args)
    targets = Targets([u for u in args.target.split(",") if u], args.pin)
    # the warm-up leaves prompts in the caches and in the routers' indexes: one output token does that
    warmup, turns = [replace(t, max_tokens=1) for t in turns[:args.warmup]], turns[args.warmup:]
    if args.requests:
        turns = turns[:args.requests]
    replicas = [u for u in (args.replicas or "").split(",") if u]
    rows: list[Summary] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s), limits=limits) as client:
        plans: list[tuple[float | None, int | None]] = (
            [(None, args.concurrency)] if args.closed_loop else [(float(r), None) for r in args.rates.split(",")])
        if warmup:  # not measured: the caches hold what these leave, and the routers know it
            await run_closed(targets, args.model, warmup, min(8, len(warmup)), client, "warm-up")
        for rate, concurrency in plans:
            before = counters(replicas) if replicas else {}
            label = f"{rate:g} req/s" if rate is not None else f"{concurrency} in flight"
            if rate is not None:
                results, wall = await run_open(targets, args.model, turns, rate, args.seed, client, label)
            else:
                assert concurrency is not None
                results, wall = await run_closed(targets, args.model, turns, concurrency, client, label)
            hit = None
            served = None
            if replicas:
                after = counters(replicas)
                hits = sum(after[u][0] - before[u][0] for u in replicas)
                queries = sum(after[u][1] - before[u][1] for u in replicas)
                hit = hits / queries if queries else None
                served = {u.split("//")[-1]: int(after[u][2] - before[u][2]) for u in replicas}
            rows.append(summarize(results, wall, rate, concurrency, hit, served))
    return {"workload": args.workload, "target": args.target, "rows": [asdict(r) for r in rows],
            "markdown": markdown(f"{args.workload} against {args.target}", rows)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="base URL of the router (or of a replica); several, "
                   "comma-separated, take turns")
    p.add_argument("--pin", action="store_true", help="send each group's (conversation's, prefix's) requests to one "
                   "target, the group's number modulo the targets: with the replicas as --target, the placement a "
                   "cache-aware router aims for, without a router (a reference)")
    p.add_argument("--words", choices=sorted(VOCABULARIES), default="syllables", help="prompt words, one token "
                   "each: syllables for the stand-in's byte mode, tiny-model for the tiny model's tokenizer")
    p.add_argument("--model", default="tiny")
    p.add_argument("--replicas", help="comma-separated replica URLs: the hit rate from their /metrics")
    p.add_argument("--rates", default="1,2,4", help="offered loads in requests/s, one run each (open loop)")
    p.add_argument("--closed-loop", action="store_true", help="keep --concurrency requests in flight instead")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, help="requests per run (default: the whole workload)")
    p.add_argument("--workload", default="shared-prefix",
                   choices=["shared-prefix", "generated-shared-prefix", "multi-turn", "prefix-repetition", "trace"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1024, help="system prompt (or prefix) length")
    p.add_argument("--question-tokens", type=int, default=64, help="question (user message, suffix) length")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think-s", type=float, default=1.0, help="multi-turn: pause between an answer and the next turn")
    p.add_argument("--prefixes", type=int, default=8, help="prefix-repetition: distinct prefixes")
    p.add_argument("--trace-file", type=Path, default=trace.TRACE, help="trace: a Mooncake-format trace (JSON "
                   "lines, .gz or not; default: Mooncake's conversation trace, loadtest/traces/)")
    p.add_argument("--trace-sample", type=int, default=10, help="trace: replay one conversation in N")
    p.add_argument("--warmup", type=int, default=0, help="send the workload's first N requests first, 8 at a "
                   "time and one output token each, unmeasured (with shared-prefix, the number of groups warms every "
                   "group's prefix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, help="write results.json and results.md here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = asyncio.run(run(args))
    print(out["markdown"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(out, indent=2))
        (args.out / "results.md").write_text(out["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
