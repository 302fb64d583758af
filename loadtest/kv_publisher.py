"""vLLM's ZMQ KV-event publisher, for the stand-in replica.

As in vLLM 0.32: a PUB socket sends each batch as three frames (topic, 8-byte big-endian sequence
number from 0, msgpack payload ``[ts, [event maps with "type"], data_parallel_rank]``); a ROUTER
socket answers a replay request ``[identity, b"", start]`` with every buffered batch from ``start``
on (``[identity, b"", topic, seq, payload]``) and an end marker (seq -1, empty payload). Events
are collected and sent as one batch per flush interval (vLLM: one per engine step).

Fault switches (see the simulator's ``/sim/faults``): ``kv_drop_batches`` numbers and buffers the
next N batches but does not send them (the subscriber sees a gap); ``kv_replay`` false makes the
replay endpoint answer with the end marker only (as if its buffer had moved on); ``kv_drop_removals``
true sends no ``BlockRemoved`` at all (removals lost, or an engine that lies about its cache).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

_END = (-1).to_bytes(8, "big", signed=True)


class KvPublisher:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, replay_port: int | None = 0,
                 buffer_steps: int = 10_000, topic: str = "kv", flush_s: float = 0.005) -> None:
        self.host = host
        self.port = port
        self.replay_port = replay_port  # None: no replay endpoint
        self.topic = topic.encode()
        self.flush_s = flush_s
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.buffer_steps = buffer_steps
        self.seq = 0
        self.pending: list[dict[str, Any]] = []
        self.drop_batches = 0
        self.replay = True
        self.drop_removals = False  # a replica whose events never say a block went (lost, or a lying engine)
        self.sent = 0
        self.dropped = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.port = self._bind(self._pub, self.port)
        self._tasks.append(asyncio.create_task(self._flusher()))
        if self.replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self._bind(self._router, self.replay_port)
            self._tasks.append(asyncio.create_task(self._replayer()))

    def _bind(self, sock: zmq.asyncio.Socket, port: int) -> int:
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{self.host}")

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    def sources(self) -> dict[str, Any]:
        """What vLLM 0.32 answers at ``GET /kv_event_sources``."""
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.port}",
                      "replay_endpoint": f"tcp://*:{self.replay_port}" if self.replay_port is not None else None,
                      "buffer_steps": self.buffer_steps, "hwm": 100_000, "max_queue_size": 100_000,
                      "topic": self.topic.decode()}}

    # -- events --------------------------------------------------------------------------------

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
               medium: str = "GPU") -> None:
        self.pending.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": medium,
                             "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
                             "kv_cache_spec_kind": "full_attention"})

    def removed(self, hashes: list[int], medium: str = "GPU") -> None:
        if self.drop_removals:
            return
        self.pending.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0})

    def cleared(self) -> None:
        self.pending.append({"type": "AllBlocksCleared"})

    def restart(self) -> None:
        """A new publisher process: numbers from 0 again, nothing buffered, nothing pending."""
        self.seq = 0
        self.buffer.clear()
        self.pending.clear()

    def flush(self) -> None:
        if not self.pending:
            return
        payload = msgspec.msgpack.encode([time.time(), self.pending, 0])
        self.pending = []
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.drop_batches > 0:
            self.drop_batches -= 1
            self.dropped += 1
            return
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], copy=False)
        self.sent += 1

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            self.flush()

    async def _replayer(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            if self.replay:
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        await self._router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([identity, b"", self.topic, _END, b""])
