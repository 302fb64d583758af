"""Hit rate on real vLLM: routing policies compared by vLLM's own prefix-cache counters.

    python -m loadtest.bench_vllm [--quick] [--out loadtest/RESULTS.md]

Starts 3 vLLM CPU replicas of the project's tiny Llama (``deploy/setup-vllm.sh``) with small KV
caches, so that each workload's prefix working set is larger than one replica's cache and smaller
than the three together, then runs two workloads built with the tiny model's tokenizer (exact
token counts) through kvroute under each policy:

- ``shared-prefix``: groups of requests sharing a long system prompt, each with its own question;
- ``multi-turn``: conversations whose turn n+1 resends turn n with one more exchange, all under
  one short application system prompt; turn t of every conversation forms round t, rounds in a new
  random order each, one after the other;
- ``multi-turn, larger than the caches``: twice the conversations, whose histories need more than the
  three caches hold, so the replicas evict;

and each of them again with 30% of the requests sent straight to a random replica (``bypass``: another
client, a batch job, a router without the shared index), which only the replicas' KV-cache events
reveal to the router.

The replicas publish KV-cache events (``--kv-events-config``, with a replay endpoint). Policies:
round-robin, least-loaded, cache-aware with the precise index (the events; nothing configured:
the router finds the event sources and the model's tokenizer in the folder the replicas report) in
process and in Redis shared by two router processes (clients alternate between them), cache-aware
with the approximate index (``kv_events.enabled: false``: the router's own decisions), and
cache-aware in byte mode (``prefix.tokenizer: none``, bytes per token learned from the replicas'
answers; events cannot be matched to bytes, so it is approximate too). Between runs every replica's
prefix cache is reset (``/reset_prefix_cache``, then a one-token prompt so that vLLM publishes the reset
before the next routers start) and the routers are new.

The hit rate is delta(``vllm:prefix_cache_hits_total``) / delta(``vllm:prefix_cache_queries_total``)
summed over the replicas (every request, bypassing or not). Predictions are compared, request by
request, with vLLM's ``usage.prompt_tokens_details.cached_tokens`` of the routed requests. For the same request sequence (in the order it was sent) the report also
gives the hit rate of one infinite cache and of one LRU cache as large as the whole cluster, and a
sequential model of the same requests on one LRU cache per replica, routed by the longest cached prefix
as the caches are (precise) and as the router's own requests left them (approximate): the reference
for what the events can gain over the approximate index on that sequence.
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router.tokenizer import LocalTokenizer

from . import vllm_cluster
from .cluster import Proc, redis_server, router, wait_redis
from .simulator import PrefixCache

BLOCK = 128


# -- workloads ---------------------------------------------------------------------------------

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text_of_tokens(tok: LocalTokenizer, rng: random.Random, n_tokens: int, head: str = "") -> str:
    """Random words, exactly ``n_tokens`` tokens long (encoded without special tokens)."""
    words = [head] if head else []
    while len(tok.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words.append(rng.choice(WORDS))
    s = " ".join(words)
    ids = tok.encode(s, add_special_tokens=False)
    while len(ids) > n_tokens:  # the last word may have added more than one token
        s = s[:-1]
        ids = tok.encode(s, add_special_tokens=False)
    return s


@dataclass
class Conversation:
    """A sequence of requests sent one after the other (one request for shared-prefix)."""

    turns: list[list[dict[str, str]]]
    label: str


def shared_prefix(tok: LocalTokenizer, groups: int, prompts: int, system_tokens: int, question_tokens: int,
                  seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    systems = [text_of_tokens(tok, rng, system_tokens, f"group {g}:") for g in range(groups)]
    out = []
    for p in range(prompts):
        order = list(range(groups))
        rng.shuffle(order)
        for g in order:
            q = text_of_tokens(tok, rng, question_tokens, f"q{p}:")
            out.append(Conversation([[{"role": "system", "content": systems[g]}, {"role": "user", "content": q}]],
                                    f"g{g}"))
    return out


def multi_turn(tok: LocalTokenizer, conversations: int, turns: int, system_tokens: int, user_tokens: int,
               reply_tokens: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    system = text_of_tokens(tok, rng, system_tokens, "assistant for all users:")
    out = []
    for c in range(conversations):
        history = [{"role": "system", "content": system}]
        conv = []
        for t in range(turns):
            history.append({"role": "user", "content": text_of_tokens(tok, rng, user_tokens, f"user {c} turn {t}:")})
            conv.append(list(history))
            history.append({"role": "assistant", "content": text_of_tokens(tok, rng, reply_tokens)})
        out.append(Conversation(conv, f"c{c}"))
    return out


# -- bounds ------------------------------------------------------------------------------------


def bound_hit_rate(prompts: list[list[int]], capacity_blocks: int | None) -> float:
    """Hit rate of one vLLM prefix cache of ``capacity_blocks`` blocks (``None``: infinite) over the
    prompts in order, modelled as the stand-in replica models it (``loadtest.simulator.PrefixCache``)."""
    cache = PrefixCache(block_size=BLOCK, num_blocks=capacity_blocks or 10**12)
    hits = sum(cache.admit(ids) for ids in prompts)
    queries = sum(len(ids) for ids in prompts)
    return hits / queries if queries else 0.0


def sequential_hit_rates(prompts: list[list[int]], bypass_to: list[int | None], blocks: list[int]) -> dict[str, float]:
    """The request sequence replayed one request at a time on one LRU cache per replica, routed two ways:
    ``precise`` sends each routed request to the replica whose cache holds its longest prefix, as the
    cache is (what the KV-cache events show); ``approximate`` to the longest prefix among what this
    router sent, trimmed like vLLM (what the router can know without events). Bypassing requests
    (``bypass_to``: the replica they went to, ``None`` for routed ones) go where they went. Ties go to the
    replica with the fewest routed requests. The reference for the measured precise / approximate gap."""
    out = {}
    for mode in ("precise", "approximate"):
        real = [PrefixCache(BLOCK, n, seed=0) for n in blocks]
        known = real if mode == "precise" else [PrefixCache(BLOCK, n, seed=0) for n in blocks]
        routed = [0] * len(blocks)
        hits = 0
        for ids, to in zip(prompts, bypass_to):
            if to is None:
                to = max(range(len(blocks)), key=lambda i: (known[i].lookup(ids), -routed[i], -i))
                routed[to] += 1
                if known is not real:
                    known[to].admit(ids)
            hits += real[to].admit(ids)
        queries = sum(len(ids) for ids in prompts)
        out[mode] = hits / queries if queries else 0.0
    return out


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Sent:
    messages: list[dict[str, str]]
    router: int  # -1: sent straight to a replica (bypass)
    replica: str = ""
    predicted: int = 0
    prompt_tokens: int = 0
    cached: int = 0  # vLLM's usage.prompt_tokens_details.cached_tokens
    ttfb_s: float = 0.0
    total_s: float = 0.0
    ok: bool = False


@dataclass
class RunResult:
    policy: str
    hit_rate: float
    hits: float
    queries: float
    predicted: int
    requests_by_replica: dict[str, int]
    sent: list[Sent] = field(repr=False)
    wall_s: float = 0.0

    @property
    def max_share(self) -> float:
        counts = list(self.requests_by_replica.values())
        return max(counts) / statistics.mean(counts) if counts else 0.0

    @property
    def routed(self) -> list[Sent]:
        return [s for s in self.sent if s.router >= 0]

    @property
    def predicted_ratio(self) -> float:
        measured = sum(s.cached for s in self.routed)
        return sum(s.predicted for s in self.routed) / measured if measured else float("nan")

    @property
    def exact_share(self) -> float:
        """Routed requests whose predicted cached tokens were vLLM's own figure."""
        routed = self.routed
        return sum(1 for s in routed if s.predicted == s.cached) / len(routed) if routed else float("nan")

    def latency(self, q: float, attr: str = "ttfb_s") -> float:
        v = sorted(getattr(s, attr) for s in self.sent if s.ok)
        return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))] * 1e3 if v else float("nan")


