"""The checkpoint store's apply rules, spilling and retention, on the pure logic (no gRPC)."""

from __future__ import annotations

import pytest
import torch

from phalanx._proto import checkpoint_pb2, common_pb2
from phalanx.checkpoint_store.store import (
    CheckpointStore,
    InvalidCheckpointError,
    KvLayout,
    NotCommittedError,
    SegmentResult,
    UnknownRequestError,
    Writer,
)

pytestmark = pytest.mark.unit

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)  # 128 bytes per token
W1 = Writer("w1", LAYOUT, "m@1")
W2 = Writer("w2", LAYOUT, "m@1")
PROMPT = [11, 12, 13, 14]


def kv_of(start: int, end: int, *, salt: float = 0.0, layout: KvLayout = LAYOUT) -> torch.Tensor:
    """Distinct values per (layer, k/v, position, head, dim), so any misplaced byte shows."""
    base = torch.arange(layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim, dtype=torch.float64)
    base = base.view(layout.num_layers, 2, 1, layout.num_kv_heads, layout.head_dim)
    positions = torch.arange(start, end, dtype=torch.float64).view(1, 1, -1, 1, 1)
    return (positions * 1000 + base + salt).to(layout.dtype).contiguous()


def segment(request_id: str, seq: int, start: int, end: int, *, outputs=(), salt: float = 0.0, **fields) -> checkpoint_pb2.Segment:
    message = checkpoint_pb2.Segment(
        request_id=request_id, seq=seq, kv_start=start, kv_end=end, kv=kv_of(start, end, salt=salt).numpy().tobytes(), **fields
    )
    if start == 0:
        message.state.CopyFrom(common_pb2.RequestState(request_id=request_id, prompt_token_ids=PROMPT, output_token_ids=list(outputs)))
        message.seed = 7
    else:
        message.appended_output_ids.extend(outputs)
    return message


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "spill")
    yield store
    store.close()


def test_first_segment_starts_a_commit_with_the_full_state(store):
    ack = store.apply(W1, segment("r1", 1, 0, 4, outputs=[21], generator_state=b"gen"))
    assert (ack.result, ack.seq, ack.kv_tokens, ack.resync) == (SegmentResult.APPLIED, 1, 4, False)
    record = store.get("r1")
    assert record.worker_id == "w1" and record.seq == 1 and record.kv_tokens == 4 and record.seed == 7
    assert list(record.state.prompt_token_ids) == PROMPT and list(record.state.output_token_ids) == [21]
    assert record.last_index == 0 and record.state.generator_state == b"gen" and record.model_version == "m@1"
    assert record.layout.dtype == "float32" and record.layout.num_layers == 2 and record.updated_at > 0
    assert torch.equal(store.read_kv("r1", 4), kv_of(0, 4))
    assert store.committed_tokens == 4 and len(store) == 1


def test_appended_segments_extend_kv_and_outputs(store):
    store.apply(W1, segment("r1", 1, 0, 4, outputs=[21]))
    store.apply(W1, segment("r1", 2, 4, 5, outputs=[22], generator_state=b"g2"))
    ack = store.apply(W1, segment("r1", 3, 5, 7, outputs=[23, 24]))
    assert ack.kv_tokens == 7 and ack.result is SegmentResult.APPLIED
    record = store.get("r1")
    assert list(record.state.output_token_ids) == [21, 22, 23, 24] and record.last_index == 3 and record.seq == 3
    assert record.state.generator_state == b"g2"  # an empty generator_state keeps the last one
    assert torch.equal(store.read_kv("r1", 7), kv_of(0, 7))
    assert torch.equal(store.read_kv("r1", 5), kv_of(0, 5))
    assert store.read_kv("r1", 5).is_contiguous()


