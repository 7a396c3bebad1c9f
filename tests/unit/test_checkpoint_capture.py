"""Checkpoint capture on a real engine into the store's logic: tokens every step, KV every interval, exact restores."""

import zlib

import pytest
import torch

import phalanx.model
from phalanx._proto import checkpoint_pb2
from phalanx.checkpoint_store.store import CheckpointStore, KvLayout, SegmentResult, Writer
from phalanx.encoder_pool.tokens import expand_placeholders
from phalanx.model.sampling import SamplingParams
from phalanx.worker.checkpointing import CheckpointCapture, _Capture, _Piece, batch_of, pick_store, stream_requests
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import MediaEmbedding, RequestSnapshot
from phalanx.worker.server import media_from_proto, snapshot_from_proto, snapshot_to_proto

pytestmark = pytest.mark.unit

N = 40
INTERVAL = 16


@pytest.fixture(scope="module")
def moe():
    return phalanx.model.load("phalanx-tiny-moe")


def engine_of(model) -> Engine:
    return Engine(model, EngineConfig(deterministic=True))


def layout_of(cache: torch.Tensor) -> KvLayout:
    """The store's layout of an engine's KV cache tensor ([layers, 2, blocks, block tokens, heads, dim])."""
    return KvLayout(num_layers=cache.shape[0], num_kv_heads=cache.shape[4], head_dim=cache.shape[5], dtype=cache.dtype)


def tokens_of(engine: Engine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.request_id == request_id and e.index >= 0]
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_commit_after_any_step_restores_to_the_same_continuation(moe, tmp_path, temperature):
    prompt = moe.tokenizer.encode("checkpoints follow the stream of tokens one step behind at most " * 2)
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=temperature, seed=11)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r"))
    expected = tokens_of(reference, "r")

    source = engine_of(moe)
    cache = source.cache.data
    layout = layout_of(cache)
    store = CheckpointStore(tmp_path)
    writer = Writer("w", layout, "tiny@1")
    capture = CheckpointCapture(interval_tokens=INTERVAL)
    capture.connected = True
    source.add_request(EngineRequest(prompt, params, "r"))
    kv_segments = 0
    for outputs in range(1, N - 4):
        source.step()
        capture.capture(source)
        for item in capture.take():
            for segment in batch_of([item], snapshot_to_proto).segments:
                assert store.apply(writer, segment).result is SegmentResult.APPLIED
                kv_segments += segment.kv_end > segment.kv_start
        record = store.get("r")
        # Every step's tokens are committed; the KV at most an interval behind them.
        assert list(record.state.output_token_ids) == expected[:outputs]
        assert 0 <= len(prompt) + outputs - 1 - record.kv_tokens < INTERVAL
        if outputs in (5, 17, 30):  # between KV segments, just after one, and later
            target = engine_of(moe)
            snapshot = snapshot_from_proto(record.state)
            kv = store.read_kv("r", record.kv_tokens)
            target.restore(EngineRequest(snapshot.prompt_ids, snapshot.params, "r", resume=snapshot, migrated=True), kv, record.kv_tokens)
            assert tokens_of(target, "r") == expected[outputs:], outputs
    assert kv_segments == 1 + (N - 5) // INTERVAL  # the prompt's, then one per interval
    store.close()


