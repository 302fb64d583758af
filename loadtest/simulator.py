"""A vLLM stand-in: vLLM 0.32's OpenAI API, SSE chunk format, errors and /metrics, without a model.

    python -m loadtest.simulator --port 9001 --model tiny [--ttft-ms 20 --itl-ms 5 ...]

It counts prompt tokens as ``ceil(bytes / --bytes-per-token)``, keeps at most ``--max-num-seqs``
requests running (the rest wait, as in vLLM's scheduler), models the prefix cache (LRU of chained
block hashes; hits on leading full blocks, never the last token), queues the prefill of uncached
tokens (``--prefill-us-per-token`` each) behind the prefills already under way, as they share the
device's compute, then sleeps a time to first token plus an inter-token latency, and reports all
of it under vLLM's metric names. When a client disconnects
the request is aborted and counted as ``finished_reason="abort"``, as vLLM does.

Fault switches for tests, set at start-up with flags or at run time with
``POST /sim/faults`` (JSON, same names): ``fail_status`` + ``fail_count`` (answer the next N
generation requests with that status), ``health_status`` (what /health answers), ``hang``
(accept generation requests and never answer), ``die_after_chunks`` (drop the connection after N
SSE chunks), ``exit_after_chunks`` (kill the whole process after N chunks), ``stall_after_chunks``
(stop sending, keep the connection open), ``cut_bodies`` (the next N non-streaming answers stop
halfway through their declared length and the connection drops), ``transfer_params`` (what non-streaming
answers carry as ``kv_transfer_params``, whatever the connector says). ``GET /sim/state`` returns counters and the headers and body of
the last generation request. None of ``/sim/*`` exists on a real vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import heapq
import itertools
import json
import math
import os
import random
import signal
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from router.prefix import chain_tokens, prompts_of
from router.tokenizer import LocalTokenizer

from . import stand_in_apis as apis
from .engine import Engine, EngineLoop, Request, StepCost
from .kv_publisher import KvPublisher
from .kv_transfer import KvTransfer, TransferFailed
from .profiles import PROFILES

# The rest of a vLLM 0.32 replica's /metrics page (captured from one; the families the stand-in does not
# compute itself: HTTP, Python, latency histograms, ...), so that a scrape reads as many bytes as vLLM's (~56 KB).
_METRICS_REST = (Path(__file__).parent / "vllm_metrics_rest.txt").read_text()
_metrics_rest_of: dict[str, str] = {}  # per model name: one copy for every replica a process hosts


# families the stand-in computes itself, left out of the captured rest
_COMPUTED = ("vllm:prompt_tokens_by_source_total", "vllm:external_prefix_cache_queries_total",
             "vllm:external_prefix_cache_hits_total")


def metrics_rest(model: str) -> str:
    if model not in _metrics_rest_of:
        lines = [line for line in _METRICS_REST.splitlines()
                 if not any(line.startswith(f) or line.startswith(f"# HELP {f} ") or line.startswith(f"# TYPE {f} ")
                            for f in _COMPUTED)]
        _metrics_rest_of[model] = "\n".join(lines).replace('model_name="tiny"', f'model_name="{model}"') + "\n"
    return _metrics_rest_of[model]

VERSION = "0.32.0"
FINGERPRINT = "vllm-0.32.0-98d74f34"
VOCAB = ("ved", " the", " of", " and", " to", " in", " is", " a", " that", " it")
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


@dataclass
class Faults:
    fail_status: int = 0
    fail_count: int = 0
    health_status: int = 200
    hang: bool = False
    die_after_chunks: int = -1
    exit_after_chunks: int = -1
    stall_after_chunks: int = -1
    cut_bodies: int = 0  # the next N non-streaming answers stop halfway and the connection drops
    # /v1/models also lists this many adapters, named adapter-{tag}-{i} (a new tag: LoRA adapters churning)
    extra_models: int = 0
    models_tag: str = "a"
    # answers carry this as kv_transfer_params in place of the connector's (a prefill replica answering garbage)
    transfer_params: Any = None


@dataclass
class Counters:
    received: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    streaming: int = 0  # streams under way: headers sent, last event not yet
    peak_in_flight: int = 0  # most requests held at once (running + waiting)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    local_cache_hit: int = 0  # prompt tokens found in this replica's prefix cache
    external_kv_transfer: int = 0  # prompt tokens whose KV was read from another replica (disaggregated prefill)
    health_checks: int = 0  # GET /health answered
    scrapes: int = 0  # GET /metrics answered
    last_headers: dict[str, str] = field(default_factory=dict)
    last_body: dict[str, Any] = field(default_factory=dict)  # the last generation request, as parsed


class _Abort(Exception):
    pass


class _ClientGone:
    """Around a generation: cancels it when its client disconnects (vLLM aborts the request then), and
    counts a request ended early by the client or a fault as aborted instead of letting that propagate."""

    def __init__(self, receive: Any, counters: Counters) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.counters = counters
        self.gone = False
        self.done = False
        self.watcher = asyncio.create_task(self._watch(receive))

    def __enter__(self) -> "_ClientGone":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        self.done = True
        self.watcher.cancel()
        if kind is not None and issubclass(kind, (asyncio.CancelledError, _Abort)) and self._aborted():
            self.counters.aborted += 1
            return True
        return False

    async def _watch(self, receive: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not self.done:
                    self.gone = True
                    self.task.cancel()
                return

    def _aborted(self) -> bool:
        """The request ended early because of the client (or a fault), not because the server stops."""
        if self.gone:
            self.task.uncancel()
            return True
        return not self.task.cancelling()


class PrefixCache:
    """vLLM's prefix cache in miniature: full blocks of the prompt's token ids, chain-hashed, LRU-evicted.

    A request hits on its leading cached blocks, never on its last token (``floor((n-1)/B)*B`` at
    most); afterwards all its full blocks are cached, the root most recently used. Block hashes are
    seeded per process, as vLLM's are. With a publisher, newly cached blocks are announced as
    ``BlockStored`` (with their parent and token ids) and evicted ones as ``BlockRemoved``.
    """

    def __init__(self, block_size: int, num_blocks: int, publisher: "KvPublisher | None" = None,
                 seed: int | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.publisher = publisher
        self.seed = random.Random(seed).getrandbits(64) if seed is not None else random.getrandbits(64)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def chain(self, ids: list[int]) -> list[int]:
        return chain_tokens(ids, self.block_size, self.seed)

    def lookup(self, ids: list[int]) -> int:
        """The prompt's cached tokens, leaving the cache as it is."""
        hit = 0
        for h in self.chain(ids):
            if h not in self.blocks:
                break
            hit += 1
        return max(0, min(hit * self.block_size, (len(ids) - 1) // self.block_size * self.block_size))

    def admit(self, ids: list[int]) -> int:
        """Look the prompt up and cache it; returns the cached tokens."""
        chain = self.chain(ids)
        hit = 0
        for h in chain:
            if h not in self.blocks:
                break
            hit += 1
        b = self.block_size
        cached = min(hit * b, (len(ids) - 1) // b * b)
        if self.publisher is not None and hit < len(chain):
            self.publisher.stored(chain[hit:], chain[hit - 1] if hit else None, ids[hit * b:len(chain) * b], b)
        for h in reversed(chain):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.num_blocks:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted and self.publisher is not None:
            self.publisher.removed(evicted)
        return max(0, cached)

    def clear(self, announce: bool) -> None:
        self.blocks.clear()
        if announce and self.publisher is not None:
            self.publisher.cleared()


@functools.lru_cache(maxsize=None)
def shared_tokenizer(root: str) -> LocalTokenizer:
    """One tokenizer per model folder for every replica this process hosts: 1,024 replicas of one model keep
    one set of caches (and pass their encoder checks once), not 1,024."""
    return LocalTokenizer(root)


def _headers_sent(send: Any) -> Any:
    """``send`` for an answer whose headers went out already: its own ``http.response.start`` is dropped."""
    async def rest(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.start":
            await send(message)
    return rest


class Slots:
    """``max_num_seqs`` requests run at once; the rest wait first come first served or, as vLLM's
    ``--scheduling-policy priority`` orders its waiting requests, by their ``priority`` (lower first), then
    arrival."""

    def __init__(self, n: int, by_priority: bool = False) -> None:
        self.free = n
        self.by_priority = by_priority
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    async def acquire(self, priority: int = 0) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority if self.by_priority else 0, next(self._arrivals), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # a slot was handed over as it left
                self.release()
            raise

    def release(self) -> None:
        while self._waiting:
            fut = heapq.heappop(self._waiting)[2]
            if not fut.done():  # a waiter that left is skipped
                fut.set_result(None)
                return
        self.free += 1


class VLLMSimulator:
    def __init__(self, model: str, ttft_ms: float = 20.0, itl_ms: float = 5.0, prefill_us_per_token: float = 0.0,
                 max_num_seqs: int = 256, block_size: int = 128, num_gpu_blocks: int = 16384,
                 max_model_len: int = 4096, bytes_per_token: int = 4, api_key: str | None = None,
                 faults: Faults | None = None, seed: int | None = None, root: str | None = None,
                 kv_events: KvPublisher | None = None, engine: Engine | None = None, time_scale: float = 1.0,
                 store_responses: bool = False, transfer: KvTransfer | None = None,
                 scheduling_policy: str = "fcfs") -> None:
        self.model = model
        self.scheduling_policy = scheduling_policy
        self._metrics_rest = metrics_rest(model)
        self.root = root or f"/models/{model}"  # what /v1/models reports the model was loaded from
        # with the model's tokenizer in that folder, prompts are its token ids (as vLLM's); without, a
        # token is --bytes-per-token bytes of the prompt text
        self.tokenizer = shared_tokenizer(root) if root and (Path(root) / "tokenizer.json").is_file() else None
        self.ttft = ttft_ms / 1e3
        self.itl = itl_ms / 1e3
        self.prefill_per_token = prefill_us_per_token / 1e6
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.bytes_per_token = bytes_per_token
        self.api_key = api_key
        self.faults = faults or Faults()
        self.c = Counters()
        self.kv_blocks_in_use = 0
        self.start_time = time.time()
        self.created = int(self.start_time)
        self._slots = Slots(max_num_seqs, scheduling_policy == "priority") if max_num_seqs else None
        self.kv_events = kv_events
        self.cache = PrefixCache(block_size, num_gpu_blocks, kv_events, seed)
        # with an engine, it schedules, times and caches every generation request (--engine)
        self.engine = engine
        self.engine_loop = EngineLoop(engine, time_scale) if engine is not None else None
        self._prefill_free_at = 0.0  # prefill is compute-bound: requests' prefills queue behind each other
        self._rng = random.Random(seed)
        self._background: set[asyncio.Task[None]] = set()
        self.responses = apis.StoredResponses() if store_responses else None
        self.transfer = transfer  # a KV connector (--kv-connector): disaggregated prefill and decode

    # -- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    if self.kv_events is not None:
                        await self.kv_events.start()
                    if self.engine_loop is not None:
                        task = asyncio.create_task(self.engine_loop.run())
                        self._background.add(task)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.kv_events is not None:
                        await self.kv_events.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        method, path = scope["method"], scope["path"]
        if method == "GET":
            if path == "/health":
                self.c.health_checks += 1
                return await _respond(send, self.faults.health_status, b"", [])
            if path == "/metrics":
                self.c.scrapes += 1
                return await _respond(send, 200, self.render_metrics().encode(),
                                      [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
            if path == "/version":
                return await _json(send, 200, {"version": VERSION})
            if path == "/v1/models":
                if not self._authorized(scope):
                    return await _json(send, 401, {"error": "Unauthorized"})
                return await _json(send, 200, self.models())
            if path == "/kv_event_sources":
                if self.kv_events is None:
                    return await _json(send, 200, {})
                return await _json(send, 200, self.kv_events.sources())
            if path == "/sim/state":
                return await _json(send, 200, self.state())
            if path.startswith("/v1/responses/"):
                return await self._stored_response(path, send)
        elif method == "POST":
            body = await _read_body(receive)
            if path == "/sim/faults":
                for k, v in json.loads(body or b"{}").items():
                    if k == "kv_drop_batches" and self.kv_events is not None:
                        self.kv_events.drop_batches = int(v)
                    elif k == "kv_replay" and self.kv_events is not None:
                        self.kv_events.replay = bool(v)
                    elif k == "kv_drop_removals" and self.kv_events is not None:
                        self.kv_events.drop_removals = bool(v)
                    else:
                        setattr(self.faults, k, v)
                return await _json(send, 200, asdict(self.faults))
            if path == "/sim/kv_pull":
                return await self._kv_pull(body, send)
            if path == "/sim/restart":
                self.restart()
                return await _json(send, 200, self.state())
            if path == "/sim/kv_flood":
                spec = json.loads(body or b"{}")
                task = asyncio.create_task(self._flood(float(spec.get("blocks_per_s", 10_000)),
                                                       float(spec.get("seconds", 10))))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                return await _json(send, 202, {"flooding": spec})
            if path == "/reset_prefix_cache":
                self.cache.clear(announce=True)
                if self.engine is not None:
                    self.engine.reset_prefix_cache()
                return await _respond(send, 200, b"", [])
            if path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"):
                if not self._authorized(scope):
                    return await _json(send, 401, {"error": "Unauthorized"})
                return await self._endpoint(path, scope, body, receive, send)
            if path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
                if not self._authorized(scope):
                    return await _json(send, 401, {"error": "Unauthorized"})
                return await self._other_api(path, scope, body, send)
            if path.startswith("/v1/responses/") and path.endswith("/cancel"):
                return await self._stored_response(path, send)
        await _json(send, 404, {"detail": "Not Found"})

    # -- the Responses API and Anthropic's Messages API (loadtest/stand_in_apis.py) ----------------

    async def _stored_response(self, path: str, send: Any) -> None:
        """GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: only where the response is stored."""
        response_id = path[len("/v1/responses/"):].removesuffix("/cancel")
        got = self.responses.get(response_id) if self.responses is not None else None
        if got is None:
            return await _json(send, 404, apis.not_found(response_id))
        if path.endswith("/cancel"):
            return await _json(send, 400, _error("Cannot cancel a synchronous response.", "invalid_request_error",
                                                 "response_id", 400))
        await _json(send, 200, got[0])

    async def _other_api(self, path: str, scope: dict[str, Any], body: bytes, send: Any) -> None:
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError
        except (ValueError, RecursionError):
            return await _json(send, 400, _error("JSON decode error", "Bad Request", "body", 400))
        model = req.get("model", self.model)
        if not self.serves(model):
            return await _json(send, 404, _error(
                f"The model `{model}` does not exist. Valid aliases: {self.model}.", "NotFoundError", "model", 404))
        bad = _invalid_fields(req) or apis.invalid(path, req)
        if bad is not None:
            return await _json(send, 400, _error(bad[1], "Bad Request", bad[0], 400))
        if path != "/v1/responses":
            ids = self.prompt_ids({"messages": apis.anthropic_messages(req)}, True)
            if path.endswith("/count_tokens"):
                return await _json(send, 200, {"input_tokens": len(ids),
                                               "context_management": {"original_input_tokens": len(ids)}})
            n = _lax_int(req.get("max_tokens")) or 16
            pieces, cached = await self._produce(ids, n)
            if _lax_bool(req.get("stream", False)):
                return await self._send_events(send, apis.message_events(self.model, pieces, len(ids)))
            return await _json(send, 200, apis.message_object(self.model, "".join(pieces), len(ids), n))
        previous = None
        prev_id = req.get("previous_response_id")
        if prev_id is not None:
            previous = self.responses.get(prev_id) if self.responses is not None else None
            if previous is None:
                return await _json(send, 404, apis.not_found(str(prev_id)))
        conversation = apis.messages_of(req, previous[1] if previous else None)
        ids = self.prompt_ids({"messages": conversation}, True)
        rid = req.get("request_id") or f"resp_{uuid.uuid4().hex[:16]}"
        n = _lax_int(req.get("max_output_tokens")) or 16
        self.c.received += 1
        self.c.last_body = req
        pieces, cached = await self._produce(ids, n)
        text = "".join(pieces)
        done = apis.response_object(rid, self.model, req, text, len(ids), cached, n,
                                    f"msg_{uuid.uuid4().hex[:16]}", int(time.time()), True)
        if self.responses is not None and req.get("store", True) is not False:
            self.responses.put(done, conversation + [{"role": "assistant", "content": text}])
        if _lax_bool(req.get("stream", False)):
            return await self._send_events(send, apis.response_events(rid, self.model, req, pieces, len(ids), cached))
        await _json(send, 200, done)

    async def _produce(self, ids: list[int], n: int) -> tuple[list[str], int]:
        """Prefill (through the prefix cache) and ``n`` output pieces, at the replica's pace."""
        cached = self.cache.admit(ids)
        self.c.prompt_tokens += len(ids)
        self.c.prefix_queries += len(ids)
        self.c.prefix_hits += cached
        await asyncio.sleep(self.ttft + self.itl * max(0, n - 1))
        self.c.generation_tokens += n
        self.c.completed += 1
        return [self._text(i) for i in range(n)], cached

    async def _send_events(self, send: Any, events: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        for chunk in events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"counters": asdict(self.c), "faults": asdict(self.faults),
                               "kv_blocks_in_use": self.kv_blocks_in_use, "cached_blocks": len(self.cache.blocks),
                               "start_time": self.start_time}
        e = self.engine
        if e is not None:
            out["cached_blocks"] = len(e.pool.cached)
            out["kv_blocks_in_use"] = len(e.pool.blocks) - e.pool.num_free
            out["engine"] = {"running": len(e.running), "waiting": len(e.waiting), "preemptions": e.preemptions,
                             "prefix_hits": e.prefix_hits, "prefix_queries": e.prefix_queries, "time": e.now}
        if self.transfer is not None:
            out["kv_transfer"] = {"engine_id": self.transfer.engine_id, "held": self.transfer.held,
                                  **asdict(self.transfer.c)}
            if e is not None:
                out["kv_transfer"]["kept_blocks"] = sum(len(b) for b in e.kept.values())
        if self.kv_events is not None:
            p = self.kv_events
            out["kv_events"] = {"next_seq": p.seq, "pending": len(p.pending), "sent": p.sent, "dropped": p.dropped,
                                "buffered": len(p.buffer),
                                "drop_batches": p.drop_batches, "replay": p.replay}
        return out

    async def _flood(self, blocks_per_s: float, seconds: float) -> None:
        """Cache random prompts at ``blocks_per_s`` blocks a second for ``seconds`` (for event benchmarks):
        each prompt a new chain of up to 64 blocks, so events carry stores and, once full, evictions."""
        tick = 0.01
        per_tick = blocks_per_s * tick
        owed = 0.0
        rng = random.Random(0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < seconds:
            owed += per_tick
            while owed >= 1:
                n = int(min(64, owed))
                self.cache.admit([rng.randrange(1024) for _ in range(n * self.block_size)] + [0])
                owed -= n
            await asyncio.sleep(tick - (loop.time() - start) % tick)

    def restart(self) -> None:
        """As if the process restarted: empty cache (no event: a new process sends none), event numbers from
        0, a new start time in /metrics."""
        self.cache.clear(announce=False)
        if self.engine is not None:
            self.engine.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.restart()
        self.start_time = time.time()
        self.c.prefix_queries = self.c.prefix_hits = self.c.prompt_tokens = 0

    def _authorized(self, scope: dict[str, Any]) -> bool:
        if not self.api_key:
            return True
        for k, v in scope["headers"]:
            if k == b"authorization":
                return v.decode("latin-1") == f"Bearer {self.api_key}"
        return False

    async def _endpoint(self, path: str, scope: dict[str, Any], body: bytes, receive: Any, send: Any) -> None:
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError
        except (ValueError, RecursionError):  # vLLM answers 400 to JSON nested past its parser's depth too
            return await _json(send, 400, _error(
                "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', "
                "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}",
                "Bad Request", "body.1", 400))
        model = req.get("model", self.model)
        if not self.serves(model):
            return await _json(send, 404, _error(
                f"The model `{model}` does not exist. Valid aliases: {self.model}.", "NotFoundError", "model", 404))
        if path == "/tokenize":
            ids = self.token_ids(req)
            return await _json(send, 200, {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                           "token_strs": None})
        if path == "/detokenize":
            text = "".join(VOCAB[t % len(VOCAB)] for t in req.get("tokens", []))
            return await _json(send, 200, {"prompt": text})
        if path == "/v1/embeddings":
            n = self.count_tokens(_text_of(req.get("input", "")))
            vec = [round(self._rng.uniform(-1, 1), 6) for _ in range(8)]
            return await _json(send, 200, {
                "id": f"embd-{uuid.uuid4().hex[:16]}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": 0, "object": "embedding", "embedding": vec}],
                "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}})
        chat = path == "/v1/chat/completions"
        if not chat and not req.get("prompt"):
            return await _json(send, 400, _error(
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                "BadRequestError", "prompt", 400))
        # what vLLM's request models refuse with 400 (pydantic's lax parsing: "16" is 16, "false" is False)
        bad = _invalid_fields(req)
        if bad is not None:
            return await _json(send, 400, _error(bad[1], "Bad Request", bad[0], 400))
        if _priority(req) != 0 and self.scheduling_policy != "priority":  # vLLM's engine refuses it so
            return await _json(send, 400, _error(f"Got priority {_priority(req)} but Priority scheduling is not "
                                                 "enabled.", "BadRequestError", None, 400))
        try:
            prompt_text(req, chat).encode("utf-8")
        except RecursionError:
            return await _json(send, 400, _error("1 validation error:\n  {'type': 'recursion_loop', 'loc': "
                                                 "'body', 'msg': 'Recursion error - cyclic reference detected'}",
                                                 "Bad Request", "body", 400))
        except UnicodeEncodeError:
            return await _json(send, 400, _error("The prompt is not valid UTF-8 text (a lone surrogate)",
                                                 "BadRequestError", "prompt" if not chat else "messages", 400))
        req["stream"] = _lax_bool(req.get("stream", False))
        max_tokens = _lax_int(req.get("max_completion_tokens")) or _lax_int(req.get("max_tokens")) or 16
        if max_tokens > self.max_model_len:
            return await _json(send, 400, _error(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}. Please request "
                f"fewer output tokens. (parameter=max_tokens, value={max_tokens})", "BadRequestError", "max_tokens", 400))
        self.c.received += 1
        self.c.last_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.c.last_body = req
        f = self.faults
        if f.fail_count > 0 and f.fail_status:
            f.fail_count -= 1
            self.c.failed += 1
            return await _json(send, f.fail_status, _error("simulated failure", "InternalServerError", None,
                                                            f.fail_status))
        await self._generate(chat, req, max_tokens, receive, send)

    # -- generation --------------------------------------------------------------------------

    async def _generate(self, chat: bool, req: dict[str, Any], max_tokens: int, receive: Any, send: Any) -> None:
        if self.engine_loop is not None:
            return await self._generate_engine(chat, req, max_tokens, receive, send)
        ids = self.prompt_ids(req, chat)
        prompt_tokens = len(ids)
        blocks = math.ceil((prompt_tokens + max_tokens) / self.block_size)
        t = self.transfer
        params = req.get("kv_transfer_params")
        remote_prefill = t is not None and t.usable(params)
        keeps = t is not None and t.wants_remote_decode(params)
        self.c.waiting += 1
        self.c.peak_in_flight = max(self.c.peak_in_flight, self.c.running + self.c.waiting)
        holding = False
        running = False
        try:
            with _ClientGone(receive, self.c):
                if self._slots is not None:
                    priority = _priority(req)
                    if remote_prefill:
                        assert t is not None
                        async with t.waiting(params):
                            await self._slots.acquire(priority)
                    else:
                        await self._slots.acquire(priority)
                    holding = True
                self.c.waiting -= 1
                self.c.running += 1
                running = True
                self.kv_blocks_in_use += blocks
                if self.faults.hang:  # a hung engine: admitted, never scheduled, so no token is ever counted
                    await asyncio.Event().wait()
                external = 0
                if remote_prefill:
                    assert t is not None
                    external = max(0, prompt_tokens - self.cache.lookup(ids))
                    try:
                        await t.read(params, external)
                    except TransferFailed as e:
                        if t.failure_policy == "fail":
                            self.c.failed += 1
                            return await self._transfer_failed(req, send, str(e))
                        external = 0  # recompute
                cached = self.cache.admit(ids)
                external = prompt_tokens - cached if external else 0  # all but this replica's own hits
                self.c.prompt_tokens += prompt_tokens
                self.c.prefix_queries += prompt_tokens
                self.c.prefix_hits += cached
                self.c.local_cache_hit += cached
                self.c.external_kv_transfer += external
                loop = asyncio.get_running_loop()
                start = max(loop.time(), self._prefill_free_at)
                self._prefill_free_at = start + self.prefill_per_token * (prompt_tokens - cached - external)
                await asyncio.sleep(self._prefill_free_at - loop.time() + self.ttft)
                await self._answer(chat, req, max_tokens, prompt_tokens, 0 if remote_prefill else cached, send,
                                   finished=self._keeper(ids, cached) if keeps else None)
        finally:
            if running:
                self.c.running -= 1
                self.kv_blocks_in_use -= blocks
            else:
                self.c.waiting -= 1
            if holding and self._slots is not None:
                self._slots.release()

    async def _generate_engine(self, chat: bool, req: dict[str, Any], max_tokens: int, receive: Any,
                               send: Any) -> None:
        """The engine schedules the request; each of its steps paces the tokens."""
        assert self.engine_loop is not None
        ids = self.prompt_ids(req, chat)
        engine = self.engine_loop.engine
        t = self.transfer
        params = req.get("kv_transfer_params")
        r = Request(f"cmpl-{uuid.uuid4().hex}-0", ids, max_tokens,
                    keep_blocks=t is not None and t.wants_remote_decode(params))
        kept = False

        def finished() -> dict[str, Any] | None:
            nonlocal kept
            assert t is not None
            kept = True
            return t.keep(r.id, len(engine.kept.get(r.id, ())), len(ids), lambda: engine.free_kept(r.id),
                          max(0, r.cached_tokens))

        async def pace(i: int) -> None:
            if not await tokens.get():
                raise _Abort()

        try:
            with _ClientGone(receive, self.c):
                if engine.frontend_s:  # the API server's part of the time to first token
                    await asyncio.sleep(engine.frontend_s * self.engine_loop.time_scale)
                if t is not None and t.usable(params):
                    b = engine.block_size
                    local = engine.pool.peek(engine.chain(ids)[:(len(ids) - 1) // b]) * b
                    try:
                        await t.read(params, max(0, len(ids) - 1 - local))
                        r.external_tokens = len(ids) - 1
                    except TransferFailed as e:
                        if t.failure_policy == "fail":
                            self.c.failed += 1
                            return await self._transfer_failed(req, send, str(e))
                async def too_long() -> None:
                    self.c.failed += 1
                    await _json(send, 400, _error(f"The prompt ({len(ids)} tokens) does not fit in the KV cache",
                                                  "BadRequestError", "messages" if chat else "prompt", 400))

                if len(ids) + 1 > len(engine.pool.blocks) * engine.block_size:  # refused: longer than the cache
                    return await too_long()
                tokens = self.engine_loop.submit(r)
                self.c.peak_in_flight = max(self.c.peak_in_flight, len(engine.running) + len(engine.waiting))
                if req.get("stream"):
                    # vLLM answers a stream's headers once it has accepted the request, the first event when
                    # the first token is out (however long the queue before it)
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                    send = _headers_sent(send)
                if not await tokens.get():  # refused after all (the engine's own check)
                    return await too_long()
                await self._answer(chat, req, max_tokens, len(ids), r.cached_tokens, send, pace,
                                   finished if r.keep_blocks else None)
        finally:
            self.engine_loop.abort(r)
            if not kept:  # a prefill that did not finish (or whose answer failed) keeps nothing
                engine.free_kept(r.id)

    def _text(self, i: int) -> str:
        return VOCAB[i % len(VOCAB)] if i else VOCAB[0]

    async def _answer(self, chat: bool, req: dict[str, Any], n: int, prompt_tokens: int, cached: int, send: Any,
                      pace: Callable[[int], Awaitable[None]] | None = None,
                      finished: Callable[[], dict[str, Any] | None] | None = None) -> None:
        """Generate and send ``n`` tokens; ``finished``, called once the last is generated, gives the answer's
        ``kv_transfer_params`` (a prefill kept for another replica's decode; a stream does not carry them)."""
        if req.get("stream"):
            await self._stream(chat, req, n, prompt_tokens, cached, send, pace, finished)
        else:
            await self._whole(chat, req, n, prompt_tokens, cached, send, pace, finished)
        self.c.completed += 1

    def _keeper(self, ids: list[int], cached: int) -> Callable[[], dict[str, Any] | None]:
        """For a prefill another replica will decode (no engine): its blocks stay in use until read."""
        assert self.transfer is not None
        blocks = math.ceil(len(ids) / self.block_size)

        def free() -> None:
            self.kv_blocks_in_use -= blocks

        def keep() -> dict[str, Any] | None:
            assert self.transfer is not None
            self.kv_blocks_in_use += blocks
            return self.transfer.keep(f"cmpl-{uuid.uuid4().hex}-0", blocks, len(ids), free, cached)
        return keep

    async def _kv_pull(self, body: bytes, send: Any) -> None:
        """The side channel: a decode replica reads a kept prefill's blocks (200 with their count), or 404; or
        renews their leases while its requests wait (``{"heartbeat": [request ids], "remote_engine_id"}``)."""
        if self.transfer is None:
            return await _json(send, 404, {"error": "no KV connector"})
        try:
            spec = json.loads(body or b"{}")
            if "heartbeat" in spec:
                renewed = self.transfer.renew(spec.get("remote_engine_id"), spec["heartbeat"])
                return await _json(send, 200, {"renewed": renewed})
            held = self.transfer.pull(spec.get("remote_engine_id"), spec.get("remote_request_id"))
        except (ValueError, AttributeError, RecursionError):
            held = None
        if held is None:
            return await _json(send, 404, {"error": "unknown or expired request"})
        return await _json(send, 200, {"blocks": held.blocks, "tokens": held.tokens})

    async def _transfer_failed(self, req: dict[str, Any], send: Any, why: str) -> None:
        """A decode whose KV could not be read (kv_load_failure_policy fail): vLLM fails the request."""
        err = _error(f"Internal server error: KV transfer failed ({why})", "InternalServerError", None, 500)
        if not req.get("stream"):
            return await _json(send, 500, err)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(err).encode() + b"\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _pace(self, i: int) -> None:
        """Before output token ``i`` (from 1): the fixed inter-token latency."""
        await asyncio.sleep(self.itl)

    async def _whole(self, chat: bool, req: dict[str, Any], n: int, prompt_tokens: int, cached: int,
                     send: Any, pace: Callable[[int], Awaitable[None]] | None = None,
                     finished: Callable[[], dict[str, Any] | None] | None = None) -> None:
        if pace is None:
            await asyncio.sleep(self.itl * max(0, n - 1))
        else:
            for i in range(1, n):
                await pace(i)
        transfer_params = finished() if finished is not None else None
        if self.faults.transfer_params is not None:
            transfer_params = self.faults.transfer_params
        text = "".join(self._text(i) for i in range(n))
        self.c.generation_tokens += n
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": None,
                                           "multimodal_tokens": None},
                 "completion_tokens_details": None}
        now = int(time.time())
        if chat:
            usage["prompt_tokens_details"]["created_cache_tokens"] = 0
            payload = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": now,
                       "model": self.model, "choices": [{
                           "index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                   "annotations": None, "audio": None, "function_call": None,
                                                   "reasoning": None},
                           "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None,
                           "routed_experts": None}],
                       "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage,
                       "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                       "kv_transfer_params": transfer_params, "ec_transfer_params": None, "metrics": None}
        else:
            payload = {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": now,
                       "model": self.model, "choices": [{
                           "index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                           "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                           "prompt_token_ids": None, "routed_experts": None}],
                       "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage,
                       "kv_transfer_params": transfer_params, "ec_transfer_params": None, "metrics": None}
        if self.faults.cut_bodies > 0:
            self.faults.cut_bodies -= 1
            body = json.dumps(payload, separators=(",", ":")).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": _JSON_HEADERS + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body[:len(body) // 2], "more_body": True})
            raise _Abort()
        await _json(send, 200, payload)

    async def _stream(self, chat: bool, req: dict[str, Any], n: int, prompt_tokens: int, cached: int,
                      send: Any, pace: Callable[[int], Awaitable[None]] | None = None,
                      finished: Callable[[], dict[str, Any] | None] | None = None) -> None:
        pace = pace or self._pace
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}" if chat else f"cmpl-{uuid.uuid4().hex[:16]}"
        now = int(time.time())
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        self.c.streaming += 1
        try:
            await self._stream_events(chat, req, n, rid, now, prompt_tokens, cached, send, pace, finished)
        finally:
            self.c.streaming -= 1

    async def _stream_events(self, chat: bool, req: dict[str, Any], n: int, rid: str, now: int, prompt_tokens: int,
                             cached: int, send: Any, pace: Callable[[int], Awaitable[None]],
                             finished: Callable[[], dict[str, Any] | None] | None) -> None:
        f = self.faults
        sent = 0

        async def emit(obj: dict[str, Any] | str) -> None:
            nonlocal sent
            if sent == f.exit_after_chunks:
                os._exit(17)
            if sent == f.die_after_chunks:
                raise _Abort()  # leaves the response unfinished: the server drops the connection
            if sent == f.stall_after_chunks:
                await asyncio.Event().wait()
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
            await send({"type": "http.response.body", "body": b"data: " + data.encode() + b"\n\n", "more_body": True})
            sent += 1

        if chat:
            head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.model}
            await emit({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                        "prompt_token_ids": None, "prompt_text": None})
            for i in range(n):
                if i:
                    await pace(i)
                last = i == n - 1
                choice: dict[str, Any] = {"index": 0, "delta": {"content": self._text(i)}, "logprobs": None,
                                          "finish_reason": "length" if last else None}
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = None
                self.c.generation_tokens += 1
                await emit({**head, "choices": [choice]})
        else:
            head = {"id": rid, "object": "text_completion", "created": now, "model": self.model}
            for i in range(n):
                if i:
                    await pace(i)
                last = i == n - 1
                self.c.generation_tokens += 1
                await emit({**head, "choices": [{"index": 0, "text": self._text(i), "logprobs": None,
                                                 "finish_reason": "length" if last else None, "stop_reason": None,
                                                 "prompt_token_ids": None, "token_ids": None}]})
        if finished is not None:
            finished()  # kept, though the stream does not say so (nor does vLLM's)
        if (req.get("stream_options") or {}).get("include_usage"):
            details: dict[str, Any] = {"cached_tokens": cached}
            if chat:
                details["created_cache_tokens"] = 0
            await emit({**head, "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                "prompt_tokens_details": details}, "system_fingerprint": FINGERPRINT})
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- tokens ------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        return self.count_tokens_bytes(text.encode())

    def count_tokens_bytes(self, data: bytes) -> int:
        return max(1, math.ceil(len(data) / self.bytes_per_token))

    def token_ids(self, req: dict[str, Any]) -> list[int]:
        return self.prompt_ids(req, "messages" in req)

    def prompt_ids(self, req: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids: the model's tokenizer (chat rendered with its template) if there is one,
        else one id per --bytes-per-token bytes of the text."""
        if self.tokenizer is not None:
            prompts, _ = prompts_of("/v1/chat/completions" if chat else "/v1/completions", req, self.tokenizer)
            if prompts and not isinstance(prompts[0], bytes) and prompts[0]:  # token ids: a list, or an array
                return list(prompts[0])
        return byte_token_ids(prompt_text(req, chat).encode(), self.bytes_per_token)

    # -- metadata ----------------------------------------------------------------------------

    def serves(self, model: Any) -> bool:
        """The base model, or one of the LoRA adapters /v1/models lists now (vLLM serves a loaded adapter by name)."""
        if model == self.model:
            return True
        f = self.faults
        prefix = f"adapter-{f.models_tag}-"
        if not isinstance(model, str) or not model.startswith(prefix):
            return False
        i = model[len(prefix):]
        return i.isdigit() and int(i) < f.extra_models

    def models(self) -> dict[str, Any]:
        f = self.faults
        names = [(self.model, self.root)] + [(f"adapter-{f.models_tag}-{i}", f"/adapters/{f.models_tag}/{i}")
                                             for i in range(f.extra_models)]
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": root, "parent": None if name == self.model else self.model, "max_model_len": self.max_model_len,
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]} for name, root in names]}

    def render_metrics(self) -> str:
        lab = f'engine="0",model_name="{self.model}"'
        c = self.c
        usage = min(1.0, self.kv_blocks_in_use / self.num_gpu_blocks) if self.num_gpu_blocks else 0.0
        running, waiting, queries, hits = c.running, c.waiting, c.prefix_queries, c.prefix_hits
        prompt, generation, preemptions = c.prompt_tokens, c.generation_tokens, 0
        external = c.external_kv_transfer
        e = self.engine
        if e is not None:
            running, waiting, usage = len(e.running), len(e.waiting), e.pool.usage
            queries, hits, prompt, preemptions = e.prefix_queries, e.prefix_hits, e.prompt_tokens, e.preemptions
            external = e.external_hits
        lines = [
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.start_time:.2f}",
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {usage}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{lab}}} {float(queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{lab}}} {float(hits)}",
            "# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector "
            "cross-instance cache sharing, in terms of number of queried tokens.",
            "# TYPE vllm:external_prefix_cache_queries_total counter",
            f"vllm:external_prefix_cache_queries_total{{{lab}}} {float(external)}",
            "# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector "
            "cross-instance cache sharing, in terms of number of cached tokens.",
            "# TYPE vllm:external_prefix_cache_hits_total counter",
            f"vllm:external_prefix_cache_hits_total{{{lab}}} {float(external)}",
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
            f'vllm:prompt_tokens_by_source_total{{{lab},source="local_compute"}} {float(prompt - hits - external)}',
            f'vllm:prompt_tokens_by_source_total{{{lab},source="local_cache_hit"}} {float(hits)}',
            f'vllm:prompt_tokens_by_source_total{{{lab},source="external_kv_transfer"}} {float(external)}',
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lab}}} {float(prompt)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {float(generation)}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{lab}}} {float(preemptions)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason, n in (("stop", 0), ("length", c.completed), ("abort", c.aborted), ("error", c.failed)):
            lines.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{self.model}"}} {float(n)}')
        if e is not None:
            lines += ["# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.",
                      "# TYPE vllm:request_prefill_time_seconds histogram",
                      f'vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="{self.model}"}} '
                      f'{float(e.prefill_requests)}',
                      f"vllm:request_prefill_time_seconds_count{{{lab}}} {float(e.prefill_requests)}",
                      f"vllm:request_prefill_time_seconds_sum{{{lab}}} {e.prefill_seconds}",
                      "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.",
                      "# TYPE vllm:request_queue_time_seconds histogram",
                      f'vllm:request_queue_time_seconds_bucket{{engine="0",le="+Inf",model_name="{self.model}"}} '
                      f'{float(e.prefill_requests)}',
                      f"vllm:request_queue_time_seconds_count{{{lab}}} {float(e.prefill_requests)}",
                      f"vllm:request_queue_time_seconds_sum{{{lab}}} {e.queue_seconds}"]
            h = e.ttft
            lines += ["# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
                      "# TYPE vllm:time_to_first_token_seconds histogram"]
            lines += [f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{b}",model_name="{self.model}"}} '
                      f'{float(n)}' for b, n in zip(h.bounds, h.buckets)]
            lines += [f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{self.model}"}} '
                      f'{float(h.count)}',
                      f"vllm:time_to_first_token_seconds_count{{{lab}}} {float(h.count)}",
                      f"vllm:time_to_first_token_seconds_sum{{{lab}}} {h.sum}"]
        lines += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",engine="0",'
            f'kv_cache_size_tokens="{self.block_size * self.num_gpu_blocks}",num_gpu_blocks="{self.num_gpu_blocks}",'
            f'prefix_caching_hash_algo="sha256"}} 1.0',
        ]
        return "\n".join(lines) + "\n" + self._metrics_rest


# -- helpers -------------------------------------------------------------------------------


_TRUE = ("true", "1", "yes", "on", "t", "y")
_FALSE = ("false", "0", "no", "off", "f", "n")


def _lax_bool(v: Any) -> bool:
    """A boolean as pydantic reads one (lax mode); callers check validity with :func:`_invalid_fields`."""
    if isinstance(v, str):
        return v.strip().lower() in _TRUE
    return bool(v)


def _lax_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, str):
        return int(v.strip())
    return int(v)


def _priority(req: dict[str, Any]) -> int:
    v = req.get("priority", 0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _invalid_fields(req: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) of the first field vLLM's request model would refuse, or None."""
    for name in ("max_tokens", "max_completion_tokens", "n", "max_output_tokens"):
        v = req.get(name)
        if v is None:
            continue
        ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()) or \
            (isinstance(v, str) and v.strip().lstrip("+-").isdigit())
        if not ok:
            return name, (f"1 validation error:\n  {{'type': 'int_parsing', 'loc': ('body', '{name}'), 'msg': "
                          f"'Input should be a valid integer, unable to parse string as an integer', 'input': {v!r:.40}}}")
    for name in ("stream", "ignore_eos", "echo"):
        v = req.get(name)
        if v is None or isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
            continue
        if not (isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE):
            return name, (f"1 validation error:\n  {{'type': 'bool_parsing', 'loc': ('body', '{name}'), 'msg': "
                          f"'Input should be a valid boolean, unable to interpret input', 'input': {v!r:.40}}}")
    v = req.get("stream_options")
    if v is not None and not isinstance(v, dict):  # vLLM's StreamOptions model
        return "stream_options", (f"1 validation error:\n  {{'type': 'model_attributes_type', 'loc': ('body', "
                                  f"'stream_options'), 'msg': 'Input should be a valid dictionary or object to "
                                  f"extract fields from', 'input': {v!r:.40}}}")
    return None


def _error(message: str, type: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        if value.get("type") == "text":
            return str(value.get("text", ""))
        if value.get("type") == "image_url":
            return "<image>"
        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def byte_token_ids(raw: bytes, bytes_per_token: int = 4) -> list[int]:
    """Without a tokenizer: one token id per ``bytes_per_token`` bytes."""
    step = bytes_per_token
    return [int.from_bytes(raw[i:i + step], "little") % 32000 for i in range(0, len(raw), step)] or [0]


def prompt_text(req: dict[str, Any], chat: bool) -> str:
    if not chat:
        return _text_of(req.get("prompt", ""))
    parts = []
    for m in req.get("messages") or []:
        if isinstance(m, dict):
            parts.append(f"<|{m.get('role', 'user')}|>\n{_text_of(m.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Any, status: int, obj: Any) -> None:
    await _respond(send, status, json.dumps(obj, separators=(",", ":")).encode(), _JSON_HEADERS)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.simulator", description="vLLM stand-in for tests and demos")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", "--base-port", type=int, default=9001, help="port (of the first replica)")
    p.add_argument("--replicas", type=int, default=1, help="replicas served by this process, on consecutive ports")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--root", help="the model's root reported in /v1/models (default /models/MODEL)")
    p.add_argument("--ttft-ms", type=float, default=20.0, help="time to first token, fixed part")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0, help="time to first token, per prompt token")
    p.add_argument("--itl-ms", type=float, default=5.0, help="time between output tokens")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once; the rest wait")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="as vllm's: the waiting requests in arrival order, or by their priority (lower first); "
                        "fcfs refuses a priority other than 0 (400)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--num-gpu-blocks", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--bytes-per-token", type=int, default=4)
    p.add_argument("--store-responses", action="store_true",
                   help="keep /v1/responses answers for previous_response_id and GET /v1/responses/{id}, in this "
                        "replica's memory only (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="require this bearer key, like vllm --api-key")
    p.add_argument("--seed", type=int)
    p.add_argument("--kv-events", action="store_true", help="publish KV-cache events (ZMQ, as vLLM's "
                   "--kv-events-config with publisher zmq) and answer /kv_event_sources")
    p.add_argument("--kv-events-port", type=int, default=0, help="PUB port (default: a free one)")
    p.add_argument("--kv-replay-port", type=int, default=0, help="replay ROUTER port (default: a free one)")
    p.add_argument("--no-kv-replay", action="store_true", help="publish without a replay endpoint")
    p.add_argument("--kv-events-buffer", type=int, default=10_000, help="batches kept for replay (buffer_steps)")
    t = p.add_argument_group("KV transfer", "disaggregated prefill and decode as vLLM's NixlConnector does them "
                             "(loadtest/kv_transfer.py): a request's kv_transfer_params ask for a prefill kept for "
                             "another replica, or for a decode that reads its prompt's KV from one")
    t.add_argument("--kv-connector", choices=["NixlConnector"], help="as vllm --kv-transfer-config "
                   "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'")
    t.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail",
                   help="a decode whose KV cannot be read fails (vLLM's default) or computes its prompt")
    t.add_argument("--kv-bytes-per-token", type=int, default=1024, help="KV cache bytes per token (all layers; "
                   "default: the tiny model's, 2 layers x 2 x 4 heads x 32 x 2 bytes)")
    t.add_argument("--kv-link-gbps", type=float, default=25.0, help="GB/s a decode replica reads KV at")
    t.add_argument("--kv-link-latency-ms", type=float, default=0.5, help="fixed time of one read")
    t.add_argument("--kv-lease-s", type=float, default=30.0, help="a kept prefill's blocks are freed this long "
                   "after it unless a decode replica read them or renewed the lease (kv_lease_duration)")
    t.add_argument("--tensor-parallel-size", type=int, default=1, help="reported as tp_size in kv_transfer_params")
    e = p.add_argument_group("engine", "with --engine, a modelled vLLM engine schedules, times and caches the "
                             "requests (loadtest/engine.py); --ttft-ms and --itl-ms do not apply")
    e.add_argument("--engine", action="store_true", help="queue, batch, allocate KV blocks and preempt like vLLM")
    e.add_argument("--profile", choices=sorted(PROFILES), help="a platform's KV cache and step times "
                   "(loadtest/profiles.py); implies --engine; flags given with it win")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens one engine step takes")
    e.add_argument("--step-base-ms", type=float, default=5.0, help="fixed time of an engine step")
    e.add_argument("--step-prefill-us-per-token", type=float, default=10.0, help="step time per prefill token")
    e.add_argument("--step-decode-us-per-seq", type=float, default=200.0, help="step time per decoding sequence")
    e.add_argument("--step-prefill-base-ms", type=float, default=0.0, help="more time for a step with any prefill")
    e.add_argument("--step-context-ns-per-token", type=float, default=10.0,
                   help="step time per token of the decoding sequences' context")
    e.add_argument("--frontend-ms", type=float, default=0.0, help="time a request spends in the API server before "
                   "the engine sees it (part of its time to first token, not of an engine step)")
    e.add_argument("--time-scale", type=float, default=1.0, help="real seconds per modelled second (above 1: slower)")
    for name in ("fail_status", "fail_count", "health_status", "die_after_chunks", "exit_after_chunks",
                 "stall_after_chunks", "cut_bodies"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(Faults(), name))
    p.add_argument("--hang", action="store_true")
    p.add_argument("--warmup-s", type=float, default=0.0, help="seconds before the server listens (a Gaudi replica "
                   "compiles its graphs before it binds its port: connections are refused meanwhile)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    known, _ = p.parse_known_args(argv)
    if known.profile:
        prof = PROFILES[known.profile]
        c = prof.cost
        p.set_defaults(engine=True, block_size=prof.block_size, num_gpu_blocks=prof.num_gpu_blocks,
                       kv_bytes_per_token=prof.kv_bytes_per_token, kv_link_gbps=prof.link_bytes_per_s / 1e9,
                       tensor_parallel_size=prof.tensor_parallel_size,
                       max_num_seqs=prof.max_num_seqs, max_num_batched_tokens=prof.max_num_batched_tokens,
                       step_base_ms=c.base_s * 1e3, step_prefill_us_per_token=c.prefill_s_per_token * 1e6,
                       step_decode_us_per_seq=c.decode_s_per_seq * 1e6,
                       step_context_ns_per_token=c.context_s_per_token * 1e9, frontend_ms=prof.frontend_s * 1e3,
                       step_prefill_base_ms=c.prefill_base_s * 1e3)
    args = p.parse_args(argv)
    if args.warmup_s > 0:
        time.sleep(args.warmup_s)
    apps = [build(args, i) for i in range(args.replicas)]
    import uvicorn

    if len(apps) == 1:
        uvicorn.run(apps[0], host=args.host, port=args.port, loop="auto", http="httptools", log_level="warning",
                    access_log=False, server_header=False, date_header=True, timeout_graceful_shutdown=1)
        return 0

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # one handler for all of them, below
            yield

    servers = [Server(uvicorn.Config(app, host=args.host, port=args.port + i, loop="auto", http="httptools",
                                     log_level="warning", access_log=False, server_header=False, date_header=True,
                                     timeout_graceful_shutdown=1)) for i, app in enumerate(apps)]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: [setattr(s, "should_exit", True) for s in servers])
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve())
    return 0


def build(args: argparse.Namespace, index: int = 0) -> VLLMSimulator:
    """Replica ``index`` of the command line's: its own port, event ports, engine and seed."""
    faults = Faults(**{k: getattr(args, k) for k in asdict(Faults()) if hasattr(args, k)})  # the rest via /sim/faults
    seed = None if args.seed is None else args.seed + index
    publisher = KvPublisher(args.host, args.kv_events_port + index if args.kv_events_port else 0,
                            None if args.no_kv_replay else (args.kv_replay_port + index if args.kv_replay_port else 0),
                            args.kv_events_buffer) if args.kv_events else None
    transfer = None
    if args.kv_connector:
        transfer = KvTransfer(args.host, args.port + index, kv_bytes_per_token=args.kv_bytes_per_token,
                              bandwidth=args.kv_link_gbps * 1e9, latency_s=args.kv_link_latency_ms / 1e3,
                              failure_policy=args.kv_load_failure_policy, lease_s=args.kv_lease_s,
                              tp_size=args.tensor_parallel_size, time_scale=args.time_scale)
    engine = None
    if args.engine:
        cost = StepCost(args.step_base_ms / 1e3, args.step_prefill_us_per_token / 1e6,
                        args.step_decode_us_per_seq / 1e6, args.step_context_ns_per_token / 1e9,
                        args.step_prefill_base_ms / 1e3)
        engine = Engine(args.block_size, args.num_gpu_blocks, args.max_num_seqs, args.max_num_batched_tokens, cost,
                        stored=(lambda h, parent, t: publisher.stored(h, parent, t, args.block_size)) if publisher else None,
                        removed=publisher.removed if publisher else None, seed=seed,
                        frontend_s=args.frontend_ms / 1e3)
    return VLLMSimulator(args.model, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                         prefill_us_per_token=args.prefill_us_per_token, max_num_seqs=args.max_num_seqs,
                         block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                         max_model_len=args.max_model_len, bytes_per_token=args.bytes_per_token,
                         api_key=args.api_key, faults=faults, seed=seed, root=args.root,
                         kv_events=publisher, engine=engine, time_scale=args.time_scale,
                         store_responses=args.store_responses, transfer=transfer,
                         scheduling_policy=args.scheduling_policy)


if __name__ == "__main__":
    raise SystemExit(main())
