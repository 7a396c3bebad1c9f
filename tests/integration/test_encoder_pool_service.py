"""The encoder pool process against a real etcd: it registers with its backlog, encodes media over gRPC with the numbers
an in-process encoder gives, batches concurrent images, refuses bad media and overload with typed status, and leaves on
SIGTERM.

One encoder for the module (the process imports torch: seconds); tests run in file order and the last one stops it.
"""

from __future__ import annotations

import asyncio
import io
import signal
import wave

import cv2
import grpc
import numpy as np
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from phalanx._proto import encoder_pb2, encoder_pb2_grpc
from phalanx.common.block_hash import media_hash
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EncoderDirectory
from phalanx.encoder_pool.models import load_image_encoder
from phalanx.launch.services import ServiceHandle, start_encoder_pool
from phalanx.launch.stack import unique_id
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

HIDDEN = 64


@pytest.fixture(scope="module")
def etcd(etcd_server):
    return EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)


@pytest.fixture(scope="module")
def encoder(etcd):
    handle = asyncio.run(start_encoder_pool(unique_id("enc"), etcd, "--llm-hidden-size", str(HIDDEN)))
    try:
        yield handle
    finally:
        handle.kill()


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    return cv2.imencode(".png", pixels)[1].tobytes()


def _wav(seconds: float) -> bytes:
    samples = (np.sin(np.arange(int(16_000 * seconds)) * 0.05) * 8000).astype(np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def _image(data: bytes) -> encoder_pb2.MediaItem:
    return encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_IMAGE, data=data)


def _rows(embedding: encoder_pb2.Embedding) -> torch.Tensor:
    assert embedding.dtype == "float32"
    return torch.frombuffer(bytearray(embedding.data), dtype=torch.float32).view(embedding.rows, embedding.hidden)


def _details(error: grpc.aio.AioRpcError, kind):
    status = rpc_status.from_call(error)
    found = []
    for detail in status.details if status else ():
        message = kind()
        if detail.Unpack(message):
            found.append(message)
    return found


async def test_encoder_registers_what_it_serves(encoder: ServiceHandle, etcd):
    async with EncoderDirectory(etcd) as directory:
        registration = (await directory.list())[encoder.name]
    assert registration.address == encoder.address
    assert list(registration.modalities) == [encoder_pb2.MODALITY_IMAGE, encoder_pb2.MODALITY_VIDEO, encoder_pb2.MODALITY_AUDIO]
    assert (registration.llm_hidden_size, registration.image_positions, registration.audio_chunk_positions) == (HIDDEN, 16, 375)
    assert {c.modality for c in registration.load.costs} == set(registration.modalities)
    assert registration.embedding_dtype == "float32"  # with llm_hidden_size: the bytes a router prices moving
    assert registration.load.delivery_bytes_per_s == 0  # nothing sent to a worker yet


async def test_image_embeddings_over_grpc_equal_an_in_process_encoder(encoder: ServiceHandle):
    data = _png(1)
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        reply = await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
            encoder_pb2.EncodeRequest(request_id="r1", items=[_image(data)])
        )
    (embedding,) = reply.embeddings
    assert (embedding.rows, embedding.hidden, embedding.units) == (16, HIDDEN, 1)
    assert embedding.media_hash == media_hash(data)
    local = load_image_encoder("tiny-clip", HIDDEN)
    expected = local.encode(local.preprocess(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1])[None])[0]
    torch.testing.assert_close(_rows(embedding), expected, rtol=1e-5, atol=1e-5)
    assert reply.encoder_id == encoder.name and reply.encode_ms > 0


async def test_concurrent_images_are_batched_together(encoder: ServiceHandle):
    images = [_png(seed) for seed in range(16)]
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        replies = await asyncio.gather(*(
            stub.Encode(encoder_pb2.EncodeRequest(request_id=f"b{n}", items=[_image(data)])) for n, data in enumerate(images)
        ))
    assert [r.embeddings[0].media_hash for r in replies] == [media_hash(d) for d in images]
    batches = encoder.metric("phalanx_encoder_batch_size_count", modality="image")
    units = encoder.metric("phalanx_encoder_units_total", modality="image")
    # 17 images so far (one earlier test), in fewer batches than images: some batch held several.
    assert units == 17 and batches < units
    assert encoder.metric("phalanx_encoder_unit_cost_ms", modality="image") > 0


