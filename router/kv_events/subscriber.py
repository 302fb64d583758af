"""One event source's batches, in order, with lost ones recovered.

A :class:`Subscriber` reads one publisher (a replica, or one data-parallel rank of it): a SUB
socket for the live stream and, when the replica has one, a DEALER socket to its replay endpoint.
It hands each batch to its sink exactly once and in sequence order:

- on (re)connecting it asks the replay endpoint for everything after the last batch applied
  (from 0 the first time), since a subscriber misses what was published before it joined;
- a sequence number past the next one is a gap: the missing batches are asked for; if the replay
  endpoint is missing or no longer holds them, the sink is told to ``rebuild``;
- a number not past the last one is a duplicate (an already applied batch: same or older
  timestamp) or a restart of the publisher (numbers start at 0 in every process): the sink is told
  to ``restart``, and the new process's batches are asked for from 0;
- when no batch came for ``silence_s`` while the replica should have published (``active``), the sockets are
  reopened (a publisher that restarted on another port, a connection a network device dropped).

Every wait has a limit; undecodable messages are counted and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal

import zmq
import zmq.asyncio

from .decode import Batch, DecodeStats, decode_frames

log = logging.getLogger("kvroute.kv_events")

Reset = Literal["rebuild", "restart"]
_DRAIN = 256  # batches read without yielding to the loop, once one is there
_MAX_MESSAGE = 64 << 20  # bytes: a batch of 1,000 blocks of 128 tokens is under 1 MiB
_MAX_REPLAY = 20_000  # batches one replay may return (vLLM keeps 10,000 by default)


@dataclass(frozen=True)
class Endpoints:
    live: str
    replay: str | None = None
    rank: int = 0


@dataclass
class SourceStats:
    batches: int = 0
    last_seq: int | None = None
    last_batch_at: float | None = None  # wall clock
    gaps: int = 0
    replays: int = 0  # gaps (or catch-ups) filled from the replay endpoint
    rebuilds: int = 0
    restarts: int = 0
    reconnects: int = 0
    duplicates: int = 0
    connected: bool = False
    caught_up: bool = False  # the first catch-up is done: the index reflects the replica
    decode: DecodeStats = field(default_factory=DecodeStats)


class Subscriber:
    def __init__(self, ctx: zmq.asyncio.Context, replica: str, endpoints: Endpoints,
                 sink: Callable[[Batch], Awaitable[None]], reset: Callable[[Reset], Awaitable[None]],
                 active: Callable[[], bool], silence_s: float = 10.0, replay_timeout_s: float = 2.0,
                 note: Callable[[str], None] | None = None) -> None:
        self.ctx = ctx
        self.replica = replica
        self.endpoints = endpoints
        self.sink = sink
        self.reset = reset
        self.active = active  # whether the replica should have published since the last batch (see feed)
        self.silence_s = silence_s
        self.replay_timeout_s = replay_timeout_s
        self.stats = SourceStats()
        self._note = note or (lambda kind: None)  # gap, replay, rebuild, restart, reconnect, bad_message
        self._last: int | None = None  # sequence number of the last batch given to the sink
        self._last_ts = 0.0

    def resume_after(self, seq: int, ts: float) -> None:
        """Start after batch ``seq`` (stamped ``ts``), applied by another router before this one."""
        self._last = seq
        self._last_ts = ts
        self.stats.last_seq = seq

    @property
    def position(self) -> tuple[int, float] | None:
        """The last batch given to the sink: (sequence number, its timestamp)."""
        return None if self._last is None or self._last < 0 else (self._last, self._last_ts)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: subscribe, catch up, read; reopen after a silence."""
        while True:
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)  # a larger frame drops the connection, not the router
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                sub.connect(self.endpoints.live)
                self.stats.connected = True
                await self._catch_up()
                self.stats.caught_up = True
                silent = await self._read(sub)
            finally:
                self.stats.connected = False
                sub.close(linger=0)
            self.stats.reconnects += 1
            self._note("reconnect")
            log.warning("KV events of replica %s: no batch for %.0f s while it computed new blocks; reconnecting to %s",
                        self.replica, silent, self.endpoints.live, extra={"replica": self.replica})

    async def _read(self, sub: zmq.asyncio.Socket) -> float:
        """Returns when the source fell silent while the replica was busy: the seconds since its last batch."""
        idle_since = last_batch = time.monotonic()
        while True:
            if not await sub.poll(timeout=1000 * min(1.0, self.silence_s)):
                now = time.monotonic()
                if now - idle_since >= self.silence_s:
                    if self.active():
                        return now - last_batch
                    idle_since = now
                continue
            idle_since = last_batch = time.monotonic()
            for _ in range(_DRAIN):  # take what is queued before yielding
                try:
                    frames = sub.recv_multipart(flags=zmq.NOBLOCK)
                    if isinstance(frames, asyncio.Future):  # the asyncio socket wraps even non-blocking reads
                        frames = await frames
                except zmq.Again:
                    break
                batch = decode_frames(frames, self.stats.decode)
                if batch is None:
                    self._note("bad_message")
                elif batch.seq >= 0:
                    await self._take(batch)

    # -- ordering ------------------------------------------------------------------------------

    async def _take(self, batch: Batch) -> None:
        last = self._last
        if last is None or batch.seq == last + 1:
            await self._apply(batch)
        elif batch.seq <= last:
            if batch.ts <= self._last_ts:
                self.stats.duplicates += 1  # a batch a replay already gave
                return
            self.stats.restarts += 1
            self._note("restart")
            log.warning("KV events of replica %s: sequence went back from %d to %d: the replica restarted",
                        self.replica, last, batch.seq, extra={"replica": self.replica})
            await self.reset("restart")
            self._last = -1
            await self._fill(batch)
        else:
            self.stats.gaps += 1
            self._note("gap")
            await self._fill(batch)

    async def _fill(self, batch: Batch) -> None:
        """``batch`` is past the next number: replay what is missing, or rebuild."""
        assert self._last is not None
        start = self._last + 1
        got = await self._replay(start) if batch.seq > start else []
        if got is None or (batch.seq > start and (not got or got[0].seq != start)):
            self.stats.rebuilds += 1
            self._note("rebuild")
            log.warning("KV events of replica %s: batches %d-%d lost and not replayable: rebuilding its entries from "
                        "the live stream", self.replica, start, batch.seq - 1, extra={"replica": self.replica})
            await self.reset("rebuild")
            self._last = None  # what comes next is applied as it is
        elif got:
            self.stats.replays += 1
            self._note("replay")
        for b in got or ():
            if b.seq < batch.seq:
                await self._take(b)
        if self._last is None or batch.seq > self._last:
            await self._apply(batch)

    async def _catch_up(self) -> None:
        """Everything published after the last batch applied (from 0 the first time)."""
        if self.endpoints.replay is None:
            return
        start = 0 if self._last is None else self._last + 1
        got = await self._replay(start)
        if got is None:
            return
        if not got:
            if self._last is None:
                self._last = -1  # nothing published yet (or nothing kept): the next batch is number 0
            return
        if got[0].seq > start and self._last is not None:
            self.stats.rebuilds += 1
            self._note("rebuild")
            log.warning("KV events of replica %s: batches %d-%d are no longer replayable: rebuilding its entries",
                        self.replica, start, got[0].seq - 1, extra={"replica": self.replica})
            await self.reset("rebuild")
            self._last = None
        self.stats.replays += 1
        self._note("replay")
        for b in got:
            await self._take(b)

    async def _apply(self, batch: Batch) -> None:
        await self.sink(batch)
        self._last = batch.seq
        self._last_ts = batch.ts
        s = self.stats
        s.batches += 1
        s.last_seq = batch.seq
        s.last_batch_at = time.time()

    # -- replay --------------------------------------------------------------------------------

    async def _replay(self, start: int) -> list[Batch] | None:
        """The publisher's buffered batches from ``start`` on, or None without a replay endpoint or answer."""
        endpoint = self.endpoints.replay
        if endpoint is None:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        out: list[Batch] = []
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if not await sock.poll(timeout=1000 * self.replay_timeout_s):
                    log.warning("KV events of replica %s: no answer from the replay endpoint %s within %.1f s",
                                self.replica, endpoint, self.replay_timeout_s, extra={"replica": self.replica})
                    return None
                frames = await sock.recv_multipart()
                b = decode_frames(frames, self.stats.decode)
                if b is None:
                    continue
                if b.seq < 0:
                    return out
                if b.seq >= start:
                    out.append(b)
                    if len(out) > _MAX_REPLAY:  # an endpoint that never ends its answer
                        log.warning("KV events of replica %s: the replay endpoint %s sent over %d batches; ignoring "
                                    "its answer", self.replica, endpoint, _MAX_REPLAY, extra={"replica": self.replica})
                        return None
        finally:
            sock.close(linger=0)
