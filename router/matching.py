"""How much of a request's prompt each replica holds in its KV cache, and recording where it went.

Before routing, :meth:`Matcher.annotate` looks the request's hash chains up in the prefix
index and fills ``RouteRequest.cached`` with the predicted cached tokens per replica. After
routing, :meth:`Matcher.record` tells the index that the chosen replica now holds the prompt.

With a Redis index the router also keeps every decision in its own in-process index. A Redis
call that fails or takes longer than ``index.timeout_s`` never fails a request: that lookup falls
back to the local index and the failure is counted. Once Redis looks down (an error other than a
timeout, or ``index.trip_after`` timeouts in a row) it is logged and left alone for
``index.retry_after_s`` before it is tried again (the client reconnects by itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, Sequence

from .config import ConfigError, IndexConfig, PrefixConfig
from .events import Event, ReplicaRemoved, ReplicaRestarted
from .index import PrefixIndex, build_index
from .index.memory import MemoryIndex
from .metrics import Metrics
from .policy import RouteRequest
from .pool import Replica, ReplicaPool
from .prefix import PromptKey, key_for
from .tokenizer import LocalTokenizer, TokenizerError

log = logging.getLogger("kvroute.matching")

_INLINE_TOKENIZE_BYTES = 8192


def _load(field: str, path: str) -> LocalTokenizer:
    try:
        return LocalTokenizer(path)
    except TokenizerError as e:
        raise ConfigError(f"invalid configuration:\n  {field}: {e}") from None


def cached_tokens(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens a replica would serve from cache: whole blocks, and never the prompt's last token (as vLLM)."""
    return min(matched_blocks * block_size, (prompt_tokens - 1) // block_size * block_size) if prompt_tokens else 0


class Matcher:
    def __init__(self, pool: ReplicaPool, index: IndexConfig, prefix: PrefixConfig, metrics: Metrics) -> None:
        self.pool = pool
        self.cfg = index
        self.prefix = prefix
        self.metrics = metrics
        self.local = MemoryIndex()
        self.shared: PrefixIndex | None = None if index.backend == "memory" else build_index(
            index.backend, namespace=index.namespace, timeout_s=index.timeout_s)
        self._shared_down_until = 0.0
        self._consecutive_failures = 0
        self._background: set[asyncio.Task[Any]] = set()
        self._m_lookup = metrics.index_lookup
        self._default_tokenizer = _load("prefix.tokenizer", prefix.tokenizer) if prefix.tokenizer else None
        self._tokenizers = {m: _load(f"prefix.tokenizers.{m}", p) for m, p in prefix.tokenizers.items()}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = 100_000
        self._sizes_task: asyncio.Task[None] | None = None
        pool.events.subscribe(self._on_event)

    def start(self) -> None:
        self._sizes_task = asyncio.get_running_loop().create_task(self._sizes_loop())
        if self.shared is not None:
            self._spawn(self._warm())

    async def _warm(self) -> None:
        assert self.shared is not None
        while True:
            try:
                await asyncio.wait_for(self.shared.warm(), max(1.0, self.cfg.timeout_s))
                log.info("prefix index: Redis at %s is ready", self.cfg.backend.split("@")[-1])
                return
            except Exception as e:
                self._shared_failed("connect", e)
                await asyncio.sleep(self.cfg.retry_after_s)

    async def _sizes_loop(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            try:
                await self.refresh_sizes()
            except Exception:
                log.exception("index size refresh failed")

    # -- sessions ----------------------------------------------------------------------------

    def session_replica(self, session_id: str | None) -> str | None:
        return self._sessions.get(session_id) if session_id else None

    def remember_session(self, session_id: str | None, replica: str) -> None:
        if not session_id:
            return
        self._sessions[session_id] = replica
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    @property
    def backend(self) -> str:
        return "memory" if self.shared is None else "redis"

    # -- keys --------------------------------------------------------------------------------

    async def key(self, path: str, payload: dict[str, Any], model: str | None,
                  body_size: int = 0) -> PromptKey | None:
        if model is None:
            return None
        tokenizer = self._tokenizers.get(model, self._default_tokenizer)
        if tokenizer is not None and body_size > _INLINE_TOKENIZE_BYTES:
            # long prompts are tokenized off the event loop (the tokenizers package releases the GIL)
            return await asyncio.to_thread(key_for, path, payload, model, self.prefix.bytes_per_token, tokenizer)
        return key_for(path, payload, model, self.prefix.bytes_per_token, tokenizer)

    # -- lookup ------------------------------------------------------------------------------

    def _shared_usable(self) -> bool:
        return self.shared is not None and time.monotonic() >= self._shared_down_until

    def _shared_failed(self, op: str, e: BaseException) -> None:
        """Count a failed Redis call; stop asking Redis for a while once it looks down.

        A lone slow answer (a timeout) on a busy machine only sends that request to the local index;
        ``index.trip_after`` timeouts in a row, or any other error (refused, reset), trip the fallback.
        """
        self.metrics.index_errors.labels(op).inc()
        self._consecutive_failures += 1
        if isinstance(e, TimeoutError) and self._consecutive_failures < self.cfg.trip_after:
            return
        if time.monotonic() >= self._shared_down_until:
            log.warning("Redis index %s failed (%s); using the local index for %.1f s", op,
                        e.__class__.__name__, self.cfg.retry_after_s)
        self._shared_down_until = time.monotonic() + self.cfg.retry_after_s
        self.metrics.index_fallback.set(1)

    def _shared_ok(self) -> None:
        self._consecutive_failures = 0
        self.metrics.index_fallback.set(0)

    async def annotate(self, req: RouteRequest, replicas: Sequence[Replica]) -> None:
        """Fill ``req.cached`` and ``req.occupancy`` for every replica that could serve the request."""
        key = req.key
        if key is None or req.model is None:
            return
        tokens = key.prompt_tokens()
        req.prompt_tokens = sum(tokens)
        by_block: dict[int, list[Replica]] = {}
        for r in replicas:
            if r.ready and req.model in r.models:
                by_block.setdefault(r.block_size, []).append(r)
        started = time.perf_counter()
        for block, group in by_block.items():
            names = [r.name for r in group]
            matched = {n: 0 for n in names}
            held = {n: 0 for n in names}
            # one lookup per prompt; a batch of prompts is keyed prompt by prompt
            for chain, n_tokens in zip(key.chains(block), tokens):
                for name, (blocks, size) in (await self._probe(req.model, chain, names, req)).items():
                    matched[name] += cached_tokens(blocks, block, n_tokens)
                    held[name] = size
            req.cached.update(matched)
            for r in group:
                req.occupancy[r.name] = min(1.0, held[r.name] / r.kv_blocks)
        self._m_lookup.observe(time.perf_counter() - started)

    async def _probe(self, model: str, chain: list[int], names: list[str],
                     req: RouteRequest) -> dict[str, tuple[int, int]]:
        # a prompt shorter than a block matches nothing anywhere: its sizes are not worth a round trip
        if self.shared is not None and chain:
            if self._shared_usable():
                try:
                    async with asyncio.timeout(self.cfg.timeout_s):  # no extra task, unlike wait_for
                        found = await self.shared.probe(model, chain, names)
                    self._shared_ok()
                    return found
                except Exception as e:  # Redis down, slow or confused: route on local knowledge
                    self._shared_failed("lookup", e)
            req.index_fallback = True
        return self.local.probe_now(model, chain, names)

    # -- record ------------------------------------------------------------------------------

    def record(self, req: RouteRequest, replica: Replica) -> None:
        key = req.key
        if key is None or req.model is None:
            return
        capacity = replica.kv_blocks
        chains = key.chains(replica.block_size)
        for chain in chains:
            self.local.record_now(req.model, replica.name, chain, capacity)
        if self.shared is not None:
            # even while lookups use the local index: other routers need this decision as soon as
            # Redis answers again (a failed record costs one background task, bounded by its timeout)
            self._spawn(self._record_shared(req.model, replica.name, chains, capacity))

    async def _record_shared(self, model: str, replica: str, chains: list[list[int]], capacity: int) -> None:
        assert self.shared is not None
        try:
            for chain in chains:
                await asyncio.wait_for(self.shared.record(model, replica, chain, capacity),
                                       max(self.cfg.timeout_s, 1.0))
        except TimeoutError as e:  # off the request's path: slow is not down, lookups decide that
            self.metrics.index_errors.labels("record").inc()
            log.debug("Redis index record timed out (%s)", e.__class__.__name__)
        except Exception as e:
            self._shared_failed("record", e)

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, (ReplicaRestarted, ReplicaRemoved)):
            replica = self.pool.get(event.replica)
            models = sorted(replica.models) if replica is not None else []
            self._spawn(self.forget(event.replica, models))

    async def forget(self, replica: str, models: Sequence[str]) -> None:
        await self.local.forget(replica, models)
        if self.shared is not None:
            try:
                await asyncio.wait_for(self.shared.forget(replica, models), max(self.cfg.timeout_s, 1.0))
            except Exception as e:
                self._shared_failed("forget", e)
        log.info("prefix index: forgot everything replica %s held", replica, extra={"replica": replica})

    async def refresh_sizes(self) -> None:
        """Update the per-replica index size gauge (local view: what this router has recorded)."""
        for r in self.pool:
            total = 0
            for model in r.models:
                total += await self.local.size(model, r.name)
            self.metrics.index_blocks.labels(r.name).set(total)

    async def close(self) -> None:
        if self._sizes_task is not None:
            self._sizes_task.cancel()
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.shared is not None:
            await self.shared.close()
