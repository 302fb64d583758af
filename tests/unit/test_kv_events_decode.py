"""Decoding vLLM's KV-cache event messages: the real capture, both encodings, and what must never crash."""

import base64
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.kv_events.decode import (AllBlocksCleared, Batch, BlockRemoved, BlockStored, DecodeStats,
                                     decode_frames, decode_payload, encode_batch)
from support.paths import FIXTURES

CAPTURE = json.loads((FIXTURES / "vllm-0.32" / "kv-events.json").read_text())


def frames(message):
    return [message["topic"].encode(), message["seq"].to_bytes(8, "big"), base64.b64decode(message["payload_b64"])]


def test_every_captured_message_decodes():
    stats = DecodeStats()
    batches = [decode_frames(frames(m), stats) for m in CAPTURE]
    assert [b.seq for b in batches] == [m["seq"] for m in CAPTURE]
    for b in batches:
        (event,) = b.events
        assert isinstance(event, BlockStored) and event.block_size == 128 and event.medium == "GPU"
        assert len(event.block_hashes) == 6 and len(event.token_ids) == 6 * 128
        assert b.data_parallel_rank == 0 and b.ts > 1.7e9
    assert (stats.batches, stats.events, stats.bad_messages, stats.bad_events, stats.unknown) == (2, 2, 0, 0, {})


hashes = st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(min_size=1, max_size=32)), max_size=8)
events = st.one_of(
    st.builds(lambda h, p, n, size, lora, medium, name: BlockStored(
        tuple(h), p, tuple(range(n * size)), size, lora, medium, name),
        hashes, st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.integers(0, 4), st.sampled_from([16, 32, 128]),
        st.one_of(st.none(), st.integers(0, 100)), st.sampled_from([None, "GPU", "CPU"]),
        st.one_of(st.none(), st.text(max_size=8))),
    st.builds(lambda h, medium: BlockRemoved(tuple(h), medium), hashes, st.sampled_from([None, "GPU", "CPU"])),
    st.just(AllBlocksCleared()))


@settings(max_examples=200, deadline=None)
@given(st.lists(events, max_size=6), st.integers(0, 2**40), st.one_of(st.none(), st.integers(0, 7)),
       st.booleans())
def test_batches_round_trip_through_both_encodings(evs, seq, rank, tagged):
    batch = Batch(seq, 1795945979.5, tuple(evs), rank)
    stats = DecodeStats()
    assert decode_payload(seq, encode_batch(batch, tagged_arrays=tagged), stats) == batch
    assert stats.bad_events == stats.bad_messages == 0


def test_a_map_shaped_batch_and_unknown_fields_are_read():
    payload = msgspec.msgpack.encode({"ts": 1.5, "data_parallel_rank": 1, "future": True, "events": [
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0, "new_field": [1, 2]},
        ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU", None, [None, None], 0, "full_attention"]]})
    batch = decode_payload(5, payload, DecodeStats())
    assert batch == Batch(5, 1.5, (BlockRemoved((7,), "GPU"), BlockStored((1, 2), None, tuple(range(32)), 16, None,
                                                                             "GPU", None, (None, None))), 1)


def test_blocks_whose_hash_covers_a_salt_are_marked_but_a_lora_name_alone_is_not():
    plain = BlockStored((1,), None, tuple(range(16)), 16, extra_keys=(None,))
    lora = BlockStored((1,), None, tuple(range(16)), 16, lora_name="ad", extra_keys=(("ad",),))
    salted = BlockStored((1,), None, tuple(range(16)), 16, extra_keys=(("salt-1",),))
    assert (plain.salted, lora.salted, salted.salted) == (False, False, True)


def test_unknown_event_types_are_counted_by_a_bounded_set_of_names():
    stats = DecodeStats()
    payload = msgspec.msgpack.encode([1.0, [{"type": f"NewKind{i}"} for i in range(100)] + [{"type": "AllBlocksCleared"}]])
    batch = decode_payload(0, payload, stats)
    assert batch.events == (AllBlocksCleared(),)
    assert len(stats.unknown) == 32 and sum(stats.unknown.values()) == 32


@pytest.mark.parametrize("bad", [
    [b"kv", b"\x00" * 7, b"\x90"],  # a 7-byte sequence number
    [b"kv"],  # too few frames
    [b"kv", b"\x00" * 8, b"\xc1"],  # never-used msgpack byte
    [b"kv", b"\x00" * 8, msgspec.msgpack.encode("a string")],
    [b"kv", b"\x00" * 8, msgspec.msgpack.encode([1.0, "not a list"])],
    [b"kv", b"\x00" * 8, b"\x91" * 100000],  # nested past any sane depth
])
def test_garbage_is_counted_and_skipped(bad):
    stats = DecodeStats()
    assert decode_frames(bad, stats) is None and stats.bad_messages == 1


def test_every_truncation_of_a_real_message_is_survived():
    stats = DecodeStats()
    topic, seq, payload = frames(CAPTURE[0])
    for cut in range(len(payload)):
        assert decode_frames([topic, seq, payload[:cut]], stats) is None
    assert stats.bad_messages == len(payload)


def test_malformed_events_are_skipped_and_the_rest_of_the_batch_kept():
    stats = DecodeStats()
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}, 42,
                                            {"type": "BlockRemoved", "block_hashes": [3]}]])
    assert decode_payload(0, payload, stats).events == (BlockRemoved((3,)),)
    assert stats.bad_events == 2


def test_replay_replies_with_and_without_the_topic_and_the_end_marker():
    stats = DecodeStats()
    topic, seq, payload = frames(CAPTURE[1])
    with_topic = decode_frames([b"", topic, seq, payload], stats)
    without = decode_frames([b"", seq, payload], stats)
    end = decode_frames([b"", (-1).to_bytes(8, "big", signed=True), b""], stats)
    assert with_topic == without and with_topic.seq == 1 and (end.seq, end.events) == (-1, ())
