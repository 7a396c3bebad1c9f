"""Tensor-parallel worker groups: one worker to the system, one failure domain, migrated in lockstep.

Real processes throughout: TP=2 workers (a leader and its follower rank),
a router, the checkpoint store and the migration service on real NATS and
etcd, in deterministic mode.
"""

import asyncio
import collections
import os
import signal

import grpc
import pytest

from phalanx._proto import worker_pb2, worker_pb2_grpc
from phalanx.client import Client
from phalanx.common.discovery import WorkerDirectory
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.worker.tp_leader import FAILURE_EXIT_CODE

pytestmark = pytest.mark.integration

STREAMS = 8
MAX_TOKENS = 40
# ~150 tokens each, so that restoring KV from the store beats recomputing it.
PROMPTS = [f"Group {i}: the ferryman number {i} counts the lanterns on the river before the long winter storm. " * 2 for i in range(STREAMS)]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def run_streams(client: Client, prompts, on_chunk=None) -> dict[int, list]:
    async def one(i: int) -> list:
        chunks = []
        async for chunk in client.generate(prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True):
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(i, chunk)
        return chunks

    return dict(enumerate(await asyncio.gather(*(one(i) for i in range(len(prompts))))))


def tokens(results: dict[int, list]) -> dict[int, list[int]]:
    return {i: [c.token_id for c in chunks] for i, chunks in results.items()}


async def metric(handle, name: str, **labels) -> float:
    return await asyncio.to_thread(handle.metric, name, **labels) or 0.0


