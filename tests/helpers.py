"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import random
import time
from typing import Callable

import httpx

from loadtest.cluster import Proc
from loadtest.tiny_model import WORDS


# -- helpers used across tests ---------------------------------------------------------------


def sim_state(sim: Proc) -> dict:
    return httpx.get(sim.url + "/sim/state", timeout=2).json()["counters"]


def set_faults(sim: Proc, **faults: object) -> None:
    httpx.post(sim.url + "/sim/faults", json=faults, timeout=2).raise_for_status()


def replica_names(router_proc: Proc) -> set[str]:
    """The names of the replicas a router holds now (any state)."""
    return {r["name"] for r in httpx.get(router_proc.url + "/admin/replicas", timeout=5).json()["replicas"]}


def replicas_view(router_proc: Proc, headers: dict[str, str] | None = None) -> dict[str, dict]:
    body = httpx.get(router_proc.url + "/admin/replicas", headers=headers, timeout=2).json()
    return {r["url"]: r for r in body["replicas"]}


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Poll until ``predicate()`` holds; return the seconds it took (fails the test on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def sse_events(raw: bytes) -> list[str]:
    """The data lines of an SSE body, in order."""
    return [block[len(b"data: "):].decode() for block in raw.split(b"\n\n") if block.startswith(b"data: ")]


def sse_json(raw: bytes) -> list[dict]:
    return [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]




# -- multi-turn chats with traffic that bypasses the router ---------------------------------------


def text(rng, n):
    """``n`` words the tiny model's tokenizer knows."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(client, base, messages, **extra):
    r = client.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                         **extra})
    r.raise_for_status()
    return r


def cached(r):
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def predicted(r):
    return int(r.headers["x-kvroute-cached-tokens"])


def conversations(seed, n=6, turns=4, system_words=60, user_words=25, reply_words=20):
    """Multi-turn chats sharing one system prompt: per conversation, the messages of each turn."""
    rng = random.Random(seed)
    system = text(rng, system_words)
    out = []
    for c in range(n):
        history = [{"role": "system", "content": system}]
        conv = []
        for t in range(turns):
            history.append({"role": "user", "content": text(rng, user_words)})
            conv.append(list(history))
            history.append({"role": "assistant", "content": text(rng, reply_words)})
        out.append(conv)
    return out


def run_with_bypass(rt, replicas, seed, settle, bypass=0.3, **shape):
    """Multi-turn chats, turn by turn; about ``bypass`` of the requests go straight to a random replica
    (then ``settle()``). Returns (predicted, actual) for every routed request."""
    rng = random.Random(seed)
    convs = conversations(seed, **shape)
    pairs = []
    with httpx.Client(timeout=60) as c:
        for t in range(len(convs[0])):
            for conv in convs:
                if rng.random() < bypass:
                    chat(c, rng.choice(replicas).url, conv[t])
                    settle()
                else:
                    r = chat(c, rt.url, conv[t])
                    pairs.append((predicted(r), cached(r)))
    return pairs


def refused(url: str) -> bool:
    """Nothing listens at ``url``'s port (the connection is refused)."""
    try:
        httpx.get(url, timeout=1)
    except httpx.ConnectError:
        return True
    return False
