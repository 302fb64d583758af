"""The event feed: which replicas publish KV-cache events, and their batches applied to the index.

For each ready replica the feed finds its event sources (:mod:`router.kv_events.sources`), waits
until the replica's models have their tokenizers looked for (events carry token ids: only a model
keyed by tokens here can be matched to requests), and runs one :class:`Subscriber` per source
whose batches go to :meth:`TieredIndex.apply_batch`. Once the first catch-up is done the replica is
read from the index's exact tier ("precise"); a replica without events, or whose model is keyed in
byte mode, stays "approximate", and the log says why and what to set.

With a Redis index one router consumes each replica's events for all of them, under a lease
(:mod:`router.kv_events.lease`); the others read the shared exact tier, and take over when the
holder stops renewing.

A restart of the replica (a new process start time in its ``/metrics``, or a sequence number
going back) empties its entries; the sources are looked up again, as a restarted replica may
publish elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from ..background import Background
from ..config import KvEventsConfig
from ..replica_events import Event, EventBus, ReplicaAdded, ReplicaReady, ReplicaRemoved, ReplicaRestarted
from ..index.fallback import SharedIndexDown
from ..index.tiered import Applied, TieredIndex
from ..prompt_keys import PromptKeys
from ..metrics import Metrics
from ..replicas import Replica, ReplicaPool
from ..upstream import UpstreamError
from .decode import Batch
from .lease import Lease
from .sources import NoSource, discover
from .subscriber import Endpoints, Reset, Subscriber

log = logging.getLogger("kvroute.kv_events")

_DISCOVER_RETRY_S = 5.0
_SETTLE_S = 30.0  # longest wait for a replica's tokenizers to be looked for
_LAGS = 1024  # lag samples kept per replica for /admin
# the /metrics series (ReplicaStats fields) that tell whether a replica computed KV blocks
_COMPUTED = frozenset({"prefix_queries", "prefix_hits"})  # and requests prefilled, or else ended


class LeaseLost(Exception):
    """Another router holds the replica's event lease now."""


