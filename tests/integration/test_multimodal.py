"""An image request end to end: SDK-level gRPC -> router -> encoder pool -> worker, with the tokens an in-process
encoder and engine give; a second encoder takes over when the first is killed; bad media come back as INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import base64

import grpc
import pytest

import phalanx.model
from phalanx._proto import chaos_pb2, chaos_pb2_grpc, encoder_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.client import Client, Media
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EncoderDirectory
from phalanx.launch.services import start_gateway
from phalanx.launch.stack import Stack
from phalanx.router.media import EncoderSet
from phalanx.testing.multimodal import MODEL, image_request as _request, in_process_tokens as _in_process, png

pytestmark = pytest.mark.integration

DRAIN_AT_ONCE = {"PHALANX_WORKER_DRAIN_GRACE_S": "0"}
CHAOS_TOKEN = "test-chaos-token-multimodal-0123456789"
# Chaos on (behind a token): the slow-worker test holds the workers' steps back.
CHAOS = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN}
LONG = 200  # tokens: the stream still runs when its worker is stopped after the 5th


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start():
        # A checkpoint store and a migration service for the worker kill; drain grace 0: a SIGTERMed worker hands its
        # requests back at once (the handoff test).
        await asyncio.gather(s.add_checkpoint_store(), s.add_migration(), s.add_encoder(), s.add_encoder())
        await s.add_workers(2, env=DRAIN_AT_ONCE | CHAOS)
        # Overlap whenever a prefix block is uncached: the tiny encoder is too fast for the default rule to pay (the
        # overlap path is what the prefix test checks, and every other test runs through it too).
        await s.add_router(env={"PHALANX_ROUTER_MEDIA_PREFIX_OVERLAP_MIN_STEPS": "0"})

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()






async def _tokens(stack: Stack, request: router_pb2.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(stack.routers[0].address) as channel:
        return [c.token_id async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(request)]




async def _token_totals(stack: Stack) -> tuple[int, int]:
    """Prompt and generated tokens the workers counted, all together."""
    prompt = generated = 0
    for worker in stack.workers:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stats = await worker_pb2_grpc.WorkerServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
        prompt, generated = prompt + stats.prompt_tokens_total, generated + stats.generated_tokens_total
    return prompt, generated


async def test_an_image_request_gives_the_in_process_encoder_and_engine_tokens(stack):
    image = _png(1)
    got = await _tokens(stack, _request("Look: <media> What is it?", image))
    assert got == _in_process(image, "Look: ", " What is it?")
    encoded = sum(e.metric("phalanx_encoder_items_total", modality="image", result="ok") for e in stack.encoders)
    hits = stack.routers[0].metric("phalanx_router_embedding_cache_hits_total")
    # Deterministic; the repeat's embeddings come from the router's cache and its KV from the worker's prefix cache.
    assert await _tokens(stack, _request("Look: <media> What is it?", image)) == got
    assert sum(e.metric("phalanx_encoder_items_total", modality="image", result="ok") for e in stack.encoders) == encoded
    assert stack.routers[0].metric("phalanx_router_embedding_cache_hits_total") == hits + 1
    other = await _tokens(stack, _request("Look: <media> What is it?", _png(2)))
    assert other == _in_process(_png(2), "Look: ", " What is it?")
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:  # the same through the SDK
        completion = await client.complete("Look: <media> What is it?", media=[Media("image", image)], max_tokens=10, ignore_eos=True)
    assert list(completion.token_ids) == got


async def test_the_text_before_the_image_is_prefilled_while_it_is_encoded_with_the_sequential_tokens(stack):
    image = _png(4)
    before = "Here is a long description of what the picture that follows may show, in many words. " * 4 + "Look: "
    router = stack.routers[0]
    prefilled = router.metric("phalanx_router_media_prefix_prefills_total", result="ok") or 0
    counted = await _token_totals(stack)
    async with grpc.aio.insecure_channel(router.address) as channel:
        chunks = [c async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(_request(before + "<media> What is it?", image))]
    # The prefix prefill ran ahead of the request, and the workers count the request's tokens once.
    prompt_total, generated_total = await _token_totals(stack)
    assert (prompt_total - counted[0], generated_total - counted[1]) == (chunks[0].prompt_tokens, len(chunks))
    # The worker prefilled the prefix while the encoder ran: the request itself found its full blocks cached.
    prefix_tokens = len(phalanx.model.load(MODEL).tokenizer.encode(before))
    assert prefix_tokens >= 32 and chunks[0].cached_prompt_tokens == prefix_tokens // 16 * 16
    assert router.metric("phalanx_router_media_prefix_prefills_total", result="ok") == prefilled + 1
    # Greedy output identical to encoding first and prefilling the whole prompt at once.
    assert [c.token_id for c in chunks] == _in_process(image, before, " What is it?")


async def test_a_slow_workers_prefix_prefill_does_not_hold_the_request(stack):
    # A router that waits 0.2 s for a prefix once the image is encoded; both workers hold each step back 1 s.
    router = await stack.add_router(
        env={"PHALANX_ROUTER_MEDIA_PREFIX_OVERLAP_MIN_STEPS": "0", "PHALANX_ROUTER_MEDIA_PREFIX_WAIT_S": "0.2"}
    )
    image = _png(6)
    before = "A preamble that the slow worker is still computing when the image is ready. " * 3
    expected = _in_process(image, before, " What is it?", max_tokens=3)
    auth = [("authorization", f"Bearer {CHAOS_TOKEN}")]
    channels = [grpc.aio.insecure_channel(w.address) for w in stack.workers]
    chaos = [chaos_pb2_grpc.ChaosServiceStub(c) for c in channels]
    try:
        for stub in chaos:
            await stub.InjectFault(chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_SLOW, slow_step_s=1.0), metadata=auth, timeout=5)
        async with grpc.aio.insecure_channel(router.address) as channel:
            request = _request(before + "<media> What is it?", image, max_tokens=3)
            got = [c.token_id async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=60)]
    finally:
        for stub, channel in zip(chaos, channels, strict=True):
            await stub.ClearFaults(chaos_pb2.ClearFaultsRequest(), metadata=auth, timeout=5)
            await channel.close()
    # The request went without the prefix (cancelled, counted), and its tokens are the sequential run's.
    assert router.metric("phalanx_router_media_prefix_prefills_total", result="unfinished") == 1
    assert got == expected


async def test_the_openai_gateway_takes_an_image_as_a_data_url(stack):
    openai = pytest.importorskip("openai")
    gateway = await start_gateway(stack.routers[0].address, "--model", MODEL, name="gateway-mm")
    try:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:

            async def ask(image: bytes):
                url = "data:image/png;base64," + base64.b64encode(image).decode()
                content = [{"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": url}}]
                return await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0,
                )

            first, again = await ask(_png(1)), await ask(_png(1))
            with pytest.raises(openai.BadRequestError):
                await ask(b"not an image")
    finally:
        gateway.terminate()
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens == 6
    assert first.usage.prompt_tokens > 16  # the image's 16 positions and the chat template's text


async def test_bad_media_are_invalid_argument(stack):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _tokens(stack, _request("What is <media>?", b"\x89PNG\r\n\x1a\nnot really"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _tokens(stack, _request("<media> and <media>?", _png(1)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_killed_encoder_leaves_the_request_to_the_other_one(stack):
    image = _png(3)
    expected = _in_process(image, "Look: ", " What is it?")
    # Kill the encoder the router ranks first: its etcd key outlives it by the lease TTL, so the router tries it first.
    encoders = EncoderSet()
    async with EncoderDirectory(stack.etcd_config) as directory:
        for encoder_id, registration in (await directory.list()).items():
            encoders.update("put", encoder_id, registration)
    first = encoders.ranked({encoder_pb2.MODALITY_IMAGE: 1})[0].encoder_id
    next(e for e in stack.encoders if e.name == first).kill()
    retries = stack.routers[0].metric("phalanx_router_encode_retries_total")
    assert await _tokens(stack, _request("Look: <media> What is it?", image)) == expected
    assert stack.routers[0].metric("phalanx_router_encode_retries_total") == retries + 1
    assert await _tokens(stack, _request("Look: <media> What is it?", image)) == expected


async def _stream_and_stop_the_worker(stack: Stack, image: bytes, max_tokens: int, stop) -> list:
    """Chunks of one media request; after the 5th, `stop` is called with the worker serving it."""
    seen = []
    async with grpc.aio.insecure_channel(stack.routers[0].address) as channel:
        async for chunk in router_pb2_grpc.RouterServiceStub(channel).Generate(_request("Look: <media> What is it?", image, max_tokens)):
            seen.append(chunk)
            if len(seen) == 5:
                stop(next(w for w in stack.workers if w.worker_id == seen[0].worker_id))  # named on the first chunk
    return seen


def _inline(stack: Stack) -> tuple[float, float]:
    """Embedding bytes the router received from encoders, and its inline re-encodes for migrations."""
    router = stack.routers[0]
    return (router.metric("phalanx_router_media_inline_bytes_total") or 0.0,
            router.metric("phalanx_router_media_reencodes_total", cause="migration") or 0.0)


def _fetched(stack: Stack) -> dict[str, float]:
    """Media bytes each live worker fetched from encoders (direct delivery)."""
    return {
        w.worker_id: sum(w.metric("phalanx_worker_media_fetch_bytes_total", transport=t) or 0.0 for t in ("grpc", "channel"))
        for w in stack.workers if w.process.poll() is None
    }


@pytest.mark.slow
async def test_a_worker_killed_mid_media_request_is_migrated_with_its_embeddings(stack):
    image = _png(5)
    expected = _in_process(image, "Look: ", " What is it?", max_tokens=LONG)
    migrations = stack.routers[0].metric("phalanx_router_migrations_total") or 0
    inline, fetched = _inline(stack), _fetched(stack)
    seen = await _stream_and_stop_the_worker(stack, image, LONG, lambda worker: worker.kill())
    assert [c.index for c in seen] == list(range(LONG))
    assert [c.token_id for c in seen] == expected
    assert stack.routers[0].metric("phalanx_router_migrations_total") == migrations + 1
    # The target fetched the media from the encoder that still holds them: the router encoded nothing again and
    # received no row (direct delivery end to end, the migration included).
    assert _inline(stack) == inline
    grew = [w for w, n in _fetched(stack).items() if n > fetched.get(w, 0.0)]
    target = [c.worker_id for c in seen if c.worker_id][-1]  # a chunk names its worker when it changes
    assert target != seen[0].worker_id and grew == [target]  # the target, which restored the request, fetched its media


@pytest.mark.slow
async def test_a_draining_worker_hands_a_media_request_on_with_its_embeddings(stack):
    await stack.add_workers(1, env=DRAIN_AT_ONCE)  # the kill above left one
    image = _png(4)
    expected = _in_process(image, "Look: ", " What is it?", max_tokens=LONG)
    router = stack.routers[0]
    moves = (router.metric("phalanx_router_migrations_total") or 0) + (router.metric("phalanx_router_handoffs_total") or 0)
    # SIGTERM: drain and hand the request back alive; the migration service moves its KV (and its media) to another.
    seen = await _stream_and_stop_the_worker(stack, image, LONG, lambda worker: worker.process.terminate())
    assert [c.index for c in seen] == list(range(LONG))
    assert [c.token_id for c in seen] == expected
    assert router.metric("phalanx_router_migrations_total") + router.metric("phalanx_router_handoffs_total") == moves + 1


@pytest.mark.slow
async def test_a_migration_whose_encoder_died_too_encodes_the_media_again(stack):
    await asyncio.gather(stack.add_workers(1, env=DRAIN_AT_ONCE), stack.add_encoder())  # a target, and an encoder to survive
    image = _png(6)
    expected = _in_process(image, "Look: ", " What is it?", max_tokens=LONG)
    encoders = [e for e in stack.encoders if e.process.poll() is None]
    assert len(encoders) >= 2
    encoded = {e.name: e.metric("phalanx_encoder_items_total", modality="image", result="ok") or 0 for e in encoders}
    inline_bytes, reencodes = _inline(stack)

    def stop(worker) -> None:
        # The encoder holding the media dies with the worker: the target cannot fetch them, and says so; the router
        # encodes them again on the other encoder and asks the migration service once more, rows inline.
        (holder,) = [e for e in encoders if (e.metric("phalanx_encoder_items_total", modality="image", result="ok") or 0) > encoded[e.name]]
        holder.kill()
        worker.kill()

    seen = await _stream_and_stop_the_worker(stack, image, LONG, stop)
    assert [c.index for c in seen] == list(range(LONG))
    assert [c.token_id for c in seen] == expected
    now_bytes, now_reencodes = _inline(stack)
    assert now_reencodes == reencodes + 1 and now_bytes > inline_bytes


def _png(seed: int) -> bytes:
    return png(seed)
