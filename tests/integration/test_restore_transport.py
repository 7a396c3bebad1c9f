"""How a worker fetches a restored request's KV from the checkpoint store: gRPC while no tensor channel is formed,
then the channel it forms meanwhile."""

import asyncio
import uuid

import grpc
import pytest

from phalanx._proto import common_pb2, migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

TOKENS = 24


@pytest.fixture
async def fleet(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        await s.add_checkpoint_store()
        await s.add_workers(2)  # the default PHALANX_WORKER_CHANNEL_MIN_BYTES: this model's KV is far below it
        yield s
    finally:
        await asyncio.to_thread(s.stop)


async def parked_commit(store, source, request_id: str):
    """A request generated on `source` to TOKENS tokens and parked there, and the store's commit of it."""
    call = source.Generate(worker_pb2.GenerateRequest(
        request_id=request_id, tokens=common_pb2.PromptTokens(ids=list(range(40, 90))),
        sampling=common_pb2.SamplingParams(max_tokens=TOKENS + 200, ignore_eos=True),
    ), timeout=60)
    async for chunk in call:
        if chunk.index >= TOKENS - 1:
            break
    call.cancel()  # the request runs on while its commit catches up

    async def committed():
        try:
            return (await store.get_commit(request_id)).last_index >= TOKENS - 1
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return False

    await assert_eventually(committed, timeout=20)
    assert (await source.Park(worker_pb2.ParkRequest(request_ids=[request_id], ttl_s=30), timeout=10)).parked
    return await store.get_commit(request_id)


async def test_small_kv_comes_over_grpc_first_and_over_the_channel_formed_meanwhile_next(fleet):
    store = fleet.stores[0]
    transports = []
    async with grpc.aio.insecure_channel(fleet.workers[0].address) as a, grpc.aio.insecure_channel(fleet.workers[1].address) as b:
        source, target = worker_pb2_grpc.WorkerServiceStub(a), worker_pb2_grpc.WorkerServiceStub(b)
        for _ in range(2):
            request_id = f"restore-{uuid.uuid4().hex[:8]}"
            commit = await parked_commit(store, source, request_id)
            item = migration_pb2.RestoreItem(
                state=commit.state, seed=commit.seed, method=migration_pb2.MIGRATION_METHOD_CHECKPOINT, kv_tokens=commit.kv_tokens
            )
            item.state.request_id = request_id
            reply = await target.Restore(worker_pb2.RestoreRequest(items=[item], kv_source_address=store.address, timeout_s=20), timeout=30)
            assert reply.results[0].ok and reply.results[0].kv_tokens == commit.kv_tokens > 0, reply
            await target.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=10)
            await source.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=10)
            transports.append(
                {t: await asyncio.to_thread(store.metric, "phalanx_checkpoint_restores_total", transport=t) or 0 for t in ("grpc", "channel")}
            )
    assert transports == [{"grpc": 1, "channel": 0}, {"grpc": 1, "channel": 1}], transports