async def drive(routers: list[str], conversations: list[Conversation], clients: int, max_tokens: int,
                seed: int = 0, bypass: float = 0.0, replicas: list[str] | None = None) -> list[Sent]:
    """Send the conversations' turns in rounds, ``clients`` requests at a time.

    Round t holds turn t of every conversation that has one; round 0 keeps the workload's order,
    later rounds come in a new random order (seeded) and start once the previous round is done, so
    turn t+1 never overtakes turn t and no policy profits from a fixed arrival pattern (with a
    fixed order, round robin would send every turn of a conversation to one replica whenever the
    number of conversations is a multiple of the number of replicas). A share ``bypass`` of the
    requests (the same ones for every policy) goes straight to a random replica instead.
    """
    rng = random.Random(seed)
    direct = random.Random(seed + 1)
    sent: list[Sent] = []
    rounds = max(len(c.turns) for c in conversations)
    # idle connections are dropped before vLLM closes them (5 s): a request sent on one as it closes fails
    limits = httpx.Limits(max_connections=clients * 2, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        for t in range(rounds):
            queue = deque(c for c in range(len(conversations)) if t < len(conversations[c].turns))
            if t:
                rng.shuffle(queue)

            async def worker() -> None:
                while queue:
                    c = queue.popleft()
                    if replicas and direct.random() < bypass:
                        url = direct.choice(replicas)
                        s = Sent(conversations[c].turns[t], router=-1, replica=url.split("//")[-1])
                    else:
                        s = Sent(conversations[c].turns[t], router=len(sent) % len(routers))
                        url = routers[s.router]
                    sent.append(s)
                    await send(http, url, s, max_tokens)

            await asyncio.gather(*(worker() for _ in range(clients)))
    return sent


async def send(http: httpx.AsyncClient, url: str, s: Sent, max_tokens: int) -> None:
    body = {"model": vllm_cluster.MODEL_NAME, "messages": s.messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        s.replica = r.headers.get("x-kvroute-replica", s.replica)
        s.predicted = int(r.headers.get("x-kvroute-cached-tokens", "0") or 0)
        last = b""
        async for line in r.aiter_lines():
            if line.startswith("data: {") and not s.ttfb_s:
                s.ttfb_s = time.perf_counter() - t0
            if line.startswith("data: {"):
                last = line[6:].encode()
        s.total_s = time.perf_counter() - t0
        s.ok = r.status_code == 200 and bool(last)
        if last:
            usage = json.loads(last).get("usage") or {}
            s.prompt_tokens = usage.get("prompt_tokens", 0)
            s.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def counters(replicas: list[str]) -> dict[str, tuple[float, float]]:
    out = {}
    for url in replicas:
        m = vllm_cluster.metrics(url)
        out[url.split("//")[-1]] = (m["vllm:prefix_cache_hits_total"], m["vllm:prefix_cache_queries_total"])
    return out


def reset(replicas: list[str]) -> None:
    """Empty every replica's prefix cache, and make it say so on its KV-event stream.

    vLLM queues the ``AllBlocksCleared`` of a reset until its next engine step; a router started before
    that step replays the blocks of the previous run and predicts hits that are gone. A one-token prompt
    (no full block, so nothing cached) runs that step."""
    for url in replicas:
        httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
        httpx.post(url + "/v1/completions", json={"model": vllm_cluster.MODEL_NAME, "prompt": "a", "max_tokens": 1},
                   timeout=60).raise_for_status()


async def run_policy(name: str, args: list[str], routers_n: int, replicas: list[str], convs: list[Conversation],
                     clients: int, max_tokens: int, log_dir: Path, bypass: float = 0.0) -> RunResult:
    reset(replicas)
    procs = [router(replicas, *args, "--log-json", log_dir=log_dir, name=f"router-{name}-{i}").start()
             for i in range(routers_n)]
    try:
        for p in procs:
            p.wait_http("/ready", timeout=30)
        await settled(procs, args)
        before = counters(replicas)
        t0 = time.perf_counter()
        sent = await drive([p.url for p in procs], convs, clients, max_tokens, bypass=bypass, replicas=replicas)
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.2)
        after = counters(replicas)
    finally:
        for p in procs:
            p.stop()
    hits = sum(after[r][0] - before[r][0] for r in after)
    queries = sum(after[r][1] - before[r][1] for r in after)
    by_replica = {r: sum(1 for s in sent if s.replica == r and s.router >= 0) for r in after}
    failed = [s for s in sent if not s.ok]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} of {len(sent)} requests failed")
    return RunResult(name, hits / queries if queries else 0.0, hits, queries, sum(s.predicted for s in sent),
                     by_replica, sent, wall)


