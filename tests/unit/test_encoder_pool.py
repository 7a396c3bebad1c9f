"""The encoder pool's pure parts (cost model, admission, per-modality batching) and its engine on the built-in encoders."""

import asyncio
import io
import wave

import cv2
import numpy as np
import pytest
import torch

from phalanx._proto import common_pb2
from phalanx.common.block_hash import media_hash
from phalanx.encoder_pool.batching import BatchQueues, Unit
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.encoder_pool.cost import PRIOR_UNIT_MS, Admission, CostModel, Modality
from phalanx.encoder_pool.errors import EncoderOverloadedError, MediaError
from phalanx.encoder_pool.pool import EncodedItem, EncodePool, MediaInput, VideoRequest

pytestmark = pytest.mark.unit

IMAGE, VIDEO, AUDIO = Modality.IMAGE, Modality.VIDEO, Modality.AUDIO


def test_cost_model_starts_from_priors_and_follows_measurements():
    cost = CostModel(alpha=0.5)
    assert cost.unit_ms(IMAGE) == PRIOR_UNIT_MS[IMAGE] and not cost.measured(IMAGE)
    cost.observe(IMAGE, 4, 40.0)  # the first measurement replaces the prior
    assert cost.unit_ms(IMAGE) == 10.0 and cost.measured(IMAGE)
    cost.observe(IMAGE, 2, 40.0)  # 20 ms/unit, half weight
    assert cost.unit_ms(IMAGE) == 15.0
    assert cost.unit_ms(AUDIO) == PRIOR_UNIT_MS[AUDIO]  # modalities are learned apart
    assert cost.estimate_ms({IMAGE: 2, AUDIO: 1}) == 30.0 + PRIOR_UNIT_MS[AUDIO]


def test_admission_refuses_past_the_backlog_bound_with_a_retry_hint():
    cost = CostModel()
    cost.observe(IMAGE, 1, 100.0)
    admission = Admission(cost, max_backlog_ms=500.0, max_queued_units=100)
    admission.admit({IMAGE: 20})  # an idle encoder takes one request of any size
    assert admission.backlog_ms == 2000.0
    with pytest.raises(EncoderOverloadedError) as refused:
        admission.admit({IMAGE: 1})
    assert refused.value.retry_after_s == pytest.approx(2.0)
    assert admission.queued[IMAGE] == 20  # nothing counted for the refused request
    admission.done(IMAGE, 18)
    admission.admit({IMAGE: 2})
    assert admission.queued_units == 4


def test_admission_bounds_queued_units_whatever_their_cost():
    admission = Admission(CostModel(), max_backlog_ms=1e9, max_queued_units=10)
    admission.admit({VIDEO: 8})
    with pytest.raises(EncoderOverloadedError):
        admission.admit({VIDEO: 3})


def test_batches_hold_one_modality_at_most_max_batch_units_oldest_modality_first():
    queues: BatchQueues[str] = BatchQueues(max_batch=3)
    queues.push([Unit(AUDIO, "a0")])
    queues.push([Unit(IMAGE, f"i{n}") for n in range(5)])
    queues.push([Unit(AUDIO, "a1"), Unit(VIDEO, "v0")])
    batches = []
    while (batch := queues.next_batch()) is not None:
        batches.append((batch.modality, [u.payload for u in batch.units]))
    assert batches == [(AUDIO, ["a0", "a1"]), (IMAGE, ["i0", "i1", "i2"]), (IMAGE, ["i3", "i4"]), (VIDEO, ["v0"])]
    assert len(queues) == 0


def _png(seed: int, shape=(40, 50)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    return cv2.imencode(".png", pixels)[1].tobytes()


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * 300 * t) * 8000).astype(np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def _video(path, frames: int) -> bytes:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (48, 32))
    for n in range(frames):
        writer.write(np.full((32, 48, 3), (n * 25) % 256, np.uint8))
    writer.release()
    return path.read_bytes()


@pytest.fixture(scope="module")
def config():
    return EncoderPoolConfig(llm_hidden_size=32, max_batch=4)


async def _running(config):
    pool = EncodePool(config)
    task = asyncio.get_running_loop().create_task(pool.run())
    return pool, task


