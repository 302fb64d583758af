"""vLLM's KV-cache event messages, decoded.

A live message has three frames: the topic, an 8-byte big-endian batch sequence number, and a
msgpack payload. vLLM 0.32 encodes the payload as an array ``[ts, [event, ...], data_parallel_rank]``
whose events are maps with a ``"type"`` key; older releases encode each event as an array whose first
item is the type's name and the rest its fields in declaration order (trailing defaults left out).
Both are read, a batch as an array or a map, unknown fields ignored. Event types this router does
not use, and messages it cannot read, are counted and skipped: a decoder must never stop the
subscriber because vLLM added something.

Block hashes are kept as vLLM sends them (an int, or bytes); they only map a replica's blocks to the
router's own keys, which are computed from ``token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..block_events import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored, Event

__all__ = ["AllBlocksCleared", "Batch", "BlockHash", "BlockRemoved", "BlockStored", "DecodeStats", "Event",
           "decode_frames", "decode_payload", "encode_batch"]

# field order of the array encoding, after the type's name
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


@dataclass
class DecodeStats:
    """What the decoder skipped, by reason; ``unknown`` counts event types by name."""

    batches: int = 0
    events: int = 0
    bad_messages: int = 0
    bad_events: int = 0
    unknown: dict[str, int] = field(default_factory=dict)


class BadMessage(ValueError):
    pass


_decoder = msgspec.msgpack.Decoder()


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, (int, bytes)) for h in value):
        raise BadMessage("block_hashes must be a list of ints or bytes")
    return tuple(value)


def _event(raw: Any, stats: DecodeStats) -> Event | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _FIELDS.get(kind)
        fields = dict(zip(names, raw[1:])) if names is not None else {}
    else:
        raise BadMessage("an event is neither a map nor a tagged array")
    if kind == "BlockStored":
        tokens = fields.get("token_ids")
        size = fields.get("block_size")
        if not isinstance(tokens, (list, tuple)) or not isinstance(size, int) or size <= 0:
            raise BadMessage("BlockStored needs token_ids and a block_size")
        parent = fields.get("parent_block_hash")
        lora_id, medium, lora_name = fields.get("lora_id"), fields.get("medium"), fields.get("lora_name")
        extra = fields.get("extra_keys")
        return BlockStored(_hashes(fields.get("block_hashes")), parent if isinstance(parent, (int, bytes)) else None,
                           tuple(tokens), size, lora_id if isinstance(lora_id, int) else None,
                           medium if isinstance(medium, str) else None,
                           lora_name if isinstance(lora_name, str) else None,
                           tuple(extra) if isinstance(extra, (list, tuple)) else None)
    if kind == "BlockRemoved":
        medium = fields.get("medium")
        return BlockRemoved(_hashes(fields.get("block_hashes")), medium if isinstance(medium, str) else None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    name = kind if isinstance(kind, str) else "?"
    name = name[:64]  # a name is a counter key: bounded, and few distinct ones are kept
    if name in stats.unknown or len(stats.unknown) < 32:
        stats.unknown[name] = stats.unknown.get(name, 0) + 1
    return None


def decode_payload(seq: int, payload: bytes, stats: DecodeStats) -> Batch | None:
    """One batch, or None (counted in ``stats``) when the payload cannot be read."""
    try:
        raw = _decoder.decode(payload)
        if isinstance(raw, dict):
            ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
        elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
            ts, events = raw[0], raw[1]
            rank = raw[2] if len(raw) > 2 else None
        else:
            raise BadMessage("a batch is neither a map nor an array")
        if not isinstance(events, (list, tuple)) or not isinstance(ts, (int, float)):
            raise BadMessage("a batch needs ts and a list of events")
    except (msgspec.DecodeError, BadMessage, RecursionError):
        stats.bad_messages += 1
        return None
    out = []
    for e in events:
        try:
            event = _event(e, stats)
        except BadMessage:
            stats.bad_events += 1
            continue
        if event is not None:
            out.append(event)
    stats.batches += 1
    stats.events += len(out)
    return Batch(seq, float(ts), tuple(out), rank if isinstance(rank, int) else None)


def decode_frames(frames: list[bytes], stats: DecodeStats) -> Batch | None:
    """A live message ``[topic, seq, payload]`` (or a replay reply ``[b"", (topic,) seq, payload]``).

    The end of a replay (sequence number -1, empty payload) comes back as a batch with ``seq`` -1 and
    no events; what cannot be read is counted in ``stats`` and comes back as None.
    """
    if frames and frames[0] == b"" and len(frames) in (3, 4):
        frames = frames[1:]  # a replay reply: the DEALER's empty delimiter first
    if len(frames) == 2:  # a replay reply without the topic (before vLLM 0.26)
        seq_frame, payload = frames
    elif len(frames) == 3:
        _, seq_frame, payload = frames
    else:
        stats.bad_messages += 1
        return None
    if len(seq_frame) != 8:
        stats.bad_messages += 1
        return None
    seq = int.from_bytes(seq_frame, "big", signed=True)
    if seq < 0 and not payload:
        return Batch(seq, 0.0, ())  # the end of a replay
    return decode_payload(seq, payload, stats)


def encode_batch(batch: Batch, tagged_arrays: bool = False) -> bytes:
    """The payload vLLM would send for ``batch``: maps with ``type`` (0.32), or tagged arrays (older)."""
    events = []
    for e in batch.events:
        kind = type(e).__name__
        names = _FIELDS[kind]
        values = [list(v) if isinstance(v, tuple) else v for v in (getattr(e, n) for n in names)]
        if tagged_arrays:
            while values and values[-1] is None:  # trailing defaults left out
                values.pop()
            events.append([kind, *values])
        else:
            events.append({"type": kind, **dict(zip(names, values))})
    return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])
