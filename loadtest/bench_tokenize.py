"""What long prompts cost the router with the model's tokenizer: keys of long shared prompts, a growing
conversation, and a first-seen 100,000-token prompt among other requests.

    python -m loadtest.bench_tokenize [--requests 200] [--out loadtest/results/tokenize]

Four parts, with the tiny model's tokenizer (what the router uses wherever it finds the model's):

1. **Shared long prompts** (in process): completions prompts of ~12,000 tokens from 16 groups, each
   sharing its first ~11,000 tokens with the earlier prompts of its group; the prompt key's time per
   request, p50/p99, with reuse (the default: incremental encoding and pieces) and encoding whole.
2. **A growing conversation** (in process): 8 chats of 20 turns of ~2,000 tokens (the first: a system
   prompt and the user's message; each later one: the assistant's answer and the user's next message); the prompt key's time per turn (median over the chats),
   and turn 20's against turn 1's. Then the whole decision per turn (the key, the index lookup over 4 replicas,
   the choice and the record), in process through the router's own components, for 16 such chats side by side:
   the CPU of every thread (a long prompt is keyed on one).
3. **A first-seen long prompt beside other requests** (over HTTP): a router given the tiny tokenizer in
   front of 4 instant replicas (the simulator, counting tokens by bytes), 32 clients sending
   short chats through the router for ``--seconds``; the same again with a distinct first-seen
   ~100,000-token completions prompt every second, sent straight to a replica (the reference: what such
   prompts cost the stand-ins, the client and the machine), then through the router. The short requests'
   p50/p99/max, and what the router's keying of the long prompts added to their p99 over the reference.
4. **Growing conversations through the router** (over HTTP): ``--groups`` groups of 16 chats as in part 2 (20 turns
   of ~2,000 tokens), sent one request at a time through a router in front of 4 instant replicas; the router
   process's CPU per request at each turn (its threads' time on the CPU, from ``/proc``), and turn 20's against
   turn 1's. Once with the tiny tokenizer (the router's default wherever it finds the model's), once keyed by
   bytes (no tokenizer): what grows with the history outside tokenizing.

Writes ``results.json`` and ``results.md`` to ``--out``. Every process it starts is stopped by its PID;
traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench_overhead import pct
from .cluster import HTTP, Proc, free_port, free_ports, router, simulator
from .h1client import H1Connection
from .load import VOCABULARIES, words
from .tiny_model import write_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def shared_prompts(folder: Path, requests: int, reuse: bool, seed: int = 0) -> dict[str, float]:
    from router.prefix import key_for
    from router.tokenizer import LocalTokenizer

    tok = LocalTokenizer(folder, reuse=reuse)
    rng = random.Random(seed)
    vocab = VOCABULARIES["tiny-model"]
    heads = [words(rng, 11_000, vocab) for _ in range(16)]
    times = []
    for i in range(requests):
        body = {"model": "m", "prompt": heads[rng.randrange(16)] + words(rng, 1_000, vocab)}
        times.append(_timed(lambda: key_for("/v1/completions", body, "m", tokenizer=tok)))
    warm = times[16:]  # each head seen once first
    return {"p50_ms": pct(warm, 50) * 1e3, "p99_ms": pct(warm, 99) * 1e3, "mean_ms": statistics.mean(warm) * 1e3,
            "prompt_tokens": len(tok.encode(heads[0] + words(rng, 1_000, vocab)))}


Chat = list[dict[str, str]]


def new_chat(rng: random.Random, name: str) -> Chat:
    """A conversation's start: its system prompt (~1,000 words of the tiny model's vocabulary)."""
    return [{"role": "system", "content": f"chat {name}: " + words(rng, 1_000, VOCABULARIES["tiny-model"])}]


def next_turn(rng: random.Random, chat: Chat) -> None:
    """The chat's next turn (~2,000 tokens): the assistant's answer to the last message, if any, and the user's next."""
    vocab = VOCABULARIES["tiny-model"]
    if chat[-1]["role"] == "user":
        chat.append({"role": "assistant", "content": words(rng, 1_000, vocab)})
    chat.append({"role": "user", "content": words(rng, 1_000, vocab)})


