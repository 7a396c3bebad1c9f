"""WorkerService.Multiplex: many requests' tokens over one stream, with each request's Generate/Attach semantics.

A real worker process over real gRPC (a killed worker under a router's stream: test_multiplex_router.py).
"""

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.router.multiplex import WorkerMultiplexer
from phalanx.testing.workers import clear_faults, shared_worker, slow_steps, worker_stub

pytestmark = pytest.mark.integration

DETACH_GRACE_S = 1.0
CHAOS_TOKEN = "test-chaos-token-multiplex-0123456789"
ENV = {
    "PHALANX_WORKER_DETACH_GRACE_S": str(DETACH_GRACE_S),
    "PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN,
}


@pytest.fixture(scope="module")
def worker(nats_server, etcd_server):
    with shared_worker("w-multiplex", nats_server, etcd_server, env=ENV) as handle:
        yield handle


@pytest.fixture
async def stub(worker):
    async with worker_stub(worker) as stub:
        yield stub


def generate(request_id: str, text: str, max_tokens: int, **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id, text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    )


class Mux:
    """A Multiplex call driven by hand: open and close subscriptions, read what each got."""

    def __init__(self, stub) -> None:
        self.call = stub.Multiplex()
        self.chunks: dict[int, list[worker_pb2.MultiplexChunk]] = {}
        self.responses = 0

    async def open(self, subscription_id: int, **action) -> None:
        await self.call.write(worker_pb2.MultiplexRequest(subscription_id=subscription_id, **action))

    async def close(self, subscription_id: int) -> None:
        await self.call.write(worker_pb2.MultiplexRequest(subscription_id=subscription_id, close=worker_pb2.MultiplexClose()))

    async def read_until(self, done) -> None:
        while not done():
            response = await self.call.read()
            assert response is not grpc.aio.EOF
            self.responses += 1
            for chunk in response.chunks:
                self.chunks.setdefault(chunk.subscription_id, []).append(chunk)

    def closed(self, subscription_id: int) -> bool:
        return any(c.closed for c in self.chunks.get(subscription_id, ()))

    def tokens(self, subscription_id: int) -> list[worker_pb2.GenerateResponse]:
        return [c.response for c in self.chunks.get(subscription_id, ()) if c.HasField("response") and c.response.index >= 0]


async def reference(stub, request: worker_pb2.GenerateRequest) -> list[tuple[int, int]]:
    return [(c.index, c.token_id) async for c in stub.Generate(request) if c.index >= 0]


async def test_one_stream_carries_many_requests_in_few_messages_each_token_once(worker, stub):
    texts = [f"multiplexed request {i}" for i in range(6)]
    expected = [await reference(stub, generate(f"mux-ref-{i}", t, 24)) for i, t in enumerate(texts)]
    # Steps held 0.05 s: the six admissions overlap on a loaded box too (in CI the first requests
    # had run half their steps alone before the last was admitted: 79 messages for 144 tokens).
    await slow_steps([worker], 0.05, CHAOS_TOKEN)
    try:
        mux = Mux(stub)
        for i, text in enumerate(texts):
            await mux.open(i + 1, generate=generate(f"mux-{i}", text, 24))
        await mux.read_until(lambda: all(mux.closed(i + 1) for i in range(len(texts))))
    finally:
        await clear_faults([worker], CHAOS_TOKEN)
    for i in range(len(texts)):
        assert [(c.index, c.token_id) for c in mux.tokens(i + 1)] == expected[i], "the same tokens as its own Generate, once each"
        last = mux.chunks[i + 1][-1]
        assert last.closed and last.code == 0 and last.response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert all(c.response.request_id == f"mux-{i}" for c in mux.chunks[i + 1])
    # One message per engine step for all six, not one per token and request.
    assert mux.responses < sum(len(e) for e in expected) / 2
    mux.call.cancel()