def test_token_only_segments_move_outputs_ahead_of_the_kv(store):
    store.apply(W1, segment("r1", 1, 0, 4, outputs=[21]))
    store.apply(W1, segment("r1", 2, 4, 4, outputs=[22], generator_state=b"g2"))
    ack = store.apply(W1, segment("r1", 3, 4, 4, outputs=[23]))
    assert (ack.result, ack.kv_tokens) == (SegmentResult.APPLIED, 4)
    record = store.get("r1")
    assert list(record.state.output_token_ids) == [21, 22, 23] and record.kv_tokens == 4 and record.state.generator_state == b"g2"
    # The KV that was held back follows in one segment from where the KV ends.
    store.apply(W1, segment("r1", 4, 4, 6, outputs=[24]))
    record = store.get("r1")
    assert list(record.state.output_token_ids) == [21, 22, 23, 24] and record.kv_tokens == 6
    assert torch.equal(store.read_kv("r1", 6), kv_of(0, 6))


def test_duplicate_segment_changes_nothing_and_acks_the_current_commit(store):
    store.apply(W1, segment("r1", 1, 0, 4, outputs=[21]))
    store.apply(W1, segment("r1", 2, 4, 6, outputs=[22]))
    ack = store.apply(W1, segment("r1", 2, 4, 6, outputs=[22], salt=0.5))
    assert (ack.result, ack.seq, ack.kv_tokens, ack.resync) == (SegmentResult.DUPLICATE, 2, 6, False)
    ack = store.apply(W1, segment("r1", 1, 0, 4, outputs=[21], salt=0.5))  # even an old restart
    assert ack.result is SegmentResult.DUPLICATE
    assert list(store.get("r1").state.output_token_ids) == [21, 22]
    assert torch.equal(store.read_kv("r1", 6), kv_of(0, 6))
    assert store.stats().segments_total == {
        SegmentResult.APPLIED: 2, SegmentResult.DUPLICATE: 2, SegmentResult.GAP: 0, SegmentResult.CORRUPT: 0, SegmentResult.SUPERSEDED: 0
    }


def test_gap_is_not_applied_and_asks_for_a_resync(store):
    ack = store.apply(W1, segment("unknown", 5, 8, 9, outputs=[30]))
    assert ack.resync and ack.result is SegmentResult.GAP and ack.kv_tokens == 0 and "unknown" not in store
    store.apply(W1, segment("r1", 1, 0, 4))
    ack = store.apply(W1, segment("r1", 3, 6, 8, outputs=[22]))  # positions 4..5 never arrived
    assert ack.resync and ack.kv_tokens == 4 and ack.seq == 3
    record = store.get("r1")
    assert record.kv_tokens == 4 and record.seq == 1 and list(record.state.output_token_ids) == []
    ack = store.apply(W1, segment("r1", 4, 0, 8, outputs=[21, 22]))  # the resync: from 0 again
    assert ack.result is SegmentResult.APPLIED and store.get("r1").kv_tokens == 8
    assert torch.equal(store.read_kv("r1", 8), kv_of(0, 8))


def test_new_owner_continues_with_its_own_seq_numbering(store):
    store.apply(W1, segment("r1", 40, 0, 4, outputs=[21]))
    store.apply(W1, segment("r1", 41, 4, 6, outputs=[22]))
    ack = store.apply(W2, segment("r1", 1, 6, 7, outputs=[23], salt=0.25))  # restored on w2, seq starts over
    assert ack.result is SegmentResult.APPLIED and ack.kv_tokens == 7
    record = store.get("r1")
    assert record.worker_id == "w2" and record.seq == 1 and list(record.state.output_token_ids) == [21, 22, 23]
    assert store.apply(W2, segment("r1", 1, 6, 7)).result is SegmentResult.DUPLICATE
    assert [r.request_id for r in store.records("w2")] == ["r1"] and store.records("w1") == []
    kv = store.read_kv("r1", 7)
    assert torch.equal(kv[:, :, :6], kv_of(0, 6)) and torch.equal(kv[:, :, 6:], kv_of(6, 7, salt=0.25))


def test_overlapping_segment_truncates_then_appends(store):
    store.apply(W1, segment("r1", 1, 0, 6))
    store.apply(W2, segment("r1", 1, 3, 5, outputs=[9], salt=0.5))
    assert store.get("r1").kv_tokens == 5
    kv = store.read_kv("r1", 5)
    assert torch.equal(kv[:, :, :3], kv_of(0, 3)) and torch.equal(kv[:, :, 3:], kv_of(3, 5, salt=0.5))
    with pytest.raises(NotCommittedError) as caught:
        store.read_kv("r1", 6)
    assert caught.value.committed == 5 and "only 5 are committed" in str(caught.value)


