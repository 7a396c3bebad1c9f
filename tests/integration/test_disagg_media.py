"""Disaggregated prefill and decode with real processes: an image request, and a decode worker without KV room.

One stack for the module: two encoders, a prefill worker, a decode worker with a KV cache of only `DECODE_BLOCKS` blocks,
and two routers that send every prompt of 16 tokens or more to the prefill worker (PHALANX_ROUTER_DISAGG_MODE=always),
one delivering the embeddings encoder -> worker (direct, the default) and one through itself (inline). Every stream
must carry each index exactly once and the greedy tokens of an aggregated run (an encoder and an engine in this
process, on the same model with the same batch-invariant numerics).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

import phalanx.model
from phalanx._proto import chaos_pb2, chaos_pb2_grpc, router_pb2_grpc
from phalanx.client import Client, Media
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.launch.topology import WorkerRole
from phalanx.model.sampling import SamplingParams
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.multimodal import MODEL, image_request, in_process_tokens, png
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = pytest.mark.integration

MAX_TOKENS = 10
CHAOS_TOKEN = "test-chaos-token-disagg-media-0123"
AUTH = [("authorization", f"Bearer {CHAOS_TOKEN}")]
# 8 blocks of 16 tokens: room for the blocker below (77 prompt tokens, 5 blocks once restored, 7 at its end) or for the
# refused image request (47 prompt tokens, 4 blocks once restored), not for both.
DECODE_BLOCKS = 8
DECODE_ENV = {
    "PHALANX_ENGINE_NUM_KV_BLOCKS": str(DECODE_BLOCKS), "PHALANX_ENGINE_MAX_MODEL_LEN": str(DECODE_BLOCKS * 16),
    "PHALANX_WORKER_CHANNEL_MIN_BYTES": "0",  # KV over tensor channels
    "PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN,
}
ROUTER_ENV = {
    "PHALANX_ROUTER_DISAGG_MODE": "always", "PHALANX_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "16",
    "PHALANX_ROUTER_DISAGG_TRANSFER_TIMEOUT_S": "10",
    # The refusal test slows its decode worker to a step a second: SLO admission, which judges that worker by the token gaps
    # it relayed, could then hold or refuse the request whose hand-over the test is about (on a busy box, now and then).
    "PHALANX_ROUTER_ADMISSION": "off",
}
BLOCKER = "The blocker holds the decode worker's cache for a while now. " + "x" * 15  # 77 tokens with BOS
BLOCKER_TOKENS = 32
REFUSED = "Refused at first: "  # and an image: 19 + 16 + 12 tokens
# The module's workers and routers by role.
ROLES: dict[str, str] = {}
ROUTERS: dict[str, str] = {}


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    nats_server.start()
    etcd_server.start()
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start():
        *_, (prefill,), (decode,) = await asyncio.gather(
            s.add_encoder(), s.add_encoder(), s.add_workers(1, *WorkerRole.PREFILL.flags),
            s.add_workers(1, *WorkerRole.DECODE.flags, env=DECODE_ENV),
        )
        ROLES["prefill"], ROLES["decode"] = prefill.worker_id, decode.worker_id
        direct, inline = await asyncio.gather(
            s.add_router(env=ROUTER_ENV), s.add_router(env={**ROUTER_ENV, "PHALANX_ROUTER_MEDIA_DELIVERY": "inline"})
        )
        ROUTERS["direct"], ROUTERS["inline"] = direct.address, inline.address

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()


def aggregated(prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens of a text prompt on one aggregated engine (what a fleet without prefill workers streams)."""
    model = phalanx.model.load(MODEL, dtype=EngineConfig().torch_dtype())  # the dtype the workers compute in
    engine = Engine(model, EngineConfig(deterministic=True))
    engine.add_request(EngineRequest(model.tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), "r"))
    out = []
    while engine.has_work():
        out.extend(e.token_id for e in engine.step() if e.index >= 0)
    return out


def worker(stack: Stack, role: str):
    return next(w for w in stack.workers if w.worker_id == ROLES[role])


def metric(handle, name: str, **labels: str) -> float:
    return handle.metric(name, **labels) or 0.0


def router(stack: Stack, delivery: str):
    return next(r for r in stack.routers if r.address == ROUTERS[delivery])