async def test_audio_and_video_are_encoded_to_their_positions(encoder: ServiceHandle, tmp_path):
    writer = cv2.VideoWriter(str(tmp_path / "v.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (48, 32))
    for n in range(30):
        writer.write(np.full((32, 48, 3), n * 8, np.uint8))
    writer.release()
    video = encoder_pb2.MediaItem(
        modality=encoder_pb2.MODALITY_VIDEO, data=(tmp_path / "v.avi").read_bytes(),
        video=encoder_pb2.VideoOptions(sampling=encoder_pb2.FRAME_SAMPLING_FPS, fps=2.0, max_frames=16),
    )
    audio = encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_AUDIO, data=_wav(3.0))
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        reply = await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(encoder_pb2.EncodeRequest(items=[video, audio]))
    frames, sound = reply.embeddings
    assert (frames.units, frames.rows) == (6, 6 * 16)  # 3 s at 2 fps
    assert (sound.units, sound.rows) == (1, 38)  # 300 mel frames -> 150 positions -> 38 stacked by 4


@pytest.mark.parametrize(
    ("item", "field"),
    [
        (encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_IMAGE, data=b"\x89PNG\r\n\x1a\nbroken"), "items[0].data"),
        (encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_AUDIO, data=b"RIFF....WAVEfmt "), "items[0].data"),
        (encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_VIDEO, data=b"\x00" * 64), "items[0].data"),
        (encoder_pb2.MediaItem(data=b"x"), "items[0].modality"),
    ],
    ids=["corrupt-image", "corrupt-wav", "corrupt-video", "no-modality"],
)
async def test_bad_media_are_invalid_argument_naming_the_item(encoder: ServiceHandle, item, field):
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(encoder_pb2.EncodeRequest(items=[item]))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (bad_request,) = _details(error.value, error_details_pb2.BadRequest)
    assert bad_request.field_violations[0].field == field


async def test_over_the_visual_token_budget_is_invalid_argument(encoder: ServiceHandle):
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
                encoder_pb2.EncodeRequest(items=[_image(_png(1)), _image(_png(2))], max_positions=24)
            )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert encoder.metric("phalanx_encoder_items_total", modality="image", result="invalid") >= 1


async def test_an_encoder_past_its_backlog_refuses_with_a_retry_hint(etcd):
    # One unit per batch: the audio below takes four batches in turn, so the encoder is still busy when the image comes
    # (a single batch of four, on a warm encoder, could finish between seeing the backlog and sending the image).
    busy = await start_encoder_pool(unique_id("enc-busy"), etcd, "--llm-hidden-size", "8", "--max-backlog-ms", "1", "--max-batch", "1")
    try:
        async with grpc.aio.insecure_channel(busy.address) as channel:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            # Two minutes of audio: four 30 s chunks queued, admitted because the encoder is idle.
            long_audio = asyncio.ensure_future(
                stub.Encode(encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_AUDIO, data=_wav(120))]))
            )

            async def queued() -> bool:
                return (await stub.GetLoad(encoder_pb2.GetLoadRequest())).load.backlog_ms > 0

            await assert_eventually(queued, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Encode(encoder_pb2.EncodeRequest(items=[_image(_png(3))]))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            (retry,) = _details(error.value, error_details_pb2.RetryInfo)
            assert retry.retry_delay.ToTimedelta().total_seconds() > 0
            assert (await long_audio).embeddings[0].units == 4
        assert busy.metric("phalanx_encoder_items_total", modality="image", result="overloaded") == 1
    finally:
        busy.kill()


async def test_the_encoder_advertises_the_bandwidth_of_its_sends_to_workers(encoder: ServiceHandle, etcd):
    # 16 images x 16 rows x 64 values x 4 bytes = 64 KiB, the least one send must move to measure a link.
    images = [_image(_png(100 + i)) for i in range(16)]
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        reply = await stub.Encode(encoder_pb2.EncodeRequest(request_id="sent", items=images, deliver=True), timeout=60)
        keys = [e.key for e in reply.embeddings]
        fetch = encoder_pb2.FetchEmbeddingsRequest(keys=keys, worker_id="w-fetching")
        received = b"".join([c.data async for c in stub.FetchEmbeddings(fetch, timeout=30)])
        assert len(received) == 16 * 16 * HIDDEN * 4
        load = (await stub.GetLoad(encoder_pb2.GetLoadRequest(), timeout=10)).load
    measured = load.delivery_bytes_per_s
    assert measured > 0
    # The one send so far was to that worker: its link's average is the same figure.
    assert dict(load.delivery_bytes_per_s_by_worker) == pytest.approx({"w-fetching": measured})

    async def advertised() -> encoder_pb2.EncoderLoad | None:
        async with EncoderDirectory(etcd) as directory:
            load = (await directory.list())[encoder.name].load
        return load if load.delivery_bytes_per_s > 0 else None

    advertised_load = await assert_eventually(advertised, timeout=10, interval=0.2)
    assert advertised_load.delivery_bytes_per_s == pytest.approx(measured)
    assert dict(advertised_load.delivery_bytes_per_s_by_worker) == pytest.approx({"w-fetching": measured})


async def test_sigterm_stops_the_encoder_and_removes_its_registration(encoder: ServiceHandle, etcd):
    encoder.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(encoder.process.wait, 30) == 0

    async def gone() -> bool:
        async with EncoderDirectory(etcd) as directory:
            return encoder.name not in await directory.list()

    await assert_eventually(gone, timeout=5)