def conversation(folder: Path, chats: int, turns: int, reuse: bool, seed: int = 0) -> dict[str, Any]:
    from router.prefix import key_for
    from router.tokenizer import LocalTokenizer

    tok = LocalTokenizer(folder, reuse=reuse)
    rng = random.Random(seed)
    per_turn: list[list[float]] = [[] for _ in range(turns)]
    tokens = 0
    for c in range(chats):
        messages = new_chat(rng, str(c))
        for t in range(turns):
            next_turn(rng, messages)
            body = {"model": "m", "messages": list(messages)}
            per_turn[t].append(_timed(lambda: key_for("/v1/chat/completions", body, "m", tokenizer=tok)))
        tokens = len(tok.encode(tok.render_chat(messages), add_special_tokens=False))
    medians = [statistics.median(ts) * 1e3 for ts in per_turn]
    return {"turn_ms": medians, "last_over_first": medians[-1] / medians[0], "last_turn_tokens": tokens}


def decisions(folder: Path, chats: int, turns: int, seed: int = 0) -> dict[str, Any]:
    """CPU per routing decision at each turn (the prompt key, the index lookup, the choice and the record), in
    process, through the components a router process assembles, 4 replicas, ``chats`` conversations side by side."""
    from router.config import RouterConfig
    from router.gateway import Gateway
    from router.request import RouteRequest

    config = RouterConfig.model_validate({
        "replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["tiny"], "block_size": 16,
                      "num_gpu_blocks": 100_000} for i in range(4)],
        "kv_events": {"enabled": False}, "prefix": {"tokenizer": str(folder)}})
    gw = Gateway(config)
    for r in gw.pool:
        gw.pool.health.mark_success(r)
    rng = random.Random(seed)
    per_turn: list[list[float]] = [[] for _ in range(turns)]

    async def run() -> None:
        await gw.decider.start()
        try:
            for counted in (False, True):  # the first round warms the tokenizer's first checks and the code paths
                histories = [new_chat(rng, f"{counted}.{c}") for c in range(chats)]
                for t in range(turns if counted else 2):
                    for h in histories:
                        next_turn(rng, h)
                        payload = {"model": "tiny", "max_tokens": 1, "messages": list(h)}
                        started = time.process_time()  # every thread's: a long prompt is keyed on one
                        req = RouteRequest(model="tiny", request_id="bench", endpoint="/v1/chat/completions",
                                           payload=payload, body_size=0)
                        ticket = await gw.decider.route(req)
                        ticket.finish(200)
                        if counted:
                            per_turn[t].append(time.process_time() - started)
        finally:
            await gw.decider.close()

    asyncio.run(run())
    medians = [statistics.median(ts) * 1e3 for ts in per_turn]
    return {"turn_ms": medians, "last_over_first": medians[-1] / medians[0]}


async def _drive(port: int, short: list[bytes], long: list[bytes], seconds: float,
                 concurrency: int, long_port: int | None = None) -> tuple[list[float], int, int]:
    latencies: list[float] = []
    failed = 0
    stop = time.monotonic() + seconds
    sent_long = 0

    async def client(i: int) -> None:
        nonlocal failed
        conn = H1Connection("127.0.0.1", port)
        try:
            k = i
            while time.monotonic() < stop:
                body = short[k % len(short)]
                k += concurrency
                t0 = time.perf_counter()
                r = await conn.post("/v1/chat/completions", body)
                latencies.append(time.perf_counter() - t0)
                failed += r.status != 200
        finally:
            await conn.close()

    async def longs() -> None:
        nonlocal sent_long, failed
        conn = H1Connection("127.0.0.1", long_port or port)
        try:
            for body in long:
                if time.monotonic() >= stop:
                    break
                t_next = time.monotonic() + 1.0
                r = await conn.post("/v1/completions", body)
                failed += r.status != 200
                sent_long += 1
                await asyncio.sleep(max(0.0, t_next - time.monotonic()))
        finally:
            await conn.close()

    tasks = [client(i) for i in range(concurrency)] + ([longs()] if long else [])
    await asyncio.gather(*tasks)
    return latencies, failed, sent_long


