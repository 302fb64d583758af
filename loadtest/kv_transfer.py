"""The stand-in's KV-cache transfer between replicas, as vLLM 0.32's NixlConnector does it for disaggregated
prefill and decode.

The protocol is the request's ``kv_transfer_params``, as a proxy passes them:

- **Prefill side.** A request with ``{"do_remote_decode": true, ...}`` is served as usual (the proxy asks for
  ``max_tokens: 1``, not streamed). If it ends by reaching its length (not aborted, not stopped early), its
  KV blocks are kept for the decode side to read, and the answer carries
  ``{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[...]],
  "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
  "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"}``
  (``tests/fixtures/vllm-0.32/kv-transfer-prefill.json``). The blocks are freed
  when the decode side has read them, or when their lease ends: ``lease_s`` after the prefill (vLLM's
  ``kv_lease_duration``, 30 s), renewed to two thirds of it from each heartbeat the decode side sends while
  the request waits there to be scheduled (every sixth of the lease).
- **Decode side.** A request with those parameters reads the prompt's KV from the prefill replica instead of
  computing it: the prompt less what its own prefix cache already holds (whole blocks), counted as
  ``external_kv_transfer`` in ``vllm:prompt_tokens_by_source_total`` and in ``vllm:external_prefix_cache_*``
  (vLLM 0.32 counts no prompt token as computed there, and its answer's ``cached_tokens`` is 0). The read
  takes ``tokens x kv_bytes_per_token / bandwidth`` (plus a fixed latency), during which the request waits and
  the engine serves others. Parameters lacking a field vLLM needs are ignored with a warning (the prompt is
  computed here). A read that fails (the blocks expired, the prefill replica is gone) fails the request
  (``kv_load_failure_policy: fail``, vLLM's default: HTTP 500, or an error event in a stream) or, with
  ``recompute``, computes the prompt here.

vLLM reads the blocks over NIXL after a handshake on its side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST`` and
``_PORT``). The stand-in's side channel is its own HTTP port: ``POST /sim/kv_pull`` with the engine and request
ids answers the blocks' count and frees them. A router passes these fields through without reading them, so the
difference does not show to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any, Callable

from .h1client import H1Connection

log = logging.getLogger("loadtest.kv_transfer")

# What a decode side needs in kv_transfer_params to read from a prefill side (vLLM's NixlConnector scheduler)
REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
LEASE_S = 30.0  # kv_transfer_config's kv_lease_duration default
SWEEP_EVERY_S = 1.0  # expired leases are looked for at most this often (every kept request is scanned)
MAX_HELD = 100_000  # requests whose blocks wait to be read, at most (the oldest are freed first past it)


# what a side channel that cannot be reached (or answers garbage, or names a bad address) raises
_UNREACHABLE = (OSError, TimeoutError, ValueError, TypeError, asyncio.IncompleteReadError)


class TransferFailed(Exception):
    """The decode side could not read the prompt's KV from the prefill side."""


@dataclass
class Held:
    blocks: int
    tokens: int
    expires: float
    free: Callable[[], None]


@dataclass
class TransferCounters:
    sent_blocks: int = 0  # prefill side: blocks read by decode sides
    expired: int = 0  # prefill side: requests whose blocks nobody read in time
    received_tokens: int = 0  # decode side: prompt tokens read from prefill sides
    transfers: int = 0  # decode side: reads that succeeded
    heartbeats: int = 0  # decode side: lease renewals sent while a request waited
    failed: int = 0  # decode side: reads that failed
    ignored: int = 0  # decode side: parameters lacking a field (computed here instead)
    transfer_seconds: float = 0.0  # decode side: time spent reading, summed
    last_params: dict[str, Any] = field(default_factory=dict)  # the last kv_transfer_params received