async def settled(procs: list[Proc], args: list[str]) -> None:
    """Until every router reports its index mode for every replica as the run expects (precise unless the
    run turned events off or keys bytes), so no run measures a router still finding its event sources."""
    want = "approximate" if any(a in ("kv_events.enabled=false", "prefix.tokenizer=none") for a in args) else "precise"
    if "--policy" in args and args[args.index("--policy") + 1] != "cache-aware":
        return
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            views = [(await http.get(p.url + "/admin/replicas")).json()["replicas"] for p in procs]
            if all(r.get("index", {}).get("mode") == want for v in views for r in v):
                return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the routers' index never became {want}")


# -- report ------------------------------------------------------------------------------------


def table(workload: str, desc: str, results: list[RunResult], infinite: float, cluster: float,
          replica_blocks: list[int], model: dict[str, float]) -> list[str]:
    rr = next((r.hit_rate for r in results if r.policy == "round-robin"), float("nan"))
    lines = [f"### {workload}", "", desc, "",
             f"Bounds for the same request sequence: one infinite cache {infinite:.3f}; one LRU cache of the "
             f"cluster's {sum(replica_blocks)} blocks ({' + '.join(map(str, replica_blocks))}) {cluster:.3f}. "
             f"Sent one at a time to one LRU cache per replica, by the longest cached prefix: {model['precise']:.3f} "
             f"as the caches are (precise), {model['approximate']:.3f} as this router's own requests left them "
             f"(approximate), {model['precise'] / model['approximate'] - 1:+.1%}.", "",
             "| policy | hit rate (vLLM) | of cluster bound | x round robin | routed requests per replica "
             "| max/mean share | predicted / measured cached tokens | exact predictions | TTFB p50 / p99 ms | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.hit_rate:.3f} | {r.hit_rate / cluster:.0%} | {r.hit_rate / rr:.2f}x | "
            f"{' / '.join(str(v) for v in r.requests_by_replica.values())} | {r.max_share:.2f} | "
            f"{r.predicted_ratio:.3f} | {r.exact_share:.0%} | "
            f"{r.latency(50):.0f} / {r.latency(99):.0f} | {r.wall_s:.0f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run (for trying the setup)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--num-gpu-blocks", type=int, default=104, help="KV blocks per replica (128 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the report here (e.g. loadtest/RESULTS.md)")
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    ap.add_argument("--use", nargs="+", metavar="URL", help="running replicas to use instead of starting 3 (vLLM "
                    "with VLLM_SERVER_DEV_MODE=1, e.g. from python -m loadtest.vllm_cluster --dev-mode)")
    ap.add_argument("--workload", action="append", help="only workloads whose name contains this")
    ap.add_argument("--policy", action="append", help="only policies whose name contains this")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="passed to every router (kvroute serve --set), to try a knob")
    args = ap.parse_args(argv)

    home = vllm_cluster.setup()
    model = vllm_cluster.model_dir(home)
    tok = LocalTokenizer(model)
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-bench-vllm-"))
    q = args.quick
    workloads: dict[str, tuple[list[Conversation], str]] = {
        "shared-prefix": (
            shared_prefix(tok, 8 if q else 30, 4 if q else 16, 1024, 64, args.seed),
            f"{8 if q else 30} groups x {4 if q else 16} prompts: a 1024-token system prompt per group (8 blocks) "
            "and a 64-token question, rounds over the groups in a new random order each time."),
        "multi-turn": (
            multi_turn(tok, 6 if q else 21, 4 if q else 6, 64, 128, 128, args.seed),
            f"{6 if q else 21} conversations x {4 if q else 6} turns under one 64-token system prompt; each turn adds "
            "a 128-token user message and resends the previous 128-token assistant reply; round t (turn t of every "
            "conversation) comes in a new random order once round t-1 is done."),
        "multi-turn, larger than the caches": (
            multi_turn(tok, 12 if q else 42, 4 if q else 6, 64, 128, 128, args.seed),
            f"The multi-turn workload with {12 if q else 42} conversations: their histories need {{need:.1f}} times the "
            "cluster's KV cache, so the replicas evict."),
    }
    for wl, (convs, desc) in workloads.items():  # how much of the cluster's cache each workload's histories need
        need = sum(len(tok.encode(tok.render_chat(c.turns[-1]), add_special_tokens=False)) // BLOCK for c in convs)
        workloads[wl] = (convs, desc.replace("{need:.1f}", f"{need / (3 * args.num_gpu_blocks):.1f}"))
    for wl in list(workloads):
        convs, desc = workloads[wl]
        workloads[f"{wl}, 30% bypass"] = (convs, desc + " 30% of the requests (the same ones in every run) go "
                                          "straight to a random replica, not through the router.")
    tokenizer: list[str] = []  # the default (prefix.tokenizer: auto) finds the model's folder the replicas report
    knobs = [a for kv in args.set for a in ("--set", kv)]
    started: list[Proc] = [] if args.use else vllm_cluster.start_for_benchmarks(home, 3, args.num_gpu_blocks, log_dir)
    replicas = args.use or [p.url for p in started]
    blocks = [int(vllm_cluster.cache_config(url)["num_gpu_blocks"]) for url in replicas]
    report: list[str] = []
    raw: dict[str, Any] = {}
    redis = redis_server(log_dir=log_dir).start()
    try:
        wait_redis(redis)
        for wl, (convs, desc) in workloads.items():
            if args.workload and not any(f in wl for f in args.workload):
                continue
            ns = "bench-" + "".join(ch for ch in wl if ch.isalnum())
            policies = [
                ("round-robin", ["--policy", "round-robin", *tokenizer], 1),
                ("least-loaded", ["--policy", "least-loaded", *tokenizer], 1),
                ("cache-aware, precise, memory index", ["--policy", "cache-aware", *tokenizer], 1),
                ("cache-aware, precise, Redis index, 2 routers",
                 ["--policy", "cache-aware", "--index", f"redis://127.0.0.1:{redis.port}/0",
                  "--set", f"index.namespace={ns}", *tokenizer], 2),
                ("cache-aware, approximate, memory index",
                 ["--policy", "cache-aware", "--set", "kv_events.enabled=false", *tokenizer], 1),
                ("cache-aware, byte mode (no tokenizer)", ["--policy", "cache-aware", "--set", "prefix.tokenizer=none"],
                 1),
            ]
            bypass = 0.3 if "bypass" in wl else 0.0
            results = []
            for name, pargs, n in policies:
                if args.policy and not any(f in name for f in args.policy):
                    continue
                r = asyncio.run(run_policy(name.split(",")[0].replace(" ", "-"), pargs + knobs, n, replicas, convs,
                                           args.clients, 4, log_dir, bypass))
                r.policy = name
                results.append(r)
                sys.stderr.write(f"{wl} / {name}: hit rate {r.hit_rate:.3f}, share {r.requests_by_replica}, "
                                 f"predicted/measured {r.predicted_ratio:.3f}, exact {r.exact_share:.0%}, "
                                 f"{r.wall_s:.0f} s\n")
            # bounds over the sequence the cache-aware (memory) run sent
            order = next((r for r in results if r.policy.startswith("cache-aware, precise, memory")), results[0]).sent
            prompts = [tok.encode(tok.render_chat(s.messages), add_special_tokens=False) for s in order]
            assert all(len(p) == s.prompt_tokens for p, s in zip(prompts, order)), "tokenizer disagrees with vLLM"
            infinite = bound_hit_rate(prompts, None)
            cluster = bound_hit_rate(prompts, sum(blocks))
            one = bound_hit_rate(prompts, max(blocks))
            hosts = [url.split("//")[-1] for url in replicas]
            model = sequential_hit_rates(prompts, [hosts.index(s.replica) if s.router < 0 else None for s in order],
                                         blocks)
            report += table(wl, desc + f" One replica's cache alone would reach {one:.3f}.", results, infinite,
                            cluster, blocks, model)
            raw[wl] = {"bounds": {"infinite": infinite, "cluster": cluster, "one_replica": one},
                       "sequential_model": model,
                       "runs": [{"policy": r.policy, "hit_rate": r.hit_rate, "hits": r.hits, "queries": r.queries,
                                 "predicted": r.predicted, "predicted_ratio": r.predicted_ratio,
                                 "exact_share": r.exact_share, "requests_by_replica": r.requests_by_replica,
                                 "ttfb_p50_ms": r.latency(50), "ttfb_p99_ms": r.latency(99), "wall_s": r.wall_s}
                                for r in results]}
    finally:
        redis.stop()
        for p in started:
            p.stop(timeout=15)
    head = ["# Real-vLLM results", "",
            f"Produced by `python -m loadtest.bench_vllm{' --quick' if q else ''} --out loadtest/RESULTS.md` "
            f"on 2 CPU cores: {len(replicas)} vLLM {vllm_version(home)} CPU replicas of the project's tiny Llama, "
            f"with {' / '.join(map(str, blocks))} KV blocks of {BLOCK} tokens, {args.clients} concurrent clients, streaming chat "
            "requests of 4 output tokens, the replicas publishing KV-cache events. Hit rates are vLLM's own counters: "
            "delta(prefix_cache_hits) / delta(prefix_cache_queries) over the three replicas, every request counted. "
            "Over the requests that went through kvroute: \"predicted / measured\" is the sum of kvroute's "
            "`x-kvroute-cached-tokens` over the sum of vLLM's `cached_tokens`, \"exact predictions\" the share of "
            "requests where the two were equal, and the share per replica counts only them.", ""]
    text = "\n".join(head + report)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2))
    return 0


def vllm_version(home: Path) -> str:
    for d in (home / "venv" / "lib").glob("python*/site-packages/vllm-*+cpu.dist-info"):
        return d.name.removeprefix("vllm-").removesuffix(".dist-info")
    return "?"


if __name__ == "__main__":
    sys.exit(main())