async def test_pool_encodes_each_modality_to_llm_embeddings(config, tmp_path):
    pool, task = await _running(config)
    try:
        image, video, audio = _png(1), _video(tmp_path / "v.avi", 20), _wav(2.0)
        result = await pool.encode([
            MediaInput(IMAGE, image),
            MediaInput(VIDEO, video, VideoRequest(max_frames=3)),
            MediaInput(AUDIO, audio),
        ])
    finally:
        task.cancel()
    first, second, third = result.items
    assert first.embeddings.shape == (16, 32) and first.units == 1 and first.media_hash == media_hash(image)
    assert second.embeddings.shape == (3 * 16, 32) and second.units == 3
    # 2 s of audio: 200 mel frames -> 100 encoder positions -> 25 LLM positions (4 stacked), of a padded 30 s chunk.
    assert third.embeddings.shape == (25, 32) and third.units == 1
    assert pool.admission.queued_units == 0
    assert pool.cost.measured(IMAGE) and pool.cost.measured(VIDEO) and pool.cost.measured(AUDIO)
    assert result.encode_ms >= result.queue_ms >= 0


def test_a_new_pool_keeps_its_priors_through_the_warm_up_forward(config):
    pool = EncodePool(config)
    # The warm-up forward (cold kernels, allocator growth) is not a measurement: the priors stand until real batches.
    assert not any(pool.cost.measured(m) for m in Modality)
    assert pool.cost.unit_ms(IMAGE) == PRIOR_UNIT_MS[IMAGE]


async def test_batched_and_alone_encodings_are_the_same_numbers(config):
    pool, task = await _running(config)
    try:
        images = [_png(seed) for seed in range(6)]
        alone = [(await pool.encode([MediaInput(IMAGE, data)])).items[0].embeddings for data in images]
        together = await asyncio.gather(*(pool.encode([MediaInput(IMAGE, data)]) for data in images))
    finally:
        task.cancel()
    for one, batched in zip(alone, together, strict=True):
        torch.testing.assert_close(batched.items[0].embeddings, one, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])


async def test_bad_media_and_budgets_are_invalid_arguments(config, tmp_path):
    pool, task = await _running(config)
    try:
        with pytest.raises(MediaError, match="decodable image"):
            await pool.encode([MediaInput(IMAGE, b"\x89PNG\r\n\x1a\ncorrupt")])
        with pytest.raises(MediaError, match="WAV"):
            await pool.encode([MediaInput(AUDIO, _png(0))])
        with pytest.raises(MediaError, match="more than"):
            await pool.encode([MediaInput(VIDEO, _video(tmp_path / "v.avi", 5), VideoRequest(max_frames=500))])
        with pytest.raises(MediaError, match="20 prompt positions"):
            await pool.encode([MediaInput(IMAGE, _png(1)), MediaInput(IMAGE, _png(2))], max_positions=20)
        # The budget thins a video to the frames that fit: 40 positions hold 2 frames of 16.
        video = await pool.encode([MediaInput(VIDEO, _video(tmp_path / "w.avi", 10), VideoRequest(max_frames=8))], max_positions=40)
        assert video.items[0].units == 2
    finally:
        task.cancel()
    assert pool.admission.queued_units == 0


async def test_an_image_only_pool_refuses_audio():
    pool = EncodePool(EncoderPoolConfig(llm_hidden_size=8, audio_encoder=""))
    with pytest.raises(MediaError, match="serves"):
        await pool.encode([MediaInput(AUDIO, _wav(1.0))])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_embeddings_leave_in_the_configured_dtype_and_the_worker_reads_them_back(dtype):
    from phalanx.encoder_pool.server import embedding_to_proto
    from phalanx.worker.server import media_from_proto

    assert EncoderPoolConfig(embedding_dtype=dtype).embedding_dtype == dtype
    rows = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    item = EncodedItem(Modality.IMAGE, rows, media_hash=77, units=1)
    proto = embedding_to_proto(item, getattr(torch, dtype))
    assert proto.dtype == dtype and len(proto.data) == 16 * 256 * (4 if dtype == "float32" else 2)
    wire = common_pb2.MediaEmbedding(start=3, rows=proto.rows, hidden=proto.hidden, dtype=proto.dtype, data=proto.data, media_hash=77)
    back = media_from_proto(0, wire)
    assert back.span.start == 3 and back.span.length == 16 and back.embeddings.dtype == getattr(torch, dtype)
    assert torch.equal(back.embeddings, rows.to(getattr(torch, dtype)))  # exactly the rounded rows, nothing else lost
    if dtype != "float32":
        assert not torch.equal(back.embeddings.float(), rows)  # 16-bit does round: the option is not free
