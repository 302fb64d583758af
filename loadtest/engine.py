"""A vLLM engine in miniature: the scheduler, the KV block pool and the prefix cache that make a replica
queue like one.

One :class:`Engine` per replica. Each :meth:`Engine.step` schedules as vLLM's v1 scheduler does:

- the running requests first, in order: each decodes one token, or prefills its next chunk of the
  prompt, within the step's token budget (``max_num_batched_tokens``); a request whose next tokens
  need a KV block when none is free preempts the newest running request (its blocks are freed and
  it goes back to the front of the queue, to be recomputed), or itself if it is the newest;
- then the waiting requests, first come first served, while the budget lasts and fewer than
  ``max_num_seqs`` run: each first takes the longest prefix of its prompt the cache holds (whole
  blocks, never the prompt's last token), then the blocks its first chunk needs, or waits.

The step takes :meth:`StepCost.time` seconds: a fixed part, the prefill tokens, the decoding
sequences and their context (attention reads every decoding sequence's KV). A request whose
prompt is fully computed at the end of a step gets its first token then; afterwards one token per
step. Finished requests free their blocks tail first. Free blocks keep their contents and stay in
the prefix cache until they are reused, least recently freed first: that is the prefix cache.
Prompt blocks are hashed in a chain (each block's hash covers its parent's) when they are full; a
block whose hash is cached already by another block is not cached twice. Blocks of generated
tokens take space like any other but are not hashed (the workloads never send a model's own output
back).

Callbacks announce what vLLM's KV events would (``stored``: newly cached blocks with their parent
and token ids; ``removed``: evicted ones), so the stand-in can publish them.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from router.prefix import chain_tokens


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step: ``base_s + prefill_s_per_token x prefill tokens + decode_s_per_seq x decoding
    sequences + context_s_per_token x their context tokens``, and ``prefill_base_s`` more for a step with any
    prefill (preparing new sequences' inputs)."""

    base_s: float = 0.005
    prefill_s_per_token: float = 1e-5
    decode_s_per_seq: float = 2e-4
    context_s_per_token: float = 1e-8
    prefill_base_s: float = 0.0

    def time(self, prefill_tokens: int, decode_seqs: int, decode_context: int) -> float:
        return (self.base_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_seqs
                + self.context_s_per_token * decode_context + (self.prefill_base_s if prefill_tokens else 0.0))


# vLLM 0.32's bucket bounds for vllm:time_to_first_token_seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)


class Histogram:
    """Cumulative bucket counts, a count and a sum, as Prometheus exposes a histogram."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.buckets[i] += 1
        self.count += 1
        self.sum += v


class Block:
    __slots__ = ("id", "hash", "ref")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.hash: int | None = None  # set while the block's contents are in the prefix cache
        self.ref = 0


Stored = Callable[[list[int], "int | None", list[int]], None]  # hashes, parent hash, token ids
Removed = Callable[[list[int]], None]


class BlockPool:
    """``num_blocks`` KV blocks; the free ones in the order they will be reused (least recently freed first)."""

    def __init__(self, num_blocks: int, stored: Stored | None = None, removed: Removed | None = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self._stored = stored
        self._removed = removed

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks) if self.blocks else 0.0

    def hit(self, hashes: list[int]) -> list[Block]:
        """The cached blocks of the longest cached prefix of ``hashes``, now held by the caller."""
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        for b in out:
            if b.ref == 0:
                del self.free[b.id]
            b.ref += 1
        return out

    def peek(self, hashes: list[int]) -> int:
        """How many of ``hashes``' leading blocks are cached (the cache left as it is)."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def allocate(self, n: int) -> list[Block] | None:
        """``n`` blocks taken from the head of the free queue (their cached contents evicted), or None."""
        if n > len(self.free):
            return None
        out, evicted = [], []
        for _ in range(n):
            _, b = self.free.popitem(last=False)
            if b.hash is not None:
                del self.cached[b.hash]
                evicted.append(b.hash)
                b.hash = None
            b.ref = 1
            out.append(b)
        if evicted and self._removed is not None:
            self._removed(evicted)
        return out

    def release(self, blocks: list[Block]) -> None:
        """A request let go of ``blocks``: tail first, so a prompt's root is the last of them reused."""
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                self.free[b.id] = b

    def cache(self, blocks: list[Block], hashes: list[int], parent: int | None, tokens: list[int],
              block_size: int) -> None:
        """Full prompt blocks, now computed, enter the prefix cache under their chain hashes (``parent``: the
        hash before the first). A hash another block holds already is not cached twice; each run of newly
        cached blocks is announced with its own parent and tokens, as vLLM does."""
        run: list[int] = []
        run_start = 0
        for k, (b, h) in enumerate(zip(blocks, hashes)):
            if b.hash is None and h not in self.cached:
                b.hash = h
                self.cached[h] = b
                if not run:
                    run_start = k
                run.append(h)
            elif run:
                self._announce(run, hashes[run_start - 1] if run_start else parent, tokens, run_start, block_size)
                run = []
        if run:
            self._announce(run, hashes[run_start - 1] if run_start else parent, tokens, run_start, block_size)

    def _announce(self, run: list[int], parent: int | None, tokens: list[int], start: int, block_size: int) -> None:
        if self._stored is not None:
            self._stored(run, parent, tokens[start * block_size:(start + len(run)) * block_size])


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0
    hashes: list[int] = field(default_factory=list)  # chain hashes of the prompt's full blocks
    blocks: list[Block] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is computed
    output: int = 0  # tokens generated
    cached_tokens: int = -1  # prefix-cache hit when first scheduled (-1: not yet)
    offered: int = 0  # prompt blocks already offered to the prefix cache
    scheduled_at: float = 0.0  # when first scheduled
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    # disaggregated prefill and decode (loadtest/kv_transfer.py): a prefill for another replica's decode keeps
    # its blocks when it finishes, until that replica has read them; a decode whose prompt was read from
    # another replica has that many prompt tokens' KV at hand when it is scheduled
    keep_blocks: bool = False
    external_tokens: int = 0

    @property
    def length(self) -> int:
        """Tokens the sequence holds: the prompt and what it generated."""
        return len(self.prompt) + self.output

    @property
    def prefilling(self) -> bool:
        return self.computed < self.length - (1 if self.output else 0)

    @property
    def done(self) -> bool:
        return self.finished_at is not None


