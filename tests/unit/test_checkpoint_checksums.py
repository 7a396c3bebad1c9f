"""Checksummed checkpoint segments: a corrupt one is refused and counted, held KV is checked again before a restore."""

from __future__ import annotations

import zlib

import pytest
import torch
from test_checkpoint_store import LAYOUT, W1, kv_of, segment

from phalanx._proto import checkpoint_pb2
from phalanx.checkpoint_store.store import CheckpointStore, CorruptCheckpointError, SegmentResult

pytestmark = pytest.mark.unit


def checked(message: checkpoint_pb2.Segment) -> checkpoint_pb2.Segment:
    message.kv_crc32 = zlib.crc32(message.kv)
    return message


def flipped(data: bytes, bit: int) -> bytes:
    corrupt = bytearray(data)
    corrupt[bit // 8] ^= 1 << (bit % 8)
    return bytes(corrupt)


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "spill")
    yield store
    store.close()


@pytest.mark.parametrize("bit", [0, 7, 1000, 4 * LAYOUT.token_bytes * 8 - 1])
def test_a_segment_with_a_flipped_bit_is_refused_with_a_resync_and_counted(store, bit):
    store.apply(W1, checked(segment("r1", 1, 0, 4, outputs=[21])))
    bad = checked(segment("r1", 2, 4, 8, outputs=[22]))
    bad.kv = flipped(bad.kv, bit)
    ack = store.apply(W1, bad)
    assert (ack.result, ack.resync, ack.kv_tokens) == (SegmentResult.CORRUPT, True, 4)
    record = store.get("r1")
    assert record.kv_tokens == 4 and list(record.state.output_token_ids) == [21] and record.seq == 1  # nothing of it applied
    assert store.stats().segments_total[SegmentResult.CORRUPT] == 1
    assert torch.equal(store.read_kv("r1", 4), kv_of(0, 4))


def test_a_corrupt_first_segment_starts_no_commit(store):
    bad = checked(segment("r1", 1, 0, 4, outputs=[21]))
    bad.kv = flipped(bad.kv, 3)
    assert store.apply(W1, bad).result is SegmentResult.CORRUPT
    assert "r1" not in store


def test_held_kv_corrupted_since_it_was_written_fails_the_restore_and_is_dropped(tmp_path):
    store = CheckpointStore(tmp_path / "spill", memory_limit_bytes=LAYOUT.token_bytes * 64)
    try:
        store.apply(W1, checked(segment("r1", 1, 0, 4, outputs=[21])))
        store.apply(W1, checked(segment("r1", 2, 4, 100, outputs=[22])))  # beyond the limit: spilled to a file
        assert store.get("r1").spilled
        spill = next((tmp_path / "spill").iterdir())
        data = bytearray(spill.read_bytes())
        data[LAYOUT.token_bytes * 2 + 5] ^= 0x10  # a bit flips on disk
        spill.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError) as raised:
            store.read_kv("r1", 100)
        assert raised.value.request_id == "r1" and "re-prefill" in str(raised.value)
        record = store.get("r1")
        assert record.kv_tokens == 0 and list(record.state.output_token_ids) == [21, 22]  # the state stays for a re-prefill
        assert store.stats().corrupt_restores_total == 1
    finally:
        store.close()


def test_a_segment_without_a_checksum_is_applied_and_counted_unchecked(store):
    ack = store.apply(W1, segment("r1", 1, 0, 4, outputs=[21]))  # kv_crc32 unset: a writer from before checksums
    assert ack.result is SegmentResult.APPLIED
    assert store.stats().unchecked_segments_total == 1
    assert torch.equal(store.read_kv("r1", 4), kv_of(0, 4))


def test_a_range_cut_by_a_later_segment_is_verified_no_more_and_the_rest_still_is(store):
    store.apply(W1, checked(segment("r1", 1, 0, 8)))
    store.apply(W1, checked(segment("r1", 2, 6, 9, salt=0.5)))  # rewrites from 6: [0, 8)'s checksum no longer holds
    assert torch.equal(store.read_kv("r1", 9)[:, :, :6], kv_of(0, 6))

