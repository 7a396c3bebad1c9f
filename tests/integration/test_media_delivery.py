"""Direct media delivery: embeddings go encoder -> worker over a tensor channel (gRPC below a size), never
through the router; a worker that cannot fetch them (the encoder died, or dropped them at its hold time) makes the
router encode them again, inline, and the request gives the same tokens.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from phalanx._proto import common_pb2, encoder_pb2, encoder_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.errors import MEDIA_SOURCE_SUBJECT
from phalanx.launch.stack import Stack
from phalanx.testing.multimodal import MODEL, image_request as _request, in_process_tokens as _in_process, png

pytestmark = pytest.mark.integration


ROWS_BYTES = 16 * 256 * 4  # one tiny-clip image: 16 rows x hidden 256, float32
HOLD_S = 2.0  # the short-hold encoder of the last test


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start():
        await asyncio.gather(s.add_encoder(), s.add_encoder())
        await s.add_workers(1)
        await s.add_router()  # direct delivery is the default

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()








async def _tokens(address: str, request: router_pb2.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        return [c.token_id async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=120)]


def _fetched(stack: Stack, transport: str) -> float:
    return stack.workers[0].metric("phalanx_worker_media_fetch_bytes_total", transport=transport) or 0.0


def _sent(stack: Stack, transport: str) -> float:
    return sum(e.metric("phalanx_encoder_sent_bytes_total", transport=transport) or 0.0 for e in stack.encoders if e.process.poll() is None)


@pytest.mark.slow
async def test_embeddings_go_from_the_encoder_to_the_worker_over_grpc_then_a_channel_never_through_the_router(stack):
    router = stack.routers[0]
    image = _png(1)
    expected = _in_process(image, "Look: ", " What is it?")
    # The first fetch from an encoder is small (16 KB, under media_channel_min_bytes): gRPC, and a channel forms behind it.
    assert await _tokens(router.address, _request("Look: <media> What is it?", image)) == expected
    assert (_fetched(stack, "grpc"), _fetched(stack, "channel")) == (ROWS_BYTES, 0)
    assert _sent(stack, "grpc") == ROWS_BYTES
    # A repeat: the router's handles skip the encoder, and the worker fetches the held rows again.
    encoded = sum(e.metric("phalanx_encoder_items_total", modality="image", result="ok") for e in stack.encoders)
    fetches = stack.workers[0].metric("phalanx_worker_media_fetch_seconds_count")
    assert await _tokens(router.address, _request("Look: <media> What is it?", image)) == expected
    assert sum(e.metric("phalanx_encoder_items_total", modality="image", result="ok") for e in stack.encoders) == encoded
    assert router.metric("phalanx_router_embedding_cache_hits_total") == 1
    assert stack.workers[0].metric("phalanx_worker_media_fetch_seconds_count") == fetches + 1
    before = _fetched(stack, "channel")
    # Later requests find that channel kept (each encoder has its own: try new images until one goes over it).
    seed = 2
    deadline = time.monotonic() + 60
    while _fetched(stack, "channel") == before and time.monotonic() < deadline:
        seed += 1
        await asyncio.sleep(0.3)
        await _tokens(router.address, _request("Look: <media> What is it?", _png(seed)))
    assert _fetched(stack, "channel") == before + ROWS_BYTES and _sent(stack, "channel") == _fetched(stack, "channel")
    assert await _tokens(router.address, _request("Look: <media> What is it?", _png(seed))) == _in_process(
        _png(seed), "Look: ", " What is it?"
    )
    # The router never held a row; the encoders hold what they encoded until their hold time.
    assert router.metric("phalanx_router_media_inline_bytes_total") == 0
    assert sum(e.metric("phalanx_encoder_held_results") for e in stack.encoders) >= 2
    seconds = stack.workers[0].metric("phalanx_worker_media_fetch_seconds_count")
    assert seconds is not None and seconds >= 4


async def test_the_encoder_measures_its_link_to_the_fetching_worker_apart_for_joint_routing(stack):
    # Four images in one request, encoded together: one fetch of 64 KiB, the least one send must move to measure a link.
    images = [_png(200 + i) for i in range(4)]
    request = router_pb2.GenerateRequest(
        text="<media><media><media><media> Which one?", media=[router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=i) for i in images],
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    assert len(await _tokens(stack.routers[0].address, request)) == 4
    loads = []
    for encoder in (e for e in stack.encoders if e.process.poll() is None):
        async with grpc.aio.insecure_channel(encoder.address) as channel:
            loads.append((await encoder_pb2_grpc.EncoderServiceStub(channel).GetLoad(encoder_pb2.GetLoadRequest(), timeout=10)).load)
    links = [dict(load.delivery_bytes_per_s_by_worker) for load in loads if load.delivery_bytes_per_s_by_worker]
    assert links and all(set(link) == {stack.workers[0].worker_id} and min(link.values()) > 0 for link in links)


async def test_the_inline_setting_sends_the_rows_through_the_router_with_the_same_tokens(stack):
    inline = await stack.add_router(env={"PHALANX_ROUTER_MEDIA_DELIVERY": "inline"})
    image = _png(1)
    fetched = _fetched(stack, "grpc") + _fetched(stack, "channel")
    assert await _tokens(inline.address, _request("Look: <media> What is it?", image)) == _in_process(image, "Look: ", " What is it?")
    assert inline.metric("phalanx_router_media_inline_bytes_total") == ROWS_BYTES
    assert _fetched(stack, "grpc") + _fetched(stack, "channel") == fetched


async def test_an_encoder_killed_between_encode_and_fetch_is_replaced_by_an_inline_encode(stack):
    router = stack.routers[0]
    image = _png(50)
    expected = _in_process(image, "Look: ", " What is it?")
    held = {e.name: e.metric("phalanx_encoder_items_total", modality="image", result="ok") or 0 for e in stack.encoders}
    assert await _tokens(router.address, _request("Look: <media> What is it?", image)) == expected
    # The router keeps the handles (not the rows) for a repeat; the encoder holding the rows dies before that repeat's fetch.
    holder = next(e for e in stack.encoders if (e.metric("phalanx_encoder_items_total", modality="image", result="ok") or 0) > held[e.name])
    holder.kill()
    failures = stack.workers[0].metric("phalanx_worker_media_fetch_failures_total") or 0
    reencodes = router.metric("phalanx_router_media_reencodes_total", cause="fetch_failed") or 0
    assert await _tokens(router.address, _request("Look: <media> What is it?", image)) == expected
    assert stack.workers[0].metric("phalanx_worker_media_fetch_failures_total") == failures + 1
    assert router.metric("phalanx_router_media_reencodes_total", cause="fetch_failed") == reencodes + 1
    stack.encoders.remove(holder)


async def test_held_embeddings_expire_and_a_late_request_is_encoded_again(stack):
    # Only a short-hold encoder left, so the router must use it.
    short = await stack.add_encoder(env={"PHALANX_ENCODER_HOLD_S": str(HOLD_S)})
    for encoder in [e for e in stack.encoders if e is not short]:
        encoder.terminate(timeout=20)
        stack.encoders.remove(encoder)
    await asyncio.sleep(1.5)  # the router sees the terminated encoders' keys go
    router = stack.routers[0]
    image = _png(60)
    expected = _in_process(image, "Look: ", " What is it?")
    assert await _tokens(router.address, _request("Look: <media> What is it?", image)) == expected
    encoded = short.metric("phalanx_encoder_items_total", modality="image", result="ok")
    await asyncio.sleep(HOLD_S + 0.5)
    # Past the hold time the router's handles are stale too: the repeat is encoded again, with the same tokens.
    assert await _tokens(router.address, _request("Look: <media> What is it?", image)) == expected
    assert short.metric("phalanx_encoder_items_total", modality="image", result="ok") == encoded + 1

    # The same at the wire: a key past its hold time is NOT_FOUND at the encoder, and a worker given it refuses the
    # request with FAILED_PRECONDITION on media.source (the router's cue to encode again), submitting nothing.
    async with grpc.aio.insecure_channel(short.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        reply = await stub.Encode(encoder_pb2.EncodeRequest(
            items=[encoder_pb2.MediaItem(modality=encoder_pb2.MODALITY_IMAGE, data=image)], deliver=True), timeout=60)
        (embedding,) = reply.embeddings
        assert (embedding.data, reply.hold_s, bool(reply.channel_endpoint)) == (b"", HOLD_S, True)
        assert len(b"".join([c.data async for c in stub.FetchEmbeddings(encoder_pb2.FetchEmbeddingsRequest(keys=[embedding.key]))])) == ROWS_BYTES
        await asyncio.sleep(HOLD_S + 0.8)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            [c async for c in stub.FetchEmbeddings(encoder_pb2.FetchEmbeddingsRequest(keys=[embedding.key]))]
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert short.metric("phalanx_encoder_held_results") == 0
    media = common_pb2.MediaEmbedding(
        start=1, rows=embedding.rows, hidden=embedding.hidden, dtype=embedding.dtype, media_hash=embedding.media_hash,
        source=common_pb2.MediaSource(encoder_address=short.address, channel_endpoint=reply.channel_endpoint, key=embedding.key),
    )
    request = worker_pb2.GenerateRequest(
        request_id="expired-media", tokens=common_pb2.PromptTokens(ids=[1] + [0] * embedding.rows + [2]), media=[media],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    async with grpc.aio.insecure_channel(stack.workers[0].address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [c async for c in worker_pb2_grpc.WorkerServiceStub(channel).Generate(request, timeout=60)]
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    status = rpc_status.from_call(refused.value)
    failure = error_details_pb2.PreconditionFailure()
    assert status is not None and any(d.Unpack(failure) for d in status.details if d.Is(failure.DESCRIPTOR))
    assert [v.subject for v in failure.violations] == [MEDIA_SOURCE_SUBJECT]


def _png(seed: int) -> bytes:
    return png(1000 + seed)