class KvTransfer:
    """One replica's connector: the blocks it keeps for decode sides, and its reads from prefill sides."""

    def __init__(self, host: str, port: int, *, kv_bytes_per_token: int, bandwidth: float, latency_s: float = 0.0,
                 failure_policy: str = "fail", lease_s: float = LEASE_S, tp_size: int = 1,
                 time_scale: float = 1.0, read_timeout_s: float = 10.0) -> None:
        if failure_policy not in ("fail", "recompute"):
            raise ValueError(f"kv_load_failure_policy must be fail or recompute, not {failure_policy!r}")
        self.engine_id = str(uuid.uuid4())
        self.host, self.port = host, port
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self.failure_policy = failure_policy
        self.lease_s = lease_s
        self.tp_size = tp_size
        self.time_scale = time_scale
        self.read_timeout_s = read_timeout_s
        self.c = TransferCounters()
        self._held: dict[str, Held] = {}  # request id -> its kept blocks, oldest first
        self._swept = 0.0

    # -- prefill side ----------------------------------------------------------------------------

    def keep(self, request_id: str, blocks: int, tokens: int, free: Callable[[], None],
             cached: int = 0) -> dict[str, Any] | None:
        """Keep a finished prefill's ``blocks`` (holding ``tokens``, ``cached`` of them found in the prefix cache)
        for a decode side; ``free`` releases them. Returns the answer's kv_transfer_params, as vLLM 0.32 words them
        (None when there is nothing to read: no block)."""
        self.sweep()
        if blocks <= 0:
            free()
            return None
        while len(self._held) >= MAX_HELD:
            oldest = next(iter(self._held))
            self._release(oldest, expired=True)
        self._held[request_id] = Held(blocks, tokens, time.monotonic() + self.lease_s, free)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(1, blocks + 1))],  # block 0 is vLLM's null block
                "remote_engine_id": self.engine_id, "remote_request_id": request_id, "remote_host": self.host,
                "remote_port": self.port, "tp_size": self.tp_size, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": tokens, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": cached}

    def pull(self, engine_id: Any, request_id: Any) -> Held | None:
        """A decode side reads (and so frees) a kept prefill's blocks; None if they are not here (any more)."""
        self.sweep()
        if engine_id != self.engine_id or not isinstance(request_id, str):
            return None
        held = self._held.get(request_id)
        if held is None:
            return None
        self._release(request_id, expired=False)
        self.c.sent_blocks += held.blocks
        return held

    def renew(self, engine_id: Any, request_ids: Any) -> int:
        """A decode side's heartbeat: the leases of ``request_ids`` last two thirds of a lease from now, at
        least. Returns how many it renewed."""
        if engine_id != self.engine_id or not isinstance(request_ids, list):
            return 0
        until = time.monotonic() + self.lease_s * 2 / 3
        renewed = 0
        for rid in request_ids[:MAX_HELD]:
            held = self._held.get(rid) if isinstance(rid, str) else None
            if held is not None:
                held.expires = max(held.expires, until)
                renewed += 1
        return renewed

    def sweep(self) -> None:
        """Free the blocks nobody read while their lease lasted (renewals leave the leases out of order)."""
        now = time.monotonic()
        if now - self._swept < min(SWEEP_EVERY_S, self.lease_s / 4):
            return
        self._swept = now
        for rid in [rid for rid, held in self._held.items() if held.expires <= now]:
            self._release(rid, expired=True)

    def _release(self, request_id: str, expired: bool) -> None:
        held = self._held.pop(request_id)
        held.free()
        if expired:
            self.c.expired += 1

    @property
    def held(self) -> int:
        """Prefill side: requests whose blocks are kept for a decode side now."""
        return len(self._held)

    # -- decode side -----------------------------------------------------------------------------

    @staticmethod
    def wants_remote_decode(params: Any) -> bool:
        return isinstance(params, dict) and bool(params.get("do_remote_decode"))

    def usable(self, params: Any) -> bool:
        """Whether ``params`` ask this replica to read a prompt's KV from a prefill side (a warning and False
        when they ask but lack a field, as vLLM: the prompt is then computed here)."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return False
        self.c.last_params = {k: v for k, v in params.items() if k != "remote_block_ids"}
        if not params.get("remote_block_ids") or not all(k in params for k in REQUIRED):
            self.c.ignored += 1
            log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer",
                        json.dumps(params)[:500])
            return False
        return True

    @contextlib.asynccontextmanager
    async def waiting(self, params: dict[str, Any]) -> AsyncIterator[None]:
        """While a request that will read from a prefill side waits to be scheduled here: heartbeats to that
        side every sixth of a lease, so that its blocks outlast the wait."""
        task = asyncio.ensure_future(self._heartbeats(params))
        try:
            yield
        finally:
            task.cancel()

    async def _heartbeats(self, params: dict[str, Any]) -> None:
        body = json.dumps({"heartbeat": [params["remote_request_id"]],
                           "remote_engine_id": params["remote_engine_id"]}).encode()
        while True:
            await asyncio.sleep(self.lease_s / 6 * self.time_scale)
            try:
                await self._side_channel(params, body)
                self.c.heartbeats += 1
            except _UNREACHABLE:
                pass  # the read will tell

    async def _side_channel(self, params: dict[str, Any], body: bytes) -> int:
        """POST ``body`` to the side channel of the prefill side ``params`` name; its answer's status."""
        side: H1Connection | None = None
        try:
            side = H1Connection(str(params["remote_host"]), int(params["remote_port"]))
            async with asyncio.timeout(self.read_timeout_s):
                return (await side.post("/sim/kv_pull", body)).status
        finally:
            if side is not None:
                await side.close()

    async def read(self, params: dict[str, Any], tokens: int) -> None:
        """Read ``tokens`` of a prompt's KV from the prefill side ``params`` name, taking the link's time.
        Raises :class:`TransferFailed` when the blocks are not there or the side cannot be reached."""
        started = time.monotonic()
        body = json.dumps({"remote_engine_id": params["remote_engine_id"],
                           "remote_request_id": params["remote_request_id"]}).encode()
        try:
            status = await self._side_channel(params, body)
        except _UNREACHABLE as e:
            self.c.failed += 1
            raise TransferFailed(f"cannot reach the prefill side: {e}") from None
        if status != 200:
            self.c.failed += 1
            raise TransferFailed(f"the prefill side does not hold request {params['remote_request_id']!r}")
        seconds = self.latency_s + tokens * self.kv_bytes_per_token / self.bandwidth
        await asyncio.sleep(seconds * self.time_scale)
        self.c.transfers += 1
        self.c.received_tokens += tokens
        self.c.transfer_seconds += time.monotonic() - started