def test_a_media_request_restores_from_the_store_alone_embeddings_included(moe, tmp_path):
    # The store keeps the media embeddings that came with the whole state: a restore needs no router's copy of them.
    text = moe.tokenizer.encode("Describe this picture in a few words:")
    prompt, (span,) = expand_placeholders([*text[:3], 0, *text[3:]], 0, [6], [99])
    rows = torch.randn(6, moe.config.hidden_size, generator=torch.Generator().manual_seed(3))
    media = [MediaEmbedding(span, rows)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r", media=media))
    expected = tokens_of(reference, "r")

    source = engine_of(moe)
    cache = source.cache.data
    layout = layout_of(cache)
    store = CheckpointStore(tmp_path)
    writer = Writer("w", layout, "tiny@1")
    capture = CheckpointCapture(interval_tokens=INTERVAL)
    capture.connected = True
    source.add_request(EngineRequest(prompt, params, "r", media=media))
    for _ in range(6):
        source.step()
        capture.capture(source)
        for item in capture.take():
            for segment in batch_of([item], snapshot_to_proto).segments:
                assert store.apply(writer, segment).result is SegmentResult.APPLIED
    record = store.get("r")
    assert record.media_held == 1 and len(store.media("r")) == 1
    target = engine_of(moe)
    snapshot = snapshot_from_proto(record.state)
    stored = [media_from_proto(i, m) for i, m in enumerate(store.media("r"))]
    assert torch.equal(stored[0].embeddings, rows) and stored[0].span == span
    # Only positions past the KV are recomputed, but those may include media rows: a restore from position 0 shows that
    # the stored embeddings are the ones the prompt was computed with.
    for kv_tokens in (record.kv_tokens, 0):
        request = EngineRequest(snapshot.prompt_ids, snapshot.params, "r", resume=snapshot, migrated=True, media=stored)
        target = engine_of(moe)
        target.restore(request, store.read_kv("r", kv_tokens) if kv_tokens else None, kv_tokens)
        assert tokens_of(target, "r") == expected[len(snapshot.output_ids):], kv_tokens
    store.close()


def test_over_budget_capture_sends_tokens_and_holds_kv_back(moe):
    engine = engine_of(moe)
    capture = CheckpointCapture(interval_tokens=1)
    capture.connected = True
    engine.add_request(EngineRequest(moe.tokenizer.encode("budget"), SamplingParams(max_tokens=8, ignore_eos=True), "r"))
    engine.step()
    capture.capture(engine)
    (first,) = capture.take()
    assert first.pieces[0].kv_start == 0 and first.pieces[0].state is not None and first.nbytes > 0
    capture.max_pending_bytes = 0  # nothing was reported sent: the queue is over budget from here on
    for _ in range(3):
        engine.step()
        capture.capture(engine)
    pieces = [p for item in capture.take() for p in item.pieces]
    assert [p.kv for p in pieces] == [None] * 3 and [len(p.appended) for p in pieces] == [1, 1, 1]
    assert capture.lag_tokens == 3 and capture.captures_skipped == 3
    capture.sent(first.nbytes)
    capture.max_pending_bytes = 1 << 20
    engine.step()
    capture.capture(engine)
    ((piece,),) = [item.pieces for item in capture.take()]
    assert piece.kv_end - piece.kv_start == 4 and isinstance(piece.kv, torch.Tensor)


def test_a_copy_the_store_refused_as_superseded_is_not_sent_again_while_other_requests_are(moe, tmp_path):
    """A worker back from a partition: the store refuses its copy of a request that moved on (superseded); capture
    stops sending that copy and goes on with the rest."""
    engine = engine_of(moe)
    cache = engine.cache.data
    layout = layout_of(cache)
    store = CheckpointStore(tmp_path)
    capture = CheckpointCapture(interval_tokens=1)
    capture.connected = True
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for request_id in ("moved", "kept"):
        engine.add_request(EngineRequest(moe.tokenizer.encode(f"partition {request_id}"), params, request_id))
    engine.step()
    capture.capture(engine)
    segments = [s for item in capture.take() for s in batch_of([item], snapshot_to_proto).segments]
    assert {s.request_id for s in segments} == {"moved", "kept"} and all(s.copy_id > 0 for s in segments)
    for segment in segments:
        store.apply(Writer("w1", layout, "tiny@1"), segment)
    # "moved" went on elsewhere: a copy on w2 took its commit over.
    taken = store.get("moved")
    store.apply(Writer("w2", layout, "tiny@1"), checkpoint_pb2.Segment(
        request_id="moved", seq=1, kv_start=taken.kv_tokens, kv_end=taken.kv_tokens, state=taken.state, copy_id=segments[0].copy_id + 1))
    engine.step()
    capture.capture(engine)
    w1 = Writer("w1", layout, "tiny@1")
    acks = [store.apply(w1, s).to_proto() for item in capture.take() for s in batch_of([item], snapshot_to_proto).segments]
    (refused,) = [a for a in acks if a.superseded]
    assert refused.request_id == "moved" and not refused.resync and store.get("moved").worker_id == "w2"
    capture.superseded(refused.request_id, refused.copy_id)
    engine.step()
    capture.capture(engine)
    assert {p.request_id for item in capture.take() for p in item.pieces} == {"kept"}
    store.close()


def test_a_worker_whose_store_stream_broke_prefers_another_advertised_store():
    assert pick_store(["a:1", "b:2"], failed="") == "a:1"
    assert pick_store(["a:1", "b:2"], failed="a:1") == "b:2"  # a crashed store lingers in etcd until its lease lapses
    assert pick_store(["a:1"], failed="a:1") == "a:1"  # the only one: it may have restarted on the same address
    assert pick_store([], failed="a:1") is None


def test_a_worker_restored_from_the_store_continues_that_commit_without_resending_its_kv(moe, tmp_path):
    """A and B stream to one store; A dies after 20 tokens and B restores from A's commit: B's segments take the
    commit over (its owner, its later tokens and KV) and carry none of the KV the store already has."""
    prompt = moe.tokenizer.encode("the store keeps what the dead worker computed " * 2)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    reference = engine_of(moe)
    reference.add_request(EngineRequest(prompt, params, "r"))
    expected = tokens_of(reference, "r")

    a, b = engine_of(moe), engine_of(moe)
    cache = a.cache.data
    layout = layout_of(cache)
    store = CheckpointStore(tmp_path)

    def stream(engine: Engine, capture: CheckpointCapture, writer: Writer) -> list:
        capture.capture(engine)
        segments = [s for item in capture.take() for s in batch_of([item], snapshot_to_proto).segments]
        for segment in segments:
            assert store.apply(writer, segment).result is SegmentResult.APPLIED
        return segments

    capture_a = CheckpointCapture(interval_tokens=INTERVAL)
    capture_a.connected = True
    a.add_request(EngineRequest(prompt, params, "r"))
    def committed_outputs() -> int:
        return next((len(r.state.output_token_ids) for r in store.records() if r.request_id == "r"), 0)

    while committed_outputs() < 20:
        a.step()
        stream(a, capture_a, Writer("a", layout, "tiny@1"))
    record = store.get("r")  # A dies here
    committed_outputs, committed_kv = len(record.state.output_token_ids), record.kv_tokens

    snapshot = snapshot_from_proto(record.state)
    request = EngineRequest(snapshot.prompt_ids, snapshot.params, "r", resume=snapshot, migrated=True, continues_commit=True)
    b.restore(request, store.read_kv("r", committed_kv), committed_kv)
    capture_b = CheckpointCapture(interval_tokens=INTERVAL)
    capture_b.connected = True
    writer_b = Writer("b", layout, "tiny@1")
    b.step()
    [takeover] = stream(b, capture_b, writer_b)
    assert takeover.kv_start == committed_kv and takeover.HasField("state")  # none of the stored KV again
    outputs = list(store.get("r").state.output_token_ids)
    assert outputs == expected[: committed_outputs + 1] and store.get("r").worker_id == "b"
    while b.has_work():
        b.step()
        stream(b, capture_b, writer_b)
        record = store.get("r")
        assert list(record.state.output_token_ids) == expected[: len(record.state.output_token_ids)]
    # The store's KV, A's part and B's, is what an uninterrupted run computes: a restore from it goes on identically.
    target = engine_of(moe)
    snapshot = snapshot_from_proto(record.state)
    request = EngineRequest(snapshot.prompt_ids, snapshot.params, "r", resume=snapshot, migrated=True)
    target.restore(request, store.read_kv("r", record.kv_tokens), record.kv_tokens)
    assert tokens_of(target, "r") == expected[len(record.state.output_token_ids) :]
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("interval", [1, INTERVAL])
def test_steps_coalesced_into_one_message_commit_what_one_message_per_step_commits(moe, tmp_path, interval):
    """A message carrying several steps merges each request's steps into one segment: the store ends in the same
    commit (outputs, generator state, seq, KV bytes) as with a message per step, in fewer segments."""
    engine = engine_of(moe)
    cache = engine.cache.data
    layout = layout_of(cache)
    writer = Writer("w", layout, "tiny@1")
    per_step, coalesced = CheckpointStore(tmp_path / "a"), CheckpointStore(tmp_path / "b")
    capture = CheckpointCapture(interval_tokens=interval)
    capture.connected = True
    for i, (text, max_tokens, temperature) in enumerate([("one", 30, 0.0), ("two tokens", 12, 0.9), ("three", 30, 0.7)]):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i)
        engine.add_request(EngineRequest(moe.tokenizer.encode(text * 5), params, f"r{i}"))
    segments = {"per_step": 0, "coalesced": 0}
    pending = []
    while engine.has_work():
        engine.step()
        capture.capture(engine)
        items = capture.take()
        pending += items
        for item in items:
            batch = batch_of([item], snapshot_to_proto)
            apply(per_step, writer, batch)
            segments["per_step"] += len(batch.segments)
        if len(pending) >= 4 or not engine.has_work():  # a message every 4 steps, or the last
            # What the streamer writes is the message protobuf would write, field for field.
            batch = parsed(stream_requests(pending, snapshot_to_proto))
            assert batch == batch_of(pending, snapshot_to_proto)
            apply(coalesced, writer, batch)
            segments["coalesced"] += len(batch.segments)
            pending = []
            assert_same_commits(per_step, coalesced)
    assert segments["coalesced"] < segments["per_step"] / 2
    assert "r1" not in coalesced  # finished and released in the middle of a message
    per_step.close()
    coalesced.close()


