"""How a worker fetches a restored request's KV from the checkpoint store: gRPC while no tensor channel is formed,
then the channel it forms meanwhile."""

import asyncio
import uuid

import grpc
import pytest

from phalanx._proto import migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.launch.stack import Stack
from phalanx.testing.workers import parked_commit

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


@pytest.mark.slow
async def test_small_kv_comes_over_grpc_first_and_over_the_channel_formed_meanwhile_next(fleet):
    store = fleet.stores[0]
    transports = []
    async with grpc.aio.insecure_channel(fleet.workers[0].address) as a, grpc.aio.insecure_channel(fleet.workers[1].address) as b:
        source, target = worker_pb2_grpc.WorkerServiceStub(a), worker_pb2_grpc.WorkerServiceStub(b)
        for _ in range(2):
            request_id = f"restore-{uuid.uuid4().hex[:8]}"
            commit = await parked_commit(store, source, request_id, TOKENS, commit_timeout_s=20)
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