def test_restart_from_zero_by_another_worker_replaces_the_request(store):
    store.apply(W1, segment("r1", 3, 0, 6, outputs=[21, 22]))
    store.apply(W2, segment("r1", 1, 0, 2, outputs=[], salt=0.5))
    record = store.get("r1")
    assert record.worker_id == "w2" and record.kv_tokens == 2 and list(record.state.output_token_ids) == [] and record.last_index == -1
    assert torch.equal(store.read_kv("r1", 2), kv_of(0, 2, salt=0.5))
    assert store.committed_tokens == 2


def _with_media(message: checkpoint_pb2.Segment, *items: common_pb2.MediaEmbedding, spans=None) -> checkpoint_pb2.Segment:
    """``message`` whose state places ``spans`` (default: the items' own) and which brings ``items``' embeddings."""
    for item in items if spans is None else spans:
        message.state.media.add(start=item.start, rows=item.rows, media_hash=item.media_hash)
    message.media.extend(items)
    return message


def _embedding(start: int, rows: int, media_hash: int, *, hidden: int = 4, dtype: str = "float32") -> common_pb2.MediaEmbedding:
    values = torch.arange(rows * hidden, dtype=getattr(torch, dtype)) + media_hash
    return common_pb2.MediaEmbedding(
        start=start, rows=rows, hidden=hidden, dtype=dtype, data=values.view(torch.uint8).numpy().tobytes(), media_hash=media_hash
    )


def test_a_whole_state_keeps_its_media_embeddings_for_restores_and_counts_their_memory(store):
    image, audio = _embedding(1, 2, 77), _embedding(3, 1, 78, dtype="bfloat16")
    store.apply(W1, segment("r0", 1, 0, 4))
    kv_memory = store.memory_bytes  # what the same KV without media takes (whole blocks)
    store.apply(W1, _with_media(segment("r1", 1, 0, 4), image, audio))
    assert store.get("r1").media_held == 2 and store.media("r1") == [image, audio]
    assert store.memory_bytes == 2 * kv_memory + len(image.data) + len(audio.data)
    # Later segments carry no media: the embeddings stay. A new owner restoring from the commit takes over with a whole
    # state and no media (it has them): they stay too.
    store.apply(W1, segment("r1", 2, 4, 6, outputs=[21]))
    takeover = segment("r1", 1, 6, 6, outputs=[22])
    takeover.state.CopyFrom(store.get("r1").state)
    store.apply(W2, takeover)
    assert store.get("r1").worker_id == "w2" and store.media("r1") == [image, audio]
    # Restarted from position 0 (a resync) without them: kept, as the state names the same media.
    store.apply(W2, _with_media(segment("r1", 2, 0, 2), spans=[image, audio]))
    assert store.get("r1").media_held == 2
    assert store.release("r1") and store.release("r0")
    assert store.memory_bytes == 0


def test_media_embeddings_that_do_not_fit_the_state_are_not_kept(store):
    good = _embedding(1, 2, 77)
    short = _embedding(3, 2, 78)
    short.data = short.data[:-4]
    stranger = _embedding(5, 1, 79)  # no span of the state's
    odd = _embedding(6, 1, 80, dtype="int8")
    message = _with_media(segment("r1", 1, 0, 4), good, short, stranger, odd, spans=[good, short, odd])
    assert store.apply(W1, message).result is SegmentResult.APPLIED  # the commit stands, for a caller that brings them
    assert store.media("r1") == [good] and store.get("r1").media_held == 1 and len(store.get("r1").state.media) == 3