def parsed(messages: list[bytes]) -> checkpoint_pb2.Batch:
    """The batches of written StreamRequests as one, in order: what the store applies."""
    batch = checkpoint_pb2.Batch()
    for message in messages:
        request = checkpoint_pb2.StreamRequest.FromString(message)
        assert request.WhichOneof("body") == "batch"
        batch.MergeFrom(request.batch)
    return batch


def apply(store: CheckpointStore, writer: Writer, batch: checkpoint_pb2.Batch) -> None:
    for segment in batch.segments:
        assert store.apply(writer, segment).result is SegmentResult.APPLIED
    for request_id in batch.released_request_ids:
        store.release(request_id, worker_id=writer.worker_id)


def assert_same_commits(expected: CheckpointStore, actual: CheckpointStore) -> None:
    records = {r.request_id: r for r in expected.records()}
    assert {r.request_id for r in actual.records()} == set(records)
    for record in actual.records():
        want = records[record.request_id]
        want.updated_at = record.updated_at
        assert record == want, record.request_id
        assert torch.equal(actual.read_kv(record.request_id, record.kv_tokens), expected.read_kv(want.request_id, want.kv_tokens))


def test_one_gather_index_covers_short_and_long_ranges_in_order(moe):
    engine = engine_of(moe)
    for i, length in enumerate([90, 20, 150]):
        engine.add_request(EngineRequest([1 + i] * length, SamplingParams(max_tokens=4, ignore_eos=True), f"r{i}"))
    engine.step()
    ranges = [("r0", 0, 90), ("r1", 3, 19), ("r2", 17, 18), ("r0", 40, 41)]
    expected = engine.cache.gather(torch.cat([engine.kv.slots(seq_id, start, end) for seq_id, start, end in ranges]))
    assert torch.equal(engine.cache.gather_ranges(engine.kv, ranges), expected)


