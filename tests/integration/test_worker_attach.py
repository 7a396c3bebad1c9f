"""A worker's requests outlive their streams: Attach, idempotent Generate, Cancel, the detach grace."""

import asyncio

import grpc
import pytest

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.launch.services import start_worker
from phalanx.model import ByteTokenizer
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.workers import shared_worker, worker_stub

pytestmark = pytest.mark.integration

DETACH_GRACE_S = 1.0
LONG = 1500  # tokens: several seconds of generation, far longer than the grace


@pytest.fixture(scope="module")
def worker(nats_server, etcd_server):
    with shared_worker("w-attach", nats_server, etcd_server, env={"PHALANX_WORKER_DETACH_GRACE_S": str(DETACH_GRACE_S)}) as handle:
        yield handle


@pytest.fixture
async def stub(worker):
    async with worker_stub(worker) as stub:
        yield stub


def request(request_id: str, text: str = "Hello, Phalanx", max_tokens: int = 8) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id, text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


async def collect(call) -> list:
    """The rest of a stream (read() rather than iteration, so a call already read from can be finished)."""
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


async def read_then_break(call, k: int) -> list:
    """Reads k chunks, then drops the stream as a dying router would."""
    chunks = [await call.read() for _ in range(k)]
    call.cancel()
    return chunks


async def stats(stub) -> worker_pb2.StatsResponse:
    return await stub.Stats(worker_pb2.StatsRequest())


async def test_attach_after_a_broken_stream_delivers_exactly_the_remaining_tokens(stub):
    text = "resume me after the router dies"
    reference = await collect(stub.Generate(request("attach-ref", text, 40)))
    head = await read_then_break(stub.Generate(request("attach-broken", text, 40)), 7)
    tail = await collect(stub.Attach(worker_pb2.AttachRequest(request_id="attach-broken", from_index=7)))
    assert [c.index for c in head + tail] == list(range(40)), "every token exactly once"
    assert [c.token_id for c in head + tail] == [c.token_id for c in reference]
    assert "".join(c.text for c in head + tail) == "".join(c.text for c in reference)
    assert tail[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(c.request_id == "attach-broken" for c in tail)


async def test_attach_to_a_finished_request_returns_the_tail_from_its_index(stub):
    full = await collect(stub.Generate(request("finished", max_tokens=8)))
    tail = await collect(stub.Attach(worker_pb2.AttachRequest(request_id="finished", from_index=3)))
    assert [(c.index, c.token_id) for c in tail] == [(c.index, c.token_id) for c in full[3:]]
    assert tail[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # A caller that has every token still learns how the request ended.
    [end] = await collect(stub.Attach(worker_pb2.AttachRequest(request_id="finished", from_index=8)))
    assert (end.index, end.token_id, end.finish_reason) == (-1, -1, common_pb2.FINISH_REASON_LENGTH)


async def test_attach_to_an_unknown_request_is_not_found_and_a_negative_index_is_invalid(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub.Attach(worker_pb2.AttachRequest(request_id="never-seen", from_index=0)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    await collect(stub.Generate(request("short", max_tokens=2)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub.Attach(worker_pb2.AttachRequest(request_id="short", from_index=-1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub.Attach(worker_pb2.AttachRequest(request_id="short", from_index=5)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_attach_ahead_of_the_request_waits_for_that_index(stub):
    call = stub.Generate(request("ahead", "a prompt to run ahead of", 30))
    first = await call.read()
    tail = await collect(stub.Attach(worker_pb2.AttachRequest(request_id="ahead", from_index=20)))
    rest = await collect(call)
    assert [c.index for c in tail] == list(range(20, 30))
    assert [c.token_id for c in tail] == [c.token_id for c in ([first] + rest)[20:]]


async def test_generate_twice_with_the_same_request_id_streams_it_without_running_it_again(stub):
    text = "idempotent retry of the same request"
    prompt_len = len(ByteTokenizer().encode(text))
    before = await stats(stub)
    a, b = await asyncio.gather(
        collect(stub.Generate(request("twice", text, 24))), collect(stub.Generate(request("twice", text, 24)))
    )
    broken = await read_then_break(stub.Generate(request("twice", text, 24)), 3)
    after_finish = await collect(stub.Generate(request("twice", text, 24)))
    after = await stats(stub)
    tokens = [c.token_id for c in a]
    assert len(tokens) == 24 and [c.token_id for c in b] == tokens == [c.token_id for c in after_finish]
    assert [c.index for c in after_finish] == list(range(24)), "a retry streams from index 0"
    assert [c.token_id for c in broken] == tokens[:3]
    assert after.generated_tokens_total - before.generated_tokens_total == 24
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_len


async def test_cancel_stops_a_running_request_and_ends_its_stream_aborted(stub):
    before = await stats(stub)
    call = stub.Generate(request("cancel-me", "a long generation to cancel", LONG))
    await call.read()
    assert (await stub.Cancel(worker_pb2.CancelRequest(request_id="cancel-me"))).found
    rest = await collect(call)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert rest[-1].index == -1

    async def stopped():
        s = await stats(stub)
        return s.running_seqs == 0 and s.queue_depth == 0 and s

    after = await assert_eventually(stopped, timeout=5)
    assert after.generated_tokens_total - before.generated_tokens_total < LONG
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub.Attach(worker_pb2.AttachRequest(request_id="cancel-me", from_index=0)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, "a cancelled request is forgotten"
    assert not (await stub.Cancel(worker_pb2.CancelRequest(request_id="cancel-me"))).found


async def test_detached_request_runs_through_the_grace_then_is_aborted(stub):
    await read_then_break(stub.Generate(request("detached", "nobody comes back for this one", LONG)), 2)
    assert (await stats(stub)).running_seqs == 1, "a broken stream does not stop the request"

    async def aborted():
        return (await stats(stub)).running_seqs == 0

    await assert_eventually(aborted, timeout=DETACH_GRACE_S + 4)
    # Kept a while: a router that comes back late learns what happened.
    chunks = await collect(stub.Attach(worker_pb2.AttachRequest(request_id="detached", from_index=0)))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert [c.index for c in chunks[:-1]] == list(range(len(chunks) - 1))
    assert 2 <= len(chunks) - 1 < LONG


async def test_sigterm_with_a_detached_request_exits_promptly_and_cleanly(nats_server, etcd_config, capfd):
    env = {"PHALANX_WORKER_DETACH_GRACE_S": "60", "PHALANX_WORKER_DRAIN_GRACE_S": "0.3"}
    handle = await start_worker("w-attach-term", nats_server.url, etcd_config, env=env, model="phalanx-tiny-moe")
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            await read_then_break(stub.Generate(request("orphan", "a long generation nobody reads", LONG)), 2)
            assert (await stats(stub)).running_seqs == 1
        handle.process.send_signal(15)
        assert await asyncio.to_thread(handle.process.wait, 15) == 0
    finally:
        handle.kill()
    err = capfd.readouterr().err
    assert "Task was destroyed" not in err and "Traceback" not in err