@dataclass
class StepResult:
    seconds: float
    tokens: list[Request]  # requests that got a token at the end of this step (first or next)
    finished: list[Request]
    preempted: list[Request]
    prefill_tokens: int
    decode_seqs: int


class Engine:
    def __init__(self, block_size: int = 128, num_blocks: int = 1024, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, cost: StepCost | None = None,
                 stored: Stored | None = None, removed: Removed | None = None, seed: int | None = None,
                 frontend_s: float = 0.0) -> None:
        self.block_size = block_size
        # seconds a request spends in the API server before the engine sees it (parsing, tokenizing, handing it
        # over): part of its time to first token, not of any engine step (the stand-in waits it out before add)
        self.frontend_s = frontend_s
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost = cost or StepCost()
        self.pool = BlockPool(num_blocks, stored, removed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.now = 0.0  # engine time, advanced by each step's duration
        self.seed = (random.Random(seed).getrandbits(64) if seed is not None else random.getrandbits(64))
        # vLLM's counters
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.external_hits = 0  # prompt tokens whose KV was read from another replica
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefill_seconds = 0.0  # summed over requests, from first scheduled to first token
        self.prefill_requests = 0
        self.queue_seconds = 0.0  # summed over requests, from arrival at the engine to first scheduled
        self.ttft = Histogram(TTFT_BUCKETS)  # engine seconds from arrival at the API server to the first token
        self.kept: dict[str, list[Block]] = {}  # finished prefills' blocks, kept for another replica to read

    # -- requests ------------------------------------------------------------------------------

    def chain(self, prompt: list[int]) -> list[int]:
        """The chain hashes of the prompt's full blocks (seeded per engine, as vLLM's are per process)."""
        return chain_tokens(prompt, self.block_size, self.seed)

    def add(self, req: Request) -> None:
        req.hashes = self.chain(req.prompt)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self.pool.release(req.blocks)
            req.blocks = []

    def free_kept(self, request_id: str) -> None:
        """Another replica read (or will never read) a finished prefill's blocks: they go back to the pool."""
        blocks = self.kept.pop(request_id, None)
        if blocks is not None:
            self.pool.release(blocks)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the blocks of running requests stay theirs), as vLLM's endpoint does."""
        for b in self.pool.cached.values():
            b.hash = None
        self.pool.cached.clear()
        for r in self.running:
            r.offered = len(r.prompt) // self.block_size  # their blocks are no longer announced as cached

    # -- one step ------------------------------------------------------------------------------

    def _blocks_for(self, req: Request, tokens: int) -> int:
        return max(0, math.ceil((req.computed + tokens) / self.block_size) - len(req.blocks))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.computed = 0
        req.offered = 0
        req.external_tokens = 0  # the KV read from another replica went with its blocks
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def step(self) -> StepResult:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.length - req.computed, budget) if req.prefilling else 1
            need = self._blocks_for(req, n)
            got = self.pool.allocate(need) if need else []
            while got is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                got = self.pool.allocate(need)
            if got is None:  # it preempted itself
                continue
            req.blocks += got
            scheduled.append((req, n))
            budget -= n
            i += 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0 and not preempted:
            req = self.waiting[0]
            hit: list[Block] = []
            local = req.computed
            if req.computed == 0 and not req.blocks:
                # never the last token: vLLM recomputes it to sample the first output
                usable = (req.length - 1) // self.block_size
                hit = self.pool.hit(req.hashes[:usable])
                req.blocks = list(hit)
                req.computed = len(hit) * self.block_size
                req.offered = len(hit)
                local = req.computed
                # what was read from another replica is computed too (its blocks are allocated below)
                req.computed = max(req.computed, min(req.external_tokens, req.length - 1))
            n = min(req.length - req.computed, budget)
            got = self.pool.allocate(self._blocks_for(req, n))
            if got is None:
                self.pool.release(req.blocks)
                req.blocks = []
                req.computed = 0
                break
            if req.cached_tokens < 0:
                # a prompt read from another replica: vLLM 0.32 counts all of it but its own hits as read (none as
                # computed here), and answers cached_tokens 0
                req.cached_tokens = 0 if req.external_tokens else req.computed
                req.scheduled_at = self.now
                self.prefix_queries += len(req.prompt)
                self.prefix_hits += local
                self.external_hits += (req.length - local) if req.external_tokens else req.computed - local
                self.prompt_tokens += len(req.prompt)
            req.blocks += got
            self.waiting.popleft()
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        prefill = sum(n for r, n in scheduled if r.prefilling)
        decodes = [r for r, n in scheduled if not r.prefilling]
        seconds = self.cost.time(prefill, len(decodes), sum(r.computed for r in decodes)) if scheduled else 0.0
        self.now += seconds
        tokens, finished = [], []
        for req, n in scheduled:
            was_prefilling = req.prefilling
            req.computed += n
            if was_prefilling:
                self._cache_prompt(req)
                if req.prefilling:
                    continue  # more chunks to go
            req.output += 1
            self.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = self.now
                self.ttft.observe(self.frontend_s + self.now - req.arrival)
                self.prefill_seconds += self.now - req.scheduled_at  # vLLM's prefill time: scheduled to first token
                self.queue_seconds += req.scheduled_at - req.arrival  # vLLM's queue time: arrival to scheduled
                self.prefill_requests += 1
            tokens.append(req)
            if req.output >= req.max_tokens:
                req.finished_at = self.now
                self.running.remove(req)
                if req.keep_blocks:
                    self.kept[req.id] = req.blocks
                else:
                    self.pool.release(req.blocks)
                req.blocks = []
                finished.append(req)
        return StepResult(seconds, tokens, finished, preempted, prefill, len(decodes))

    def _cache_prompt(self, req: Request) -> None:
        full = min(req.computed, len(req.prompt)) // self.block_size
        start = req.offered
        if start < full:
            b = self.block_size
            self.pool.cache(req.blocks[start:full], req.hashes[start:full], req.hashes[start - 1] if start else None,
                            req.prompt[start * b:full * b], b)
            req.offered = full