def test_written_message_matches_protobuf_for_strided_bfloat16_kv_states_and_releases():
    gathered = torch.randn(2, 2, 300, 2, 8).to(torch.bfloat16)  # one gather, pieces are strided views of it
    prompt = RequestSnapshot("b", [1, 2, 3], [4], SamplingParams(max_tokens=9), seed=5, generator_state=b"g")
    captures = [
        _Capture(pieces=[
            _Piece("a", 7, 40, 290, gathered[:, :, :250], None, [9, 10], b"", 0),  # > 16 KiB: multi-byte lengths
            _Piece("b", 1, 0, 3, gathered[:, :, 250:253], prompt, [], b"g", 5),
        ], released=["x"]),
        _Capture(pieces=[_Piece("a", 8, 290, 290, None, None, [11], b"", 0), _Piece("b", 2, 3, 4, gathered[:, :, 253:254], None, [12], b"h", 5)]),
        _Capture(released=["y", "a"]),
    ]
    expected = batch_of(captures, snapshot_to_proto)
    assert parsed(stream_requests(captures, snapshot_to_proto)) == expected
    assert [(s.request_id, s.seq, s.kv_start, s.kv_end) for s in expected.segments] == [("a", 8, 40, 290), ("b", 2, 0, 4)]
    assert expected.segments[1].state.output_token_ids == [4, 12] and expected.segments[1].generator_state == b"h"
    assert expected.segments[0].kv == gathered[:, :, :250].contiguous().view(torch.uint8).numpy().tobytes()
    assert list(expected.released_request_ids) == ["x", "y", "a"]
    # Every segment with KV carries its checksum, which the store verifies (test_checkpoint_checksums.py).
    assert [s.kv_crc32 == zlib.crc32(s.kv) for s in expected.segments if s.HasField("kv_crc32")] == [True, True]
    assert len(stream_requests(captures, snapshot_to_proto)) == 1  # 32 KB of KV: one message
    # Cut into small messages: each holds whole segments in order, the release list rides in the last.
    small = stream_requests(captures, snapshot_to_proto, max_bytes=1000)
    assert len(small) == 2 and parsed(small) == expected  # "a" (32 KB) alone, then "b" with the releases
    assert [len(checkpoint_pb2.StreamRequest.FromString(m).batch.released_request_ids) for m in small] == [0, 3]
    assert checkpoint_pb2.StreamRequest.FromString(small[1]).batch.segments[0].request_id == "b"
    assert parsed(stream_requests([], snapshot_to_proto)) == checkpoint_pb2.Batch()
