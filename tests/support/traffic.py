"""Traffic for the tests: words the tiny model knows, multi-turn chats (some bypassing the router), steady
concurrent load, and streams through a replica's kill."""

from __future__ import annotations

import json
import random
import time

import httpx

from loadtest.cluster import Proc
from loadtest.tiny_model import WORDS

from .sse import sse_events
from .state import replicas_view, running
from .waiting import wait_until


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


class Load:
    """Clients on threads sending a steady mix of streaming and non-streaming chat and completions, each
    request checked whole (status, ``[DONE]``, no error event, every token); for the fault tests.

    ``outcomes`` holds one row per request: (sent, seconds, ok, started_streaming, detail)."""

    def __init__(self, url: str, clients: int = 8, max_tokens: int = 12, seed: int = 0,
                 headers: dict[str, str] | None = None, timeout: float = 30.0) -> None:
        import threading
        self.url = url
        self.clients = clients
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.headers = headers or {}
        self.timeout = timeout
        self.outcomes: list[tuple[float, float, bool, bool, str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        # long enough for several KV blocks (byte mode: 128 tokens of 4 bytes), so routing looks prompts up
        self._systems = [text(random.Random(seed + k), 400) for k in range(4)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def _client(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=self.timeout, headers=self.headers) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                chat_api, stream = rng.random() < 0.5, rng.random() < 0.7
                system = self._systems[rng.randrange(len(self._systems))]
                body: dict = {"model": "tiny", "max_tokens": self.max_tokens, "stream": stream}
                if chat_api:
                    body["messages"] = [{"role": "system", "content": system},
                                        {"role": "user", "content": f"client {i} question {n}"}]
                else:
                    body["prompt"] = f"{system} client {i} question {n}"
                sent = time.monotonic()
                ok, started, detail = self._one(client, "/v1/chat/completions" if chat_api else "/v1/completions",
                                                body, stream, chat_api)
                with self._lock:
                    self.outcomes.append((sent, time.monotonic() - sent, ok, started, detail))

    def _one(self, client: httpx.Client, path: str, body: dict, stream: bool, chat_api: bool) -> tuple[bool, bool, str]:
        started = False
        try:
            if not stream:
                r = client.post(self.url + path, json=body)
                if r.status_code != 200:
                    return False, False, f"status {r.status_code}"
                if not r.headers.get("content-type", "").startswith("application/json") or not r.json()["choices"]:
                    return False, False, "not a JSON answer"
                return True, False, "ok"
            raw = b""
            with client.stream("POST", self.url + path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return False, False, f"status {r.status_code}"
                for chunk in r.iter_bytes():
                    started = started or b"data: {" in chunk
                    raw += chunk
            events = sse_events(raw)
            if not events or events[-1] != "[DONE]":
                return False, started, "no [DONE]"
            if any('"error"' in e for e in events):
                return False, started, "error event"
            chunks = [json.loads(e) for e in events[:-1]]
            tokens = sum(1 for c in chunks if c["choices"] and (
                "content" in c["choices"][0].get("delta", {}) and "role" not in c["choices"][0]["delta"]
                if chat_api else True))
            if tokens != self.max_tokens:
                return False, started, f"{tokens} tokens"
            return True, started, "ok"
        except httpx.HTTPError as e:
            return False, started, f"client error {type(e).__name__}"
        except (ValueError, KeyError, TypeError):
            return False, started, "invalid event"

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict:
        rows = [o for o in self.outcomes if since <= o[0] < until]
        good = sorted(o[1] for o in rows if o[2])
        failed = [o for o in rows if not o[2]]

        def pct(q: float) -> float | None:
            return round(good[min(len(good) - 1, int(q * len(good)))] * 1000, 1) if good else None

        return {"requests": len(rows), "failed": len(failed),
                "failed_before_streaming": sum(1 for o in failed if not o[3]),
                "p50_ms": pct(0.5), "p99_ms": pct(0.99),
                "failures": sorted({o[4] for o in failed})}


def openai_streams_through_a_kill(rt: Proc, victim: Proc, clients: int, max_tokens: int,
                                  warm: int = 32) -> tuple[list[tuple[float, str, int, int, str | None]], float]:
    """``clients`` threads stream chats through the ``openai`` client (usage included) while ``victim`` is
    SIGKILLed once ``warm`` streams have finished and 3 are receiving tokens from it; returns one row per stream,
    (sent_at, first replica, content chunks, usage completion tokens, error or None), and the kill's time."""
    import threading

    import openai

    results: list[tuple[float, str, int, int, str | None]] = []
    streaming: dict[int, str] = {}  # client -> the replica its stream is coming from, once content came
    lock = threading.Lock()
    stop = threading.Event()
    api = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def loop(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            sent, replica, chunks, tokens, error = time.monotonic(), "", 0, 0, None
            try:
                raw = api.chat.completions.with_raw_response.create(
                    model="tiny", messages=[{"role": "user", "content": f"client {i} request {n}"}],
                    max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                replica = raw.headers.get("x-kvroute-replica", "")
                for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].delta.content is not None and not chunk.choices[0].delta.role:
                        chunks += 1
                        streaming[i] = replica
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            except Exception as e:  # the openai client raises on an SSE error event
                error = repr(e)
            with lock:
                streaming.pop(i, None)
                results.append((sent, replica, chunks, tokens, error))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= warm, timeout=120)  # steady: streams in every phase on every replica
        # Killed while the replica itself is generating for at least 3 requests, and clients are reading from it.
        # What a client has read lags what the replica has sent (2 cores run the replicas, the router and the 16
        # clients), so the clients' view alone could pick a moment when every stream was already complete; the
        # replica's own gauge is read last and without a full parse, so that little time passes before the kill.
        name = f"127.0.0.1:{victim.port}"

        def generating() -> bool:
            return (any(r == name for r in list(streaming.values()))
                    and replicas_view(rt)[victim.url]["inflight"] >= 3 and running(victim.url) >= 3)

        wait_until(generating, timeout=60, interval=0.005)
        victim.kill()
        killed = time.monotonic()
        wait_until(lambda: not replicas_view(rt)[victim.url]["ready"], timeout=10)
        # and until a stream sent well after the kill has finished: the streams the victim's death moved to the
        # other replica make it slow, and a fixed wait could end before any new stream was sent and answered
        wait_until(lambda: any(sent > killed + 0.5 for sent, *_ in list(results)), timeout=90)
    finally:  # the clients stop whatever happened
        stop.set()
        for t in threads:
            t.join(120)
    return results, killed