def assert_exactly_once(chunks: list, expected: list[int]) -> None:
    assert [c.index for c in chunks] == list(range(len(expected))), [c.index for c in chunks]
    assert [c.token_id for c in chunks] == expected, "differs from the aggregated run"


@pytest.mark.parametrize(("delivery", "seed"), [("direct", 11), ("inline", 12)])
async def test_an_image_request_is_encoded_prefilled_on_the_prefill_worker_and_decoded_with_its_kv(stack, delivery, seed):
    prefill, decode, routed = worker(stack, "prefill"), worker(stack, "decode"), router(stack, delivery)
    image = png(seed)  # an image no worker has seen: its blocks are cached nowhere
    expected = await asyncio.to_thread(in_process_tokens, image, "Look: ", " What is it?", MAX_TOKENS)
    ok = metric(routed, "phalanx_router_disagg_transfers_total", outcome="ok")
    fetched = [metric(w, "phalanx_worker_media_fetch_bytes_total") for w in (prefill, decode)]
    async with grpc.aio.insecure_channel(routed.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        chunks = [c async for c in stub.Generate(image_request("Look: <media> What is it?", image, MAX_TOKENS), timeout=120)]
    assert_exactly_once(chunks, expected)
    # The first token from the prefill worker, which computed the image's positions; the rest from the decode worker,
    # which got the KV that holds them (a chunk names its worker when it changes).
    assert [c.worker_id for c in chunks if c.worker_id] == [prefill.worker_id, decode.worker_id] and chunks[1].worker_id
    assert metric(routed, "phalanx_router_disagg_transfers_total", outcome="ok") == ok + 1
    assert metric(routed, "phalanx_router_disagg_prefills_total", where="remote") >= 1
    now = [metric(w, "phalanx_worker_media_fetch_bytes_total") for w in (prefill, decode)]
    if delivery == "direct":
        # Both workers fetched the rows from the encoder (the decode worker for its Restore); the router held none.
        assert now[0] > fetched[0] and now[1] > fetched[1]
        assert metric(routed, "phalanx_router_media_inline_bytes_total") == 0
    else:
        assert now == fetched and metric(routed, "phalanx_router_media_inline_bytes_total") > 0


async def test_a_prefill_worker_that_cannot_fetch_the_rows_gets_them_inline_and_still_hands_over(stack):
    prefill, decode, routed = worker(stack, "prefill"), worker(stack, "decode"), router(stack, "direct")
    image = png(13)
    encoded = {e.name: metric(e, "phalanx_encoder_items_total", modality="image", result="ok") for e in stack.encoders}

    async def tokens(before: str) -> list:
        async with grpc.aio.insecure_channel(routed.address) as channel:
            request = image_request(f"{before}<media> What is it?", image, MAX_TOKENS)
            return [c async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=120)]

    assert [c.token_id for c in await tokens("Look: ")] == await asyncio.to_thread(in_process_tokens, image, "Look: ", " What is it?", MAX_TOKENS)
    # The router keeps the handles for a repeat of the image; the encoder holding its rows dies before that repeat's fetch.
    holder = next(e for e in stack.encoders if metric(e, "phalanx_encoder_items_total", modality="image", result="ok") > encoded[e.name])
    holder.kill()
    stack.encoders.remove(holder)
    failures, reencodes = metric(prefill, "phalanx_worker_media_fetch_failures_total"), metric(
        routed, "phalanx_router_media_reencodes_total", cause="fetch_failed"
    )
    ok = metric(routed, "phalanx_router_disagg_transfers_total", outcome="ok")
    # Other text before the image: no block of it is cached on the decode worker, so it prefills remotely again.
    chunks = await tokens("See this: ")
    assert_exactly_once(chunks, await asyncio.to_thread(in_process_tokens, image, "See this: ", " What is it?", MAX_TOKENS))
    assert metric(prefill, "phalanx_worker_media_fetch_failures_total") == failures + 1
    assert metric(routed, "phalanx_router_media_reencodes_total", cause="fetch_failed") == reencodes + 1
    # Encoded again, inline, it prefilled on the same prefill worker and its KV moved to the decode worker.
    assert [c.worker_id for c in chunks if c.worker_id] == [prefill.worker_id, decode.worker_id] and chunks[1].worker_id
    assert metric(routed, "phalanx_router_disagg_transfers_total", outcome="ok") == ok + 1