def cpu_ns(pid: int) -> int:
    """Time ``pid``'s threads have run, in nanoseconds (the scheduler's count: a clock tick is too coarse here)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between the listing and the read
    return total


def _instant_replicas(logs: Path, name: str) -> tuple[Proc, list[int]]:
    """The simulator's 4 instant replicas, ready. They count tokens by bytes (no ``--root`` with the tokenizer): in
    this process beside the router, their own encoding of long prompts would hold up the requests they serve."""
    base = free_ports(4)
    ports = [base + i for i in range(4)]
    sim = simulator(base, "tiny", "--replicas", "4", "--ttft-ms", "0", "--itl-ms", "0", "--max-model-len", "200000",
                    log_dir=logs, name=name).start()
    try:
        for p in ports:
            Proc("sim", [], p).wait_http(timeout=30)
    except BaseException:
        sim.stop()
        raise
    return sim, ports


MODES = {  # part 4: what routes the conversations
    "kvroute, tokens": "kvroute with the tiny tokenizer (what it does wherever it finds the model's)",
    "kvroute, bytes": "kvroute keying by bytes (prefix.tokenizer: none)",
    "kvroute, forwarding only": "kvroute with prefix.tokenizer: none and policy: round-robin: no key, no index",
    "sglang-router": "sglang-router --policy cache_aware",
}


def _chat_router(mode: str, urls: list[str], folder: Path, logs: Path) -> Proc:
    if mode == "sglang-router":
        exe = shutil.which("sglang-router") or str(Path(sys.executable).parent / "sglang-router")
        port = free_port()
        return Proc(mode, [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                           "--prometheus-port", str(free_port()), "--worker-urls", *urls], port,
                    log_path=logs / f"sglang-router-{port}.log")
    settings = {"kvroute, tokens": [f"prefix.tokenizer={folder}"], "kvroute, bytes": ["prefix.tokenizer=none"],
                "kvroute, forwarding only": ["prefix.tokenizer=none", "policy=round-robin"]}[mode]
    return router(urls, *[a for s in settings for a in ("--set", s)], log_dir=logs, name="router-chat")


def _until_it_routes(rt: Proc, mode: str) -> None:
    if mode.startswith("kvroute"):
        rt.wait_http("/ready", timeout=30)
        if mode == "kvroute, tokens":
            _wait_for_tokens(rt)
        return
    probe = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if HTTP.post(rt.url + "/v1/chat/completions", content=probe, timeout=5.0,
                         headers={"content-type": "application/json"}).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{mode} did not route within 60 s: {rt.log_tail()}")


def conversation_over_http(mode: str, folder: Path, groups: int, chats: int, turns: int, logs: Path) -> dict[str, Any]:
    """CPU per request of the router process (``mode``: one of :data:`MODES`) at each turn of growing
    conversations sent through it, in front of 4 instant replicas."""
    sim, ports = _instant_replicas(logs, "sim-chat")
    rt: Proc | None = None
    try:
        rt = _chat_router(mode, [f"http://127.0.0.1:{p}" for p in ports], folder, logs).start()
        _until_it_routes(rt, mode)
        pid, port = rt.pid, rt.port
        cpu = [0] * turns
        wall: list[list[float]] = [[] for _ in range(turns)]
        rng = random.Random(7)

        async def one_group(g: int, turns: int, counted: bool) -> None:
            conn = H1Connection("127.0.0.1", port)
            try:
                histories = [new_chat(rng, f"{g}.{c}") for c in range(chats)]
                for t in range(turns):
                    bodies = []
                    for h in histories:
                        next_turn(rng, h)
                        bodies.append(json.dumps({"model": "tiny", "max_tokens": 1, "messages": h}).encode())
                    cpu_before = cpu_ns(pid)
                    for body in bodies:  # one at a time: the router's CPU in this span is these requests'
                        t0 = time.perf_counter()
                        res = await conn.post("/v1/chat/completions", body)
                        if res.status != 200:
                            raise RuntimeError(f"turn {t + 1}: HTTP {res.status}")
                        wall[t].append(time.perf_counter() - t0)
                    if counted:
                        cpu[t] += cpu_ns(pid) - cpu_before
            finally:
                await conn.close()

        asyncio.run(one_group(-1, min(2, turns), counted=False))  # connections, caches and code paths warm
        for w in wall:
            w.clear()
        for g in range(groups):
            asyncio.run(one_group(g, turns, counted=True))
        n = groups * chats
        per_turn = [c / n / 1e6 for c in cpu]
        return {"requests_per_turn": n, "cpu_ms": per_turn, "last_over_first": per_turn[-1] / per_turn[0],
                "latency_p50_ms": [statistics.median(w) * 1e3 for w in wall]}
    finally:
        if rt is not None:
            rt.stop()
        sim.stop()


def _wait_for_tokens(rt: Proc) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the tokenizer is looked for after the first health check
        keys = HTTP.get(rt.url + "/admin/replicas").json()["prompt_keys"]
        if keys.get("tiny", {}).get("mode") == "tokens":
            return
        time.sleep(0.2)
    raise RuntimeError("the router did not find the tiny model's tokenizer within 20 s")


STRAIGHT = "100k-token prompts straight to a replica (reference)"
THROUGH = "100k-token prompts through the router"


def beside_long_prompt(folder: Path, seconds: float, concurrency: int, logs: Path) -> dict[str, Any]:
    rng = random.Random(3)
    vocab = VOCABULARIES["tiny-model"]
    short = [json.dumps({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "system", "content": f"group {g}: " + words(rng, 300, vocab)},
        {"role": "user", "content": words(rng, 30, vocab)}]}).encode() for g in range(64)]
    long = [json.dumps({"model": "tiny", "max_tokens": 4,
                        "prompt": f"document {i}: " + words(rng, 100_000, vocab)}).encode() for i in range(int(seconds) + 2)]
    sim, ports = _instant_replicas(logs, "sim")
    rt: Proc | None = None
    try:
        rt = router([f"http://127.0.0.1:{p}" for p in ports], "--set", f"prefix.tokenizer={folder}",
                    log_dir=logs).start()
        rt.wait_http("/ready", timeout=30)
        _wait_for_tokens(rt)
        asyncio.run(_drive(rt.port, short, [], 2.0, concurrency))  # connections and caches warm
        out: dict[str, Any] = {}
        mixes = (("short only", [], None), (STRAIGHT, long[::-1], ports[0]), (THROUGH, long, None))
        for name, longs, long_port in mixes:
            lat, failed, sent = asyncio.run(_drive(rt.port, short, longs, seconds, concurrency, long_port))
            out[name] = {"requests": len(lat), "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
                         "max_ms": max(lat) * 1e3, "failed": failed, "long_prompts": sent}
        # what the router's keying of the long prompts adds, beyond what the same prompts cost the stand-ins, the
        # client and this machine's two cores
        out["p99_added_ms"] = out[THROUGH]["p99_ms"] - out[STRAIGHT]["p99_ms"]
        return out
    finally:
        if rt is not None:
            rt.stop()
        sim.stop()


def markdown(report: dict[str, Any], command: str) -> str:
    s, c, b = report["shared"], report["conversation"], report["beside"]
    out = ["# Long prompts and the tokenizer", "", f"Command: `{command}`", "", f"Run {time.strftime('%Y-%m-%d %H:%M')}",
           "", f"## Shared long prompts (~{s['reuse']['prompt_tokens']} tokens, first ~11,000 shared)", "",
           "| encoding | key p50 (ms) | p99 (ms) | mean (ms) |", "|---|---|---|---|"]
    for mode in ("reuse", "whole"):
        r = s[mode]
        out.append(f"| {mode} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_ms']:.2f} |")
    out += ["", f"## A conversation of {len(c['reuse']['turn_ms'])} turns of ~2,000 tokens "
            f"(last turn ~{c['reuse']['last_turn_tokens']} tokens)", "",
            "| what | turn 1 (ms) | turn 10 (ms) | last turn (ms) | last / first |", "|---|---|---|---|---|"]
    for mode, name in (("reuse", "key, reusing"), ("whole", "key, encoded whole"),
                       ("decision", "decision: key, lookup, record (16 chats, 4 replicas, CPU)")):
        t = c[mode]["turn_ms"]
        out.append(f"| {name} | {t[0]:.2f} | {t[9]:.2f} | {t[-1]:.2f} | {c[mode]['last_over_first']:.2f} |")
    out += ["", "## Short requests beside first-seen 100,000-token prompts (32 clients, HTTP)", "",
            "| traffic | short requests | p50 (ms) | p99 (ms) | max (ms) | long prompts | failed |",
            "|---|---|---|---|---|---|---|"]
    for name, r in b.items():
        if isinstance(r, dict):
            out.append(f"| {name} | {r['requests']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.1f} | "
                       f"{r['long_prompts']} | {r['failed']} |")
    out.append(f"\np99 added by the router's keying of the long prompts (through the router minus the reference): "
               f"{b['p99_added_ms']:.2f} ms")
    h = report["over_http"]
    out += ["", f"## Growing conversations through the router ({next(iter(h.values()))['requests_per_turn']} chats of "
            f"{len(next(iter(h.values()))['cpu_ms'])} turns of ~2,000 tokens, one request at a time, HTTP)", "",
            "Router CPU per request (ms), all its threads (kernel time included: on this machine receiving and "
            "sending a 225 KB body costs about 0.9 ms of it). "
            + "; ".join(f"{m}: {d}" for m, d in MODES.items()) + ".", "",
            "| router | turn 1 | turn 5 | turn 10 | turn 15 | last turn | last / first |", "|---|---|---|---|---|---|---|"]
    for mode, r in h.items():
        cells = " | ".join(f"{r['cpu_ms'][t]:.2f}" for t in (0, 4, 9, 14, -1))
        out.append(f"| {mode} | {cells} | {r['last_over_first']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="shared long prompts keyed per encoding")
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--seconds", type=float, default=20.0, help="per traffic mix in part 3")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--groups", type=int, default=4, help="groups of 16 chats sent through the router in part 4")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "tokenize")
    p.add_argument("--only", type=int, choices=(1, 2, 3, 4), help="run one part (printed, not written)")
    args = p.parse_args(argv)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-tokenize-") as tmp:
        folder = write_tokenizer(Path(tmp) / "tiny-model")
        if args.only in (None, 1):
            report["shared"] = {m: shared_prompts(folder, args.requests, m == "reuse") for m in ("reuse", "whole")}
            print(json.dumps(report["shared"]), file=sys.stderr, flush=True)
        if args.only in (None, 2):
            report["conversation"] = {m: conversation(folder, args.chats, args.turns, m == "reuse")
                                      for m in ("reuse", "whole")}
            report["conversation"]["decision"] = decisions(folder, 16, args.turns)
            print(json.dumps(report["conversation"]), file=sys.stderr, flush=True)
        if args.only in (None, 3):
            report["beside"] = beside_long_prompt(folder, args.seconds, args.concurrency, Path(tmp))
            print(json.dumps(report["beside"]), file=sys.stderr, flush=True)
        if args.only in (None, 4):
            report["over_http"] = {mode: conversation_over_http(mode, folder, args.groups, 16, args.turns, Path(tmp))
                                   for mode in MODES}
            print(json.dumps(report["over_http"]), file=sys.stderr, flush=True)
    if args.only is not None:
        return 0
    command = ("python -m loadtest.bench_tokenize " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(report, command))
    print(markdown(report, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