def test_media_embeddings_spill_with_the_kv_read_back_byte_exact_and_go_with_the_commit(tmp_path):
    now = [1000.0]
    spill = tmp_path / "spill"
    store = CheckpointStore(spill, memory_limit_bytes=16 * LAYOUT.token_bytes, clock=lambda: now[0])  # 2 KiB
    image, audio = _embedding(1, 48, 77), _embedding(3, 16, 78, dtype="bfloat16")  # 768 + 128 bytes
    store.apply(W1, _with_media(segment("r1", 1, 0, 4), image, audio))
    assert store.memory_bytes == 4 * LAYOUT.token_bytes + 896 and store.spilled_bytes == 0
    now[0] += 1
    store.apply(W1, _with_media(segment("r2", 1, 0, 4), _embedding(1, 48, 79)))  # past the limit: r1, the oldest, spills
    assert store.memory_bytes <= store.memory_limit_bytes
    record = store.get("r1")
    assert record.spilled and record.media_held == 2
    assert store.spilled_bytes == 4 * LAYOUT.token_bytes + 896 and store.memory_bytes == 4 * LAYOUT.token_bytes + 768
    assert sorted(p.suffix for p in spill.iterdir()) == [".kv", ".media"]
    assert store.media("r1") == [image, audio]  # read back from the file
    assert torch.equal(store.read_kv("r1", 4), kv_of(0, 4))
    # A resync without them keeps the spilled ones; a state with other media drops them and their file.
    now[0] += 1
    store.apply(W1, _with_media(segment("r1", 2, 0, 2), spans=[image, audio]))
    assert store.get("r1").media_held == 2 and store.media("r1") == [image, audio]
    other = _embedding(1, 2, 80)
    store.apply(W1, _with_media(segment("r1", 3, 0, 2), other))
    assert store.media("r1") == [other] and store.spilled_bytes == 0 and not any(spill.glob("*.media"))
    # Media alone past the limit (a whole state with no KV yet) spill too.
    now[0] += 1
    store.apply(W1, _with_media(segment("r3", 1, 0, 0), _embedding(1, 128, 81)))  # 2 KiB
    assert store.memory_bytes <= store.memory_limit_bytes and store.get("r3").media_held == 1
    assert store.media("r3") == [_embedding(1, 128, 81)]
    for request_id in ("r1", "r2", "r3"):
        assert store.release(request_id)
    assert store.memory_bytes == 0 and store.spilled_bytes == 0 and list(spill.iterdir()) == []


def test_media_embeddings_that_cannot_spill_are_dropped_with_the_kv_and_come_back_with_the_resync(tmp_path):
    now = [1000.0]
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    store = CheckpointStore(blocker / "spill", memory_limit_bytes=LAYOUT.token_bytes * 8, spill_retry_s=5.0, clock=lambda: now[0])
    image = _embedding(1, 16, 77)  # 256 bytes
    store.apply(W1, _with_media(segment("r1", 1, 0, 20, outputs=[5]), image))
    stats = store.stats()
    assert stats.spill_failures_total == 1 and stats.kv_dropped_total == 1 and stats.spill_failing
    assert store.memory_bytes == 0 and store.spilled_bytes == 0
    record = store.get("r1")
    assert record.kv_tokens == 0 and record.media_held == 0 and store.media("r1") == [] and len(record.state.media) == 1
    now[0] += 6  # the disk is tried again: the request resyncs, its media with it (they fit in memory now)
    assert store.apply(W1, segment("r1", 2, 20, 21, outputs=[6])).resync
    store.apply(W1, _with_media(segment("r1", 3, 0, 2, outputs=[5, 6]), image))
    assert store.get("r1").media_held == 1 and store.media("r1") == [image]
    assert store.memory_bytes == 2 * LAYOUT.token_bytes + 256


def test_spilled_media_embeddings_that_fail_their_checksum_are_dropped_not_answered(tmp_path):
    store = CheckpointStore(tmp_path, memory_limit_bytes=LAYOUT.token_bytes * 8)
    image = _embedding(1, 32, 77)  # 512 bytes
    store.apply(W1, _with_media(segment("r1", 1, 0, 10), image))
    assert store.get("r1").spilled and store.get("r1").media_held == 1
    (path,) = tmp_path.glob("*.media")
    data = bytearray(path.read_bytes())
    data[100] ^= 0x10
    path.write_bytes(bytes(data))
    assert store.media("r1") == []
    assert store.get("r1").media_held == 0 and not any(tmp_path.glob("*.media"))
    assert store.spilled_bytes == 10 * LAYOUT.token_bytes
    assert torch.equal(store.read_kv("r1", 10), kv_of(0, 10))  # the KV is not affected