class ReplicaFeed:
    """What the feed knows and does for one replica (owned by :class:`EventFeed`)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.name = replica.name
        self.mode = "approximate"
        self.reason = "looking for its event sources"
        self.sources: list[Endpoints] = []
        self.subscribers: list[Subscriber] = []
        self.task: asyncio.Task[None] | None = None
        self.lease_held = False
        self.lags: deque[float] = deque(maxlen=_LAGS)
        self.events: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.block_size_warned = False

    def describe(self) -> dict[str, Any]:
        lags = sorted(self.lags)

        def pct(q: float) -> float | None:
            return round(lags[min(len(lags) - 1, int(q * len(lags)))], 6) if lags else None

        subs = [{
            "rank": s.endpoints.rank, "endpoint": s.endpoints.live, "replay_endpoint": s.endpoints.replay,
            "connected": s.stats.connected, "last_seq": s.stats.last_seq, "batches": s.stats.batches,
            "last_batch_age_s": None if s.stats.last_batch_at is None else round(time.time() - s.stats.last_batch_at, 3),
            "gaps": s.stats.gaps, "replays": s.stats.replays, "rebuilds": s.stats.rebuilds,
            "restarts": s.stats.restarts, "reconnects": s.stats.reconnects, "duplicates": s.stats.duplicates,
            "bad_messages": s.stats.decode.bad_messages, "bad_events": s.stats.decode.bad_events,
            "unknown_event_types": dict(s.stats.decode.unknown),
        } for s in self.subscribers]
        return {"mode": self.mode, "reason": self.reason, "lease_held": self.lease_held, "sources": subs,
                "events": dict(self.events), "blocks": dict(self.blocks),
                "lag_p50_s": pct(0.5), "lag_p99_s": pct(0.99)}


class EventFeed:
    def __init__(self, pool: ReplicaPool, index: TieredIndex, keys: PromptKeys, cfg: KvEventsConfig,
                 metrics: Metrics, events: EventBus, lease: Lease | None = None) -> None:
        self.pool = pool
        self.index = index
        self.keys = keys
        self.cfg = cfg
        self.metrics = metrics
        self.lease = lease
        self._feeds = {r.name: ReplicaFeed(r) for r in pool}
        self._ctx: zmq.asyncio.Context | None = None
        self._background = Background()
        events.subscribe(self._on_event)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        if self.lease is not None:
            self._background.spawn(self.lease.count_routers())
        for f in self._feeds.values():
            if f.replica.ready:
                self._ensure(f)

    async def close(self) -> None:
        for f in self._feeds.values():
            await self._stop(f, quiet=True)
        await self._background.close()
        if self.lease is not None:
            await self.lease.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    def describe(self, replica: str) -> dict[str, Any] | None:
        f = self._feeds.get(replica)
        return None if f is None else f.describe()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, ReplicaAdded):
            r = self.pool.get(event.replica)
            if r is not None and event.replica not in self._feeds:
                self._feeds[event.replica] = ReplicaFeed(r)
            return
        f = self._feeds.get(event.replica)
        if f is None or self._ctx is None:
            return
        if isinstance(event, ReplicaReady):
            self._ensure(f)
        elif isinstance(event, ReplicaRestarted):
            self._background.spawn(self._restart(f))
        elif isinstance(event, ReplicaRemoved):
            del self._feeds[event.replica]
            if self.lease is not None:
                self.lease.leave(event.replica)
            self._background.spawn(self._stop(f, quiet=True))

    def _ensure(self, f: ReplicaFeed) -> None:
        if f.task is None or f.task.done():
            f.task = asyncio.create_task(self._watch(f), name=f"kv-events:{f.name}")

    async def _stop(self, f: ReplicaFeed, quiet: bool = False) -> None:
        task, f.task = f.task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if not quiet:
            self._set_mode(f, "approximate", "its events are not read now")

    async def _restart(self, f: ReplicaFeed) -> None:
        """The pool saw a new process: start over (the router already dropped the replica's entries)."""
        await self._stop(f)
        await self.index.restart(f.name, sorted(f.replica.models))
        f.reason = "the replica restarted: looking for its event sources again"
        self._ensure(f)

    def _set_mode(self, f: ReplicaFeed, mode: str, reason: str) -> None:
        if (mode, reason) != (f.mode, f.reason):
            level = logging.INFO if mode == "precise" or f.mode == "approximate" else logging.WARNING
            log.log(level, "replica %s: %s index (%s)", f.name, mode, reason, extra={"replica": f.name})
        f.mode, f.reason = mode, reason
        self.index.set_exact(f.name, mode == "precise")
        self.metrics.index_mode.labels(f.name).set(1 if mode == "precise" else 0)

    # -- one replica ---------------------------------------------------------------------------

    async def _watch(self, f: ReplicaFeed) -> None:
        r = f.replica
        while True:
            try:
                # on the replica's control connection: a shared HTTP client's pool, asked by a thousand
                # replicas at once, spent seconds matching requests to connections
                f.sources = await discover(lambda path: self.pool.fetch(r, path), r.config)
                break
            except NoSource as e:
                self._set_mode(f, "approximate", f"no KV-cache events: {e}")
                return
            except (UpstreamError, TimeoutError, ValueError) as e:
                self._set_mode(f, "approximate", f"cannot ask for its event sources ({e.__class__.__name__}); "
                               f"trying again every {_DISCOVER_RETRY_S:.0f} s")
                await asyncio.sleep(_DISCOVER_RETRY_S)
        why = await self._unkeyed_models(f)
        if why:
            self._set_mode(f, "approximate", why)
            return
        if self.lease is None:
            await self._consume(f)
        else:
            await self._consume_shared(f)

    async def _unkeyed_models(self, f: ReplicaFeed) -> str | None:
        """Why the replica's events cannot be matched to requests, or None."""
        deadline = time.monotonic() + _SETTLE_S
        bases = self._bases(f.replica)
        while not all(self.keys.settled(m) for m in bases) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        unkeyed = sorted(m for m in bases if self.keys.tokenizer(m) is None)
        if unkeyed or not bases:
            names = ", ".join(unkeyed) or "(none listed)"
            return (f"it publishes KV-cache events, but model {names} is keyed in byte mode (no tokenizer on this "
                    f"host), so events cannot be matched to prompts: set prefix.tokenizers.{unkeyed[0] if unkeyed else 'MODEL'}")
        return None

    @staticmethod
    def _bases(r: Replica) -> list[str]:
        """The replica's base models (LoRA adapters name their parent in /v1/models)."""
        cards = r.model_cards
        return sorted(m for m in r.models if not (cards.get(m) or {}).get("parent"))

    def _model_of(self, replica: str, lora_name: str | None) -> str | None:
        if lora_name:
            return lora_name if self.keys.tokenizer(lora_name) is not None else None
        f = self._feeds[replica]
        bases = self._bases(f.replica)
        if not bases or self.keys.tokenizer(bases[0]) is None:
            return None
        return bases[0]

    async def _consume(self, f: ReplicaFeed, resume: dict[int, tuple[int, float]] | None = None) -> None:
        """Run the replica's subscribers until cancelled (or, with a lease, until it is lost)."""
        assert self._ctx is not None
        f.subscribers = [self._subscriber(f, ep) for ep in f.sources]
        for sub in f.subscribers:
            if resume and sub.endpoints.rank in resume:
                sub.resume_after(*resume[sub.endpoints.rank])
        tasks = [asyncio.create_task(self._run(f, s)) for s in f.subscribers]
        try:
            while not all(s.stats.caught_up for s in f.subscribers):
                done = [t for t in tasks if t.done()]
                if done:
                    await done[0]  # a lost lease ends the wait
                await asyncio.sleep(0.01)
            self._set_mode(f, "precise", "events from " + ", ".join(ep.live for ep in f.sources))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _consume_shared(self, f: ReplicaFeed) -> None:
        """With a Redis index: consume while holding the replica's lease, else read what the holder applies.

        A free lease is taken by a router below its fair share, or by any router once it has been free for half
        a lease period (so no replica waits on a miscount, e.g. a router that died and is still counted); the
        leases a router holds beyond its share are handed on at their next renewal, except one it took that way."""
        assert self.lease is not None
        self.lease.take_part(f.name)
        free_since: float | None = None
        while True:
            try:
                now = time.monotonic()
                # free for half a lease period: the routers below their share had two chances to take it
                overdue = free_since is not None and now - free_since >= self.cfg.lease_s / 2
                if (self.lease.holding < self.lease.fair_share() or overdue) and await self.lease.acquire(f.name):
                    free_since = None
                    await self._hold(f, keep=overdue)
                else:
                    holder = await self.lease.holder_of(f.name)
                    if holder is not None:
                        free_since = None
                        self._set_mode(f, "precise", f"events applied by router {holder}")
                    else:
                        free_since = free_since if free_since is not None else now
                        self._set_mode(f, "approximate", "no router holds its event lease yet")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down: the index falls back by itself; try again soon
                log.warning("replica %s: event lease unavailable (%s)", f.name, e.__class__.__name__,
                            extra={"replica": f.name})
            await asyncio.sleep(self.cfg.lease_s / 3)

    async def _hold(self, f: ReplicaFeed, keep: bool = False) -> None:
        """Consume the replica's events from where the previous holder stopped, while the lease renews, and
        until this router holds more than its fair share (unless ``keep``)."""
        assert self.lease is not None
        lease = self.lease
        f.lease_held = True
        self.metrics.kv_event_lease.labels(f.name).set(1)
        log.info("replica %s: this router consumes its KV-cache events (lease acquired)", f.name,
                 extra={"replica": f.name})
        consumer: asyncio.Task[None] | None = None
        try:
            resume = await lease.positions(f.name)
            self.index.drop_sources(f.name)
            limit = self._limit(f)
            for ep in f.sources:
                self.index.source(f.name, ep.rank, limit, journal=True).restore(await lease.load_map(f.name, ep.rank))
            consumer = asyncio.create_task(self._consume(f, resume))
            while True:
                await asyncio.wait([consumer], timeout=self.cfg.lease_s / 3)
                if consumer.done():
                    await consumer  # raises why it ended
                    return
                if not await lease.renew(f.name):
                    raise LeaseLost()
                if not keep and lease.beyond_share(f.name):
                    await lease.release(f.name)
                    log.info("replica %s: event lease handed on (this router holds more than its share of %d)",
                             f.name, lease.fair_share(), extra={"replica": f.name})
                    return
        except LeaseLost:
            log.warning("replica %s: event lease lost; another router consumes its events now", f.name,
                        extra={"replica": f.name})
        finally:
            if consumer is not None:
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
            self.index.drop_sources(f.name)
            f.lease_held = False
            self.metrics.kv_event_lease.labels(f.name).set(0)

    def _subscriber(self, f: ReplicaFeed, ep: Endpoints) -> Subscriber:
        assert self._ctx is not None
        r = f.replica
        busy = [False]  # whether it computed blocks over the silence before

        async def sink(batch: Batch) -> None:
            busy[0] = False  # it publishes: a silence before this batch counts no more
            await self._apply(f, ep.rank, batch)

        async def reset(kind: Reset) -> None:
            models = sorted(r.models)
            if kind == "restart":
                await self.index.restart(f.name, models)
                if self.lease is not None:
                    await self.lease.forget(f.name, [s.rank for s in f.sources])
            else:
                await self.index.rebuild(f.name, models)

        def look() -> tuple[str, float, float]:
            stats = r.stats
            if stats is not None and _COMPUTED <= stats.seen:
                if "prefill_requests" in stats.seen:
                    return "computed", stats.prefix_queries - stats.prefix_hits, stats.prefill_requests
                if "finished" in stats.seen:  # requests that ended, where the prefilled are not counted
                    return "computed", stats.prefix_queries - stats.prefix_hits, stats.finished
            return "served", self.index.decisions(f.name), stats.prefix_queries if stats is not None else 0.0

        def computed() -> bool:
            """The replica computed KV blocks since the last look, so it should have published some. By its
            /metrics: more than a block of prompt tokens computed per request prefilled (or ended), on average (a
            request's computed part begins at a block boundary, so one of them filled a new block). Requests that
            find all but a partial last block cached store none, and a replica serving only those is quiet, not
            silent. Without those series: any request routed there by this router or another."""
            seen = look()
            before, last[0] = last[0], seen
            if before[0] != seen[0]:
                return seen[0] == "served"  # no figure to compare yet (its metrics just came)
            if seen[0] == "served":
                return seen != before
            tokens, requests = seen[1] - before[1], seen[2] - before[2]
            if tokens < 0 or requests < 0:
                return True  # its counters started over: a new process, maybe publishing elsewhere now
            return requests > 0 and tokens > requests * r.block_size

        def active() -> bool:
            """It computed blocks over two silences in a row: a scrape can show blocks computed just before the
            last batch after it, and counted once, the end of every replayed trace reconnected its feeds with a
            warning (a feed that delivers a batch starts the count again)."""
            now = computed()
            before, busy[0] = busy[0], now
            return now and before

        last = [look()]  # this source's last look: from when it is read

        def note(kind: str) -> None:
            self.metrics.child(self.metrics.kv_event_recoveries, f.name, kind).inc()

        return Subscriber(self._ctx, f.name, ep, sink, reset, active, self.cfg.silence_s, self.cfg.replay_timeout_s,
                          note)

    async def _run(self, f: ReplicaFeed, sub: Subscriber) -> None:
        """A subscriber, started again after an unexpected error (one bad batch must not end the feed)."""
        while True:
            try:
                await sub.run()
            except (asyncio.CancelledError, LeaseLost):
                raise
            except SharedIndexDown:
                # the batch was not applied: once Redis answers, the catch-up replays it
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("KV events of replica %s: subscriber failed; starting it again in 1 s", f.name,
                              extra={"replica": f.name})
                await asyncio.sleep(1.0)

    @staticmethod
    def _limit(f: ReplicaFeed) -> int:
        return max(1024, 2 * f.replica.kv_blocks)

    async def _apply(self, f: ReplicaFeed, rank: int, batch: Batch) -> None:
        applied = await self.index.apply_batch(f.name, rank, batch, self._model_of, self._limit(f),
                                               max(1, f.replica.kv_blocks))
        if self.lease is not None:
            changed, gone = self.index.source(f.name, rank).take_changes()
            if not await self.lease.save(f.name, rank, batch.seq, batch.ts, changed, gone):
                raise LeaseLost()
        self._count(f, batch, applied)

    def _count(self, f: ReplicaFeed, batch: Batch, applied: Applied) -> None:
        m = self.metrics
        lag = max(0.0, time.time() - batch.ts)
        f.lags.append(lag)
        m.child(m.kv_event_lag, f.name).observe(lag)
        for e in batch.events:  # the decoder keeps only the types it knows
            kind = type(e).__name__
            f.events[kind] = f.events.get(kind, 0) + 1
            m.child(m.kv_events, f.name, kind).inc()
        for op in ("stored", "removed", "reconfirmed", "orphans", "unkeyed", "evicted"):
            n = getattr(applied, op)
            if n:
                f.blocks[op] = f.blocks.get(op, 0) + n
                m.child(m.kv_event_blocks, f.name, op).inc(n)
        if applied.block_sizes and not f.block_size_warned and f.replica.block_size not in applied.block_sizes:
            f.block_size_warned = True
            log.warning("replica %s: its events have blocks of %s tokens but the router keys its prompts in blocks of "
                        "%d: set replicas[].block_size", f.name, sorted(applied.block_sizes), f.replica.block_size,
                        extra={"replica": f.name})
