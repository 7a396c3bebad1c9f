"""The checkpoint store's open sockets come back to their baseline after the workers it restored into are SIGKILLed.

A soak showed the store's sockets growing by about one per killed worker: a channel the store keeps for the next
restore into a worker (ChannelEndpoint.keep) outlived that worker, its sockets in CLOSE-WAIT, until the store's next
keep or reuse, which a quiet store may never make. The endpoint now sweeps its kept channels: one whose peer's
advertisement left etcd (the lease lapsed) is closed.
"""

import asyncio
import os
import uuid

import grpc
import pytest

from phalanx._proto import migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.workers import parked_commit

pytestmark = pytest.mark.integration

KILLS = 2
TOKENS = 16
# Every restore over a tensor channel, which the store then keeps: the path whose sockets leaked.
CHANNELS_ALWAYS = {"PHALANX_WORKER_CHANNEL_MIN_BYTES": "0"}


def socket_fds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


@pytest.fixture
async def fleet(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        await s.add_checkpoint_store()
        await s.add_workers(1, env=CHANNELS_ALWAYS)  # the source of every restored request
        yield s
    finally:
        await asyncio.to_thread(s.stop)


async def restore_into(store, source, target, request_id: str) -> None:
    """A request generated on ``source``, committed in the store, parked, and restored into ``target`` from the store."""
    commit = await parked_commit(store, source, request_id, TOKENS, commit_timeout_s=30)
    item = migration_pb2.RestoreItem(state=commit.state, seed=commit.seed, method=migration_pb2.MIGRATION_METHOD_CHECKPOINT,
                                     kv_tokens=commit.kv_tokens)
    item.state.request_id = request_id
    reply = await target.Restore(worker_pb2.RestoreRequest(items=[item], kv_source_address=store.address, timeout_s=30), timeout=40)
    assert reply.results[0].ok and reply.results[0].kv_tokens == commit.kv_tokens > 0, reply
    await target.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=10)
    await source.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_store_sockets_return_to_baseline_after_the_workers_it_restored_into_are_killed(fleet):
    store = fleet.stores[0]
    pid = store.process.pid
    async with grpc.aio.insecure_channel(fleet.workers[0].address) as source_channel:
        source = worker_pb2_grpc.WorkerServiceStub(source_channel)
        baseline = None
        for kill in range(KILLS + 1):
            (target_handle,) = await fleet.add_workers(1, env=CHANNELS_ALWAYS)
            async with grpc.aio.insecure_channel(target_handle.address) as target_channel:
                target = worker_pb2_grpc.WorkerServiceStub(target_channel)
                await restore_into(store, source, target, f"leak-{kill}-{uuid.uuid4().hex[:6]}")
            kept = await asyncio.to_thread(store.metric, "phalanx_checkpoint_restores_total", transport="channel")
            assert kept == kill + 1  # over a channel, which the store keeps for the next restore into that worker
            target_handle.kill()
            fleet.workers.remove(target_handle)
            if baseline is None:
                # After one whole cycle the store's own sockets are open (gRPC, etcd, its rendezvous store, its etcd
                # client for lookups); the first dead worker's go once the sweep closed its kept channel.
                right_after = socket_fds(pid)
                baseline = await assert_eventually(lambda limit=right_after: (n := socket_fds(pid)) < limit and n, timeout=30,
                                                   message=f"the first dead worker's sockets stayed open ({right_after})")

        def settled() -> bool:
            now = socket_fds(pid)
            assert now <= baseline + 1, f"store sockets {now} after {KILLS} more dead workers, baseline {baseline}"
            return True

        # KILLS more workers died, each with a channel the store had kept: none of their sockets may stay open.
        await assert_eventually(settled, timeout=30)