@pytest.fixture
async def stack(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        yield s
    finally:
        await asyncio.to_thread(s.stop)


@pytest.mark.slow
async def test_sigkill_of_a_follower_rank_fail_stops_the_group_and_its_streams_continue_identically(stack):
    await stack.add_checkpoint_store()
    await stack.add_migration()
    await stack.add_workers(2, tensor_parallel_size=2)
    router = await stack.add_router()
    followers = {w.worker_id: w.follower_pids() for w in stack.workers}
    assert all(len(pids) == 1 for pids in followers.values()), followers
    async with await Client.connect(router.address, timeout=60) as client:
        baseline = tokens(await run_streams(client, PROMPTS))

        served_by: dict[int, str] = {}
        progress = collections.Counter()
        killed: list = []

        def kill_a_follower_of_the_busiest_group_mid_generation(i: int, chunk) -> None:
            served_by.setdefault(i, chunk.worker_id)
            progress[i] += 1
            if killed or len(served_by) < STREAMS or min(progress.values()) < 6:
                return
            busiest = collections.Counter(served_by.values()).most_common(1)[0][0]
            victim = next(w for w in stack.workers if w.worker_id == busiest)
            os.kill(followers[busiest][0], signal.SIGKILL)
            killed.append(victim)

        results = await run_streams(client, PROMPTS, kill_a_follower_of_the_busiest_group_mid_generation)
    (victim,) = killed
    moved = [i for i, w in served_by.items() if w == victim.worker_id]
    assert moved
    for i, chunks in results.items():
        assert [c.index for c in chunks] == list(range(MAX_TOKENS)), f"stream {i}: indices {[c.index for c in chunks]}"
        assert [c.token_id for c in chunks] == baseline[i], f"stream {i} differs from the fault-free run"
    # The leader fail-stopped (no drain, so no transfer of half the KV heads) and left etcd.
    assert victim.process.wait(10) == FAILURE_EXIT_CODE
    survivor = next(w for w in stack.workers if w is not victim)
    assert await metric(survivor, "phalanx_worker_restores_total") >= len(moved)

    async def left_etcd():
        directory = WorkerDirectory(stack.etcd_config)
        try:
            return victim.worker_id not in await directory.list()
        finally:
            await directory.close()

    await assert_eventually(left_etcd, timeout=10, message="the failed group's leader is still registered")
    migration = stack.migrations[0]
    by_method = {m: await metric(migration, "phalanx_migration_total", method=m) for m in ("transfer", "checkpoint", "reprefill")}
    routed = await metric(router, "phalanx_router_migrations_total")
    assert routed >= len(moved) and by_method["transfer"] == 0, (routed, by_method)
    assert by_method["checkpoint"] + by_method["reprefill"] == routed, (routed, by_method)
    assert not any(alive(pid) for pid in followers[victim.worker_id]), "a rank of the failed group outlived it"
    assert all(alive(pid) for pid in followers[survivor.worker_id]), "the surviving group lost a rank"


@pytest.mark.slow
async def test_draining_a_healthy_group_transfers_the_kv_of_every_rank(stack):
    await stack.add_checkpoint_store()
    await stack.add_migration()
    await stack.add_workers(2, tensor_parallel_size=2)
    router = await stack.add_router()
    async with await Client.connect(router.address, timeout=60) as client:
        baseline = tokens(await run_streams(client, PROMPTS))
        served_by: dict[int, str] = {}
        draining: list = []

        async def drain_now(worker) -> None:
            # Grace 0: every running request is parked with its KV (gathered from both ranks) and handed back now.
            async with grpc.aio.insecure_channel(worker.address) as channel:
                await worker_pb2_grpc.WorkerServiceStub(channel).Drain(worker_pb2.DrainRequest(grace_s=0.0), timeout=10)

        def drain_the_busiest_group_mid_generation(i: int, chunk) -> None:
            served_by.setdefault(i, chunk.worker_id)
            if draining or len(served_by) < STREAMS or chunk.index < 6:
                return
            busiest = collections.Counter(served_by.values()).most_common(1)[0][0]
            victim = next(w for w in stack.workers if w.worker_id == busiest)
            draining.append(victim)
            draining.append(asyncio.ensure_future(drain_now(victim)))

        results = await run_streams(client, PROMPTS, drain_the_busiest_group_mid_generation)
        await draining[1]
    assert tokens(results) == baseline
    assert all([c.index for c in chunks] == list(range(MAX_TOKENS)) for chunks in results.values())
    assert await asyncio.to_thread(draining[0].process.wait, 20) == 0
    assert await metric(stack.migrations[0], "phalanx_migration_total", method="transfer") >= 1


async def test_tp2_greedy_output_through_the_router_equals_each_request_run_alone(stack):
    await stack.add_workers(1, tensor_parallel_size=2)
    router = await stack.add_router()
    prompts = PROMPTS[:6]
    async with await Client.connect(router.address, timeout=60) as client:
        batched = tokens(await run_streams(client, prompts))
        for i in (0, 3, 5):
            (alone,) = tokens(await run_streams(client, [prompts[i]])).values()
            assert alone == batched[i], f"request {i} changed with the batch around it"


async def test_sigterm_drains_the_group_and_every_rank_exits_cleanly(stack):
    (worker,) = await stack.add_workers(1, tensor_parallel_size=2)
    pids = worker.follower_pids()
    assert len(pids) == 1
    assert await asyncio.to_thread(worker.terminate, 20) == 0
    await assert_eventually(lambda: not any(alive(pid) for pid in pids), timeout=5, message="a follower outlived its leader")


async def test_a_hung_follower_rank_fail_stops_the_group_at_the_collective_timeout(stack):
    (worker,) = await stack.add_workers(1, tensor_parallel_size=2, env={"PHALANX_ENGINE_TENSOR_PARALLEL_TIMEOUT_S": "1"})
    router = await stack.add_router()
    (pid,) = worker.follower_pids()
    os.kill(pid, signal.SIGSTOP)  # alive but silent: only the collective's timeout can tell
    async with await Client.connect(router.address, timeout=10) as client:
        stream = asyncio.ensure_future(run_streams(client, PROMPTS[:1]))
        await assert_eventually(lambda: worker.process.poll() is not None, timeout=10, message="the leader kept serving")
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    assert worker.process.returncode == FAILURE_EXIT_CODE
    await assert_eventually(lambda: not alive(pid), timeout=5, message="the hung follower outlived its leader")