def test_release_drops_the_request_only_for_its_owner(store):
    store.apply(W1, segment("r1", 1, 0, 4))
    assert not store.release("r1", worker_id="w2")  # a former owner's release must not drop the new owner's commit
    assert store.release("r1", worker_id="w1")
    assert "r1" not in store and store.memory_bytes == 0 and store.committed_tokens == 0
    with pytest.raises(UnknownRequestError):
        store.get("r1")
    with pytest.raises(UnknownRequestError):
        store.read_kv("r1", 1)
    assert not store.release("r1")


def test_a_cut_off_former_owner_cannot_take_the_commit_back(store):
    """A partitioned worker's copy runs on while its request moved: once it reaches the store again, its segments (an
    append, a resync from position 0) must not make it the owner again, nor change the new owner's commit."""
    store.apply(W1, segment("r1", 1, 0, 4, outputs=[21], copy_id=100))
    store.apply(W2, segment("r1", 1, 4, 6, outputs=[22], copy_id=200, salt=0.25))  # restored on w2: it takes the commit over
    for stale in (segment("r1", 2, 4, 8, outputs=[22, 23], copy_id=100, salt=0.5), segment("r1", 9, 0, 8, outputs=[21, 22, 23], copy_id=100)):
        ack = store.apply(W1, stale)
        assert (ack.result, ack.resync, ack.kv_tokens, ack.copy_id) == (SegmentResult.SUPERSEDED, False, 6, 100)
        assert ack.to_proto().superseded and not ack.to_proto().resync
    record = store.get("r1")
    assert record.worker_id == "w2" and record.kv_tokens == 6 and list(record.state.output_token_ids) == [21, 22]
    assert store.records("w1") == [] and [r.request_id for r in store.records("w2")] == ["r1"]
    kv = store.read_kv("r1", 6)
    assert torch.equal(kv[:, :, :4], kv_of(0, 4)) and torch.equal(kv[:, :, 4:], kv_of(4, 6, salt=0.25))
    assert store.stats().segments_total[SegmentResult.SUPERSEDED] == 2
    assert store.apply(W2, segment("r1", 2, 6, 7, outputs=[23], copy_id=200)).result is SegmentResult.APPLIED  # the owner goes on


def test_a_newer_copy_of_a_former_owner_takes_the_commit_over_and_supersedes_the_rest(store):
    store.apply(W1, segment("r1", 1, 0, 4, copy_id=100))
    store.apply(W2, segment("r1", 1, 0, 4, copy_id=200))
    ack = store.apply(W1, segment("r1", 1, 0, 5, outputs=[21], copy_id=300))  # migrated back to w1: a new copy there
    assert ack.result is SegmentResult.APPLIED and store.get("r1").worker_id == "w1"
    assert store.apply(W2, segment("r1", 2, 4, 6, copy_id=200)).result is SegmentResult.SUPERSEDED
    assert store.apply(W1, segment("r1", 5, 5, 6, copy_id=100)).result is SegmentResult.SUPERSEDED  # w1's first copy, still running
    assert store.get("r1").kv_tokens == 5


def test_an_older_copy_of_the_owner_is_superseded_by_its_newer_one(store):
    store.apply(W1, segment("r1", 1, 0, 4, copy_id=100))
    assert store.apply(W1, segment("r1", 1, 0, 4, copy_id=200)).result is SegmentResult.APPLIED
    assert store.apply(W1, segment("r1", 2, 4, 6, copy_id=100)).result is SegmentResult.SUPERSEDED
    assert store.get("r1").kv_tokens == 4


def test_an_old_copy_cannot_start_a_released_request_again(store):
    store.apply(W1, segment("r1", 1, 0, 4, copy_id=100))
    store.apply(W2, segment("r1", 1, 4, 5, copy_id=200))
    assert store.release("r1", worker_id="w2")  # finished on w2
    ack = store.apply(W1, segment("r1", 9, 0, 8, copy_id=100))  # w1 back from its partition, re-sending everything
    assert ack.result is SegmentResult.SUPERSEDED and "r1" not in store
    assert store.apply(W2, segment("r1", 3, 0, 8, copy_id=200)).result is SegmentResult.SUPERSEDED  # nor the finished copy
    assert store.apply(W1, segment("r1", 1, 0, 4, copy_id=300)).result is SegmentResult.APPLIED  # a new copy may