@contextlib.asynccontextmanager
async def chaos(address: str):
    """The worker's ChaosService; every fault it injected is cleared on the way out."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = chaos_pb2_grpc.ChaosServiceStub(channel)
        try:
            yield stub
        finally:
            await stub.ClearFaults(chaos_pb2.ClearFaultsRequest(), metadata=AUTH, timeout=10)


async def test_a_decode_worker_without_kv_room_refuses_the_hand_over_before_any_kv_moves(stack):
    prefill, decode, routed = worker(stack, "prefill"), worker(stack, "decode"), router(stack, "direct")
    expected_blocker = await asyncio.to_thread(aggregated, BLOCKER, BLOCKER_TOKENS)
    image = png(14)
    expected = await asyncio.to_thread(in_process_tokens, image, REFUSED, " What is it?", MAX_TOKENS)
    outcomes = {o: metric(routed, "phalanx_router_disagg_transfers_total", outcome=o) for o in ("ok", "refused")}
    moved = metric(routed, "phalanx_router_disagg_transferred_bytes_total")
    sent = metric(prefill, "phalanx_worker_kv_sent_bytes_total")
    restores = metric(decode, "phalanx_worker_restores_total")
    fetched = [metric(w, "phalanx_worker_media_fetch_bytes_total") for w in (prefill, decode)]
    async with await Client.connect(routed.address, timeout=120) as client, chaos(decode.address) as faults:

        async def idle() -> bool:
            return any(w.worker_id == decode.worker_id and w.free_blocks == DECODE_BLOCKS for w in await client.list_workers())

        # The router's last word from the decode worker says every block is free, and it hears no more: its view lags
        # the worker's cache, as it may whenever load reports are in flight.
        await assert_eventually(idle, timeout=10)
        await faults.InjectFault(chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_DROP_NATS), metadata=AUTH, timeout=10)
        blocker: list = []
        decoding = asyncio.Event()

        async def block() -> None:
            async for chunk in client.generate(BLOCKER, max_tokens=BLOCKER_TOKENS, ignore_eos=True):
                blocker.append(chunk)
                if chunk.index >= 1 and chunk.worker_id == decode.worker_id:
                    decoding.set()

        blocking = asyncio.create_task(block())
        await asyncio.wait_for(decoding.wait(), 60)  # handed over: its blocks are taken on the decode worker
        # Slowed, it keeps them while the next request is prefilled and handed over.
        slow = chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_SLOW, slow_step_s=1.0)
        await faults.InjectFault(slow, metadata=AUTH, timeout=10)

        async def refused_stream() -> list:
            media = [Media("image", image)]
            return [c async for c in client.generate(f"{REFUSED}<media> What is it?", media=media, max_tokens=MAX_TOKENS, ignore_eos=True)]

        refused = asyncio.create_task(refused_stream())

        async def was_refused() -> bool:
            if refused.done():
                refused.result()  # a stream that failed before its hand-over fails the test with its own error
            return await asyncio.to_thread(metric, routed, "phalanx_router_disagg_transfers_total", outcome="refused") == outcomes["refused"] + 1

        await assert_eventually(was_refused, timeout=30, interval=0.2)
        await faults.ClearFaults(chaos_pb2.ClearFaultsRequest(), metadata=AUTH, timeout=10)
        await blocking
        chunks = await refused
    assert_exactly_once(blocker, expected_blocker)
    assert_exactly_once(chunks, expected)
    # Its first token from the prefill worker; refused, it prefilled again on the decode worker from there on.
    assert chunks[0].worker_id == prefill.worker_id and {c.worker_id for c in chunks[1:]} == {decode.worker_id}
    # Only the blocker's KV moved: the refusal came before any byte of the refused request's.
    assert metric(routed, "phalanx_router_disagg_transfers_total", outcome="ok") == outcomes["ok"] + 1
    assert metric(decode, "phalanx_worker_restores_total") == restores + 1
    moved_now, sent_now = metric(routed, "phalanx_router_disagg_transferred_bytes_total"), metric(prefill, "phalanx_worker_kv_sent_bytes_total")
    assert moved_now > moved and sent_now - sent == moved_now - moved
    # Nor did it fetch the image's rows for the refused Restore: each worker fetched them once, the decode worker for
    # the prefill again.
    now = [metric(w, "phalanx_worker_media_fetch_bytes_total") for w in (prefill, decode)]
    assert now[0] - fetched[0] == now[1] - fetched[1] > 0