async def test_after_a_broken_stream_a_new_one_attaches_from_the_next_index_exactly_once(stub):
    text = "resume me over a new multiplexed stream"
    expected = await reference(stub, generate("mux-broken-ref", text, 60))
    first = Mux(stub)
    await first.open(7, generate=generate("mux-broken", text, 60))
    await first.read_until(lambda: len(first.tokens(7)) >= 5)
    first.call.cancel()  # the router died: the request runs on, detached
    head = first.tokens(7)
    second = Mux(stub)
    await second.open(1, attach=worker_pb2.AttachRequest(request_id="mux-broken", from_index=len(head)))
    await second.read_until(lambda: second.closed(1))
    tail = second.tokens(1)
    assert [(c.index, c.token_id) for c in head + tail] == expected, "every token exactly once across the reconnect"
    second.call.cancel()


async def test_cancel_ends_the_subscription_with_aborted_and_a_closed_one_detaches(stub):
    mux = Mux(stub)
    await mux.open(1, generate=generate("mux-cancel", "cancel me", 1500))
    await mux.open(2, generate=generate("mux-close", "leave me", 1500))
    await mux.read_until(lambda: len(mux.tokens(1)) >= 2 and len(mux.tokens(2)) >= 2)
    assert (await stub.Cancel(worker_pb2.CancelRequest(request_id="mux-cancel"))).found
    await mux.close(2)
    await mux.read_until(lambda: mux.closed(1))
    end = mux.chunks[1][-1]
    assert end.code == 0 and end.response.finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert not mux.closed(2), "a closed subscription gets nothing more"
    # Nobody reads mux-close now: after the detach grace the worker aborts it, as it would after a dropped call.
    await asyncio.sleep(DETACH_GRACE_S + 1.0)
    tail = [c async for c in stub.Attach(worker_pb2.AttachRequest(request_id="mux-close", from_index=0))]
    assert tail[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert len([c for c in tail if c.index >= 0]) < 1500
    mux.call.cancel()


async def test_a_subscription_ends_with_the_status_its_own_call_would_have(stub):
    mux = Mux(stub)
    await mux.open(1, attach=worker_pb2.AttachRequest(request_id="never-here", from_index=0))
    await mux.open(2, generate=generate("mux-bad", "bad sampling", 8, temperature=-1.0))
    await mux.open(3, generate=generate("mux-fine", "next to the bad ones", 4))
    await mux.read_until(lambda: all(mux.closed(i) for i in (1, 2, 3)))
    [missing], [bad] = mux.chunks[1], mux.chunks[2]
    assert missing.code == grpc.StatusCode.NOT_FOUND.value[0] and "never-here" in missing.message
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # The details are the google.rpc.Status its call's trailers would have carried.
    details = status_pb2.Status.FromString(bad.status_details)
    violation = error_details_pb2.BadRequest()
    assert any(d.Unpack(violation) for d in details.details)
    assert any("temperature" in v.field for v in violation.field_violations)
    assert [c.response.index for c in mux.chunks[3] if c.response.index >= 0] == [0, 1, 2, 3]
    mux.call.cancel()


async def test_the_routers_side_subscribes_again_after_its_stream_breaks_and_yields_each_token_once(worker, stub):
    text = "break the router's multiplexed stream"
    expected = await reference(stub, generate("mux-again-ref", text, 60))
    async with grpc.aio.insecure_channel(worker.address) as channel:
        multiplexer = WorkerMultiplexer(worker_pb2_grpc.WorkerServiceStub(channel), worker.address)
        calls = [multiplexer.generate(generate("mux-again", text, 60)), multiplexer.generate(generate("mux-again-2", text, 60))]
        got: list[list] = [[], []]
        broken = None
        async for chunk in calls[0]:
            got[0].append(chunk)
            if len(got[0]) == 5:
                broken = multiplexer._stream  # a reset of the stream alone (the worker lives on)
                broken.call.cancel()
        got[1] = [c async for c in calls[1]]
        assert multiplexer._stream is not broken, "a new stream"
        await multiplexer.close()
    for chunks in got:
        assert [(c.index, c.token_id) for c in chunks if c.index >= 0] == expected, "every token once across the break"
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