def test_writers_without_copy_ids_keep_the_old_rules(store):
    store.apply(W1, segment("r1", 1, 0, 4))
    store.apply(W2, segment("r1", 1, 4, 6))
    assert store.apply(W1, segment("r1", 2, 6, 7)).result is SegmentResult.APPLIED and store.get("r1").worker_id == "w1"


def test_invalid_segments_are_refused(store):
    bad = segment("r1", 1, 0, 4)
    bad.kv = bad.kv[:-1]
    with pytest.raises(InvalidCheckpointError):
        store.apply(W1, bad)
    with pytest.raises(InvalidCheckpointError):
        store.apply(W1, checkpoint_pb2.Segment(request_id="r/1", seq=1, kv_start=0, kv_end=0))
    with pytest.raises(InvalidCheckpointError):
        store.apply(W1, checkpoint_pb2.Segment(request_id="r1", seq=1, kv_start=3, kv_end=2))
    with pytest.raises(InvalidCheckpointError):
        Writer.from_hello(checkpoint_pb2.Hello(worker_id="w", layout=checkpoint_pb2.KvLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="nope")))


def test_bfloat16_layout_round_trips_bytes(tmp_path):
    layout = KvLayout.from_proto(checkpoint_pb2.KvLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16"))
    assert layout.dtype is torch.bfloat16 and layout.token_bytes == 3 * 2 * 8 * 2
    store = CheckpointStore(tmp_path, memory_limit_bytes=layout.token_bytes * 20)
    writer = Writer("w1", layout)
    expected = torch.randn(layout.shape(50)).to(torch.bfloat16)
    message = checkpoint_pb2.Segment(request_id="r", seq=1, kv_start=0, kv_end=10)
    message.kv = expected[:, :, :10].contiguous().view(torch.uint8).numpy().tobytes()
    store.apply(writer, message)
    for seq, start in enumerate(range(10, 50, 5), start=2):  # spills along the way
        chunk = expected[:, :, start : start + 5].contiguous()
        store.apply(writer, checkpoint_pb2.Segment(request_id="r", seq=seq, kv_start=start, kv_end=start + 5,
                                                   kv=chunk.view(torch.uint8).numpy().tobytes()))
    assert store.get("r").spilled
    assert torch.equal(store.read_kv("r", 50).view(torch.int16), expected.view(torch.int16))
    store.close()


def test_spilling_keeps_memory_bounded_and_reads_back_byte_exact(tmp_path):
    token_bytes = LAYOUT.token_bytes
    now = [1000.0]
    store = CheckpointStore(tmp_path / "spill", memory_limit_bytes=64 * token_bytes, clock=lambda: now[0])
    expected: dict[str, torch.Tensor] = {}
    seqs = dict.fromkeys((f"r{i}" for i in range(6)), 0)
    for step in range(12):  # six requests of up to 80 tokens: 480 tokens against a 64-token budget
        for i, request_id in enumerate(seqs):
            now[0] += 1
            start = 0 if step == 0 else step * 6 + 2
            end = (step + 1) * 6 + 2 if i != 5 or step < 6 else start  # r5 stops growing halfway
            seqs[request_id] += 1
            store.apply(W1, segment(request_id, seqs[request_id], start, end, salt=i / 8))
            assert store.memory_bytes <= store.memory_limit_bytes
    assert store.spilled_bytes > 0 and store.stats().spilled_bytes == store.spilled_bytes
    for i, request_id in enumerate(seqs):
        record = store.get(request_id)
        expected[request_id] = kv_of(0, record.kv_tokens, salt=i / 8)
        assert torch.equal(store.read_kv(request_id, record.kv_tokens), expected[request_id]), request_id
        assert torch.equal(store.read_kv(request_id, 5), expected[request_id][:, :, :5])
    assert any(store.get(r).spilled for r in seqs)
    assert store.committed_tokens == sum(store.get(r).kv_tokens for r in seqs)

    # Truncate into the spilled part, then keep appending: file part + memory tail still line up.
    spilled = next(r for r in seqs if store.get(r).spilled)
    i = list(seqs).index(spilled)
    store.apply(W2, segment(spilled, 1, 3, 9, salt=0.75))
    kv = store.read_kv(spilled, 9)
    assert torch.equal(kv[:, :, :3], kv_of(0, 3, salt=i / 8)) and torch.equal(kv[:, :, 3:], kv_of(3, 9, salt=0.75))

    files = set((tmp_path / "spill").iterdir())
    assert files
    for request_id in seqs:
        store.release(request_id)
    assert store.memory_bytes == 0 and store.spilled_bytes == 0 and store.committed_tokens == 0
    assert list((tmp_path / "spill").iterdir()) == []


def test_restart_from_zero_deletes_the_spill_file(tmp_path):
    store = CheckpointStore(tmp_path, memory_limit_bytes=LAYOUT.token_bytes * 16)
    store.apply(W1, segment("r1", 1, 0, 40))
    assert store.get("r1").spilled and store.spilled_bytes == 40 * LAYOUT.token_bytes
    store.apply(W1, segment("r1", 2, 0, 2, salt=0.5))
    assert not store.get("r1").spilled and store.spilled_bytes == 0 and list(tmp_path.iterdir()) == []
    assert torch.equal(store.read_kv("r1", 2), kv_of(0, 2, salt=0.5))


def test_failed_spill_drops_the_kv_but_keeps_the_commit_for_a_reprefill(tmp_path):
    """Memory stays within its limit when the disk refuses the spill (here: no directory; tests/unit/
    test_checkpoint_spill_full.py fills a real tmpfs)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    store = CheckpointStore(blocker / "spill", memory_limit_bytes=LAYOUT.token_bytes * 8)
    store.apply(W1, segment("r1", 1, 0, 20, outputs=[5]))
    assert store.memory_bytes <= store.memory_limit_bytes and store.stats().spill_failures_total == 1
    record = store.get("r1")
    assert record.kv_tokens == 0 and list(record.state.output_token_ids) == [5] and not record.spilled
    # Later segments keep the commit's tokens current, without KV, until the disk is tried again.
    ack = store.apply(W1, segment("r1", 2, 20, 21, outputs=[6]))
    assert ack.result is SegmentResult.APPLIED and ack.kv_tokens == 0
    assert list(store.get("r1").state.output_token_ids) == [5, 6]


def test_requests_idle_past_retention_are_dropped(tmp_path):
    now = [0.0]
    store = CheckpointStore(tmp_path, memory_limit_bytes=LAYOUT.token_bytes * 16, retention_s=600, clock=lambda: now[0])
    store.apply(W1, segment("old", 1, 0, 20))
    assert store.get("old").spilled
    now[0] = 500
    store.apply(W1, segment("young", 1, 0, 2))
    now[0] = 601
    assert store.expire() == ["old"]
    assert "old" not in store and "young" in store and store.spilled_bytes == 0
    now[0] = 1101
    assert store.expire() == ["young"] and len(store) == 0


def test_a_dead_workers_requests_stay_until_released_or_expired(store):
    store.apply(W1, segment("r1", 1, 0, 4))
    # Nothing ties a commit to its stream: the store keeps it for a restore elsewhere.
    assert store.records("w1")[0].kv_tokens == 4 and store.expire() == []


def test_kv_across_block_boundaries_reads_back_byte_exact(tmp_path):
    store = CheckpointStore(tmp_path, memory_limit_bytes=64 * 4 * LAYOUT.token_bytes)  # blocks of 4 positions
    store.apply(W1, segment("r1", 1, 0, 7))
    store.apply(W1, segment("r1", 2, 7, 9))
    store.apply(W1, segment("r1", 3, 9, 17))
    assert torch.equal(store.read_kv("r1", 17), kv_of(0, 17)) and torch.equal(store.read_kv("r1", 3), kv_of(0, 3))
    store.apply(W2, segment("r1", 1, 6, 13, salt=0.5))  # truncates into a block, then crosses two more
    kv = store.read_kv("r1", 13)
    assert torch.equal(kv[:, :, :6], kv_of(0, 6)) and torch.equal(kv[:, :, 6:], kv_of(6, 13, salt=0.5))
    assert store.memory_bytes == 4 * 4 * LAYOUT.token_bytes  # the blocks past position 13 went back
    store.close()


def test_released_kv_memory_is_reused_by_later_requests_within_the_limit(tmp_path):
    limit = 64 * 4 * LAYOUT.token_bytes
    store = CheckpointStore(tmp_path, memory_limit_bytes=limit)
    store.apply(W1, segment("r1", 1, 0, 40))
    held = store.memory_bytes
    store.release("r1")
    assert store.memory_bytes == 0 and store.pooled_bytes == held
    store.apply(W1, segment("r2", 1, 0, 20))
    assert store.pooled_bytes == held - store.memory_bytes
    for i in range(3, 9):  # well past the limit: spills, and the blocks kept for reuse shrink to make room
        store.apply(W1, segment(f"r{i}", 1, 0, 60, salt=i / 8))
        assert store.memory_bytes + store.pooled_bytes <= limit
    assert torch.equal(store.read_kv("r2", 20), kv_of(0, 20)) and torch.equal(store.read_kv("r5", 60), kv_of(0, 60, salt=5 / 8))
    store.close()


def test_read_kv_fills_a_given_tensor(store):
    store.apply(W1, segment("r1", 1, 0, 5))
    out = torch.empty(LAYOUT.shape(5), dtype=LAYOUT.dtype)
    assert store.read_kv("r1", 5, out) is out and torch.equal(out, kv_of(0, 5))
    with pytest.raises(ValueError):
        store.read_kv("r1", 4, out)


def test_pooled_blocks_reused_by_another_request_never_alias_kv_read_before(tmp_path):
    store = CheckpointStore(tmp_path, memory_limit_bytes=64 * 4 * LAYOUT.token_bytes)  # blocks of 4 positions
    store.apply(W1, segment("r1", 1, 0, 10))
    read_before = store.read_kv("r1", 10)
    store.release("r1")
    store.apply(W1, segment("r2", 1, 0, 10, salt=0.25))  # takes r1's blocks back from the pool and overwrites them
    assert store.pooled_bytes == 0
    assert torch.equal(read_before, kv_of(0, 10)) and torch.equal(store.read_kv("r2", 10), kv_of(0, 10, salt=0.25))


def test_a_growing_request_takes_a_block_per_block_of_positions_and_reads_back_byte_exact(tmp_path):
    store = CheckpointStore(tmp_path, memory_limit_bytes=64 * 4 * LAYOUT.token_bytes)  # blocks of 4 positions
    block_bytes = 4 * LAYOUT.token_bytes
    store.apply(W1, segment("r1", 1, 0, 3))
    assert store.memory_bytes == block_bytes
    for seq, position in enumerate(range(3, 23), start=2):  # one position a segment, as a decode step sends it
        store.apply(W1, segment("r1", seq, position, position + 1))
        assert store.memory_bytes == -(-(position + 1) // 4) * block_bytes
    assert torch.equal(store.read_kv("r1", 23), kv_of(0, 23)) and store.committed_tokens == 23


def test_token_only_segments_leave_kv_and_totals_as_they_are(store):
    store.apply(W1, segment("r1", 1, 0, 6, outputs=[21]))
    memory, committed = store.memory_bytes, store.committed_tokens
    for seq in range(2, 6):
        ack = store.apply(W1, segment("r1", seq, 6, 6, outputs=[20 + seq], generator_state=bytes([seq])))
        assert (ack.result, ack.kv_tokens, ack.seq) == (SegmentResult.APPLIED, 6, seq)
    record = store.get("r1")
    assert list(record.state.output_token_ids) == [21, 22, 23, 24, 25] and record.last_index == 4 and record.seq == 5
    assert record.state.generator_state == bytes([5]) and (store.memory_bytes, store.committed_tokens) == (memory, committed)
    assert torch.equal(store.read_kv("r1", 6), kv_of(0, 6))