class EngineLoop:
    """An :class:`Engine` in real time: steps back to back while it has work, each lasting its modelled time
    multiplied by ``time_scale`` (above 1 slows the whole replica down, so that a benchmark's router and load
    generator are never what limits it). Each request's queue gets ``True`` per output token, then ``None``
    when it is over (finished, or refused because it can never fit in the KV cache)."""

    def __init__(self, engine: Engine, time_scale: float = 1.0) -> None:
        self.engine = engine
        self.time_scale = time_scale
        self._queues: dict[str, asyncio.Queue[bool | None]] = {}
        self._wake = asyncio.Event()

    def submit(self, req: Request) -> asyncio.Queue[bool | None]:
        q: asyncio.Queue[bool | None] = asyncio.Queue()
        req.arrival = self.engine.now
        self._queues[req.id] = q
        self.engine.add(req)
        self._wake.set()
        return q

    def abort(self, req: Request) -> None:
        self.engine.abort(req)
        self._queues.pop(req.id, None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        e = self.engine
        while True:
            if e.idle:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
                continue
            res = e.step()
            if not res.seconds and not e.running:  # the head of the queue can never get its blocks
                req = e.waiting.popleft()
                q = self._queues.pop(req.id, None)
                if q is not None:
                    q.put_nowait(None)
                continue
            due = max(due, loop.time() - 0.05) + res.seconds * self.time_scale  # no catching up after a stall
            await asyncio.sleep(max(0.0, due - loop.time()))
            for req in res.tokens:
                q = self._queues.get(req.id)
                if q is not None:
                    q.put_nowait(True)
            for req in res.finished:
                q = self._queues.pop(req.id, None)
                if q is not None:
                    q.put_nowait(None)
