"""One real worker shared by a test module's tests that do not kill it (a start costs about two seconds)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc

from phalanx._proto import chaos_pb2, chaos_pb2_grpc, checkpoint_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import CheckpointStoreHandle, WorkerHandle, start_worker
from phalanx.testing.asserts import assert_eventually


@contextlib.contextmanager
def shared_worker(worker_id: str, nats_server: NatsServer, etcd_server: EtcdServer, env: dict | None = None) -> Iterator[WorkerHandle]:
    """A deterministic tiny-MoE worker with a 1 s lease, for a module-scoped fixture; it must exit cleanly after."""
    config = EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)
    handle = asyncio.run(start_worker(worker_id, nats_server.url, config, "--deterministic", env=env, model="phalanx-tiny-moe"))
    yield handle
    assert handle.terminate() == 0


@contextlib.asynccontextmanager
async def worker_stub(worker: WorkerHandle) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


async def parked_commit(
    store: CheckpointStoreHandle, source: worker_pb2_grpc.WorkerServiceStub, request_id: str, tokens: int, *, commit_timeout_s: float,
) -> checkpoint_pb2.CommitRecord:
    """A request generated on ``source`` to ``tokens`` tokens and parked there, and the store's commit of it."""
    call = source.Generate(worker_pb2.GenerateRequest(
        request_id=request_id, tokens=common_pb2.PromptTokens(ids=list(range(40, 90))),
        sampling=common_pb2.SamplingParams(max_tokens=tokens + 200, ignore_eos=True),
    ), timeout=60)
    async for chunk in call:
        if chunk.index >= tokens - 1:
            break
    call.cancel()  # the request runs on while its commit catches up

    async def committed() -> bool:
        try:
            return (await store.get_commit(request_id)).last_index >= tokens - 1
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return False

    await assert_eventually(committed, timeout=commit_timeout_s)
    assert (await source.Park(worker_pb2.ParkRequest(request_ids=[request_id], ttl_s=30), timeout=10)).parked
    return await store.get_commit(request_id)


async def slow_steps(workers: list[WorkerHandle], seconds: float, chaos_token: str) -> None:
    """Holds every engine step of each worker `seconds` (the chaos SLOW fault; the workers run with chaos enabled)."""
    for worker in workers:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            await chaos_pb2_grpc.ChaosServiceStub(channel).InjectFault(
                chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_SLOW, slow_step_s=seconds),
                metadata=[("authorization", f"Bearer {chaos_token}")], timeout=5,
            )


async def clear_faults(workers: list[WorkerHandle], chaos_token: str) -> None:
    """Ends every chaos fault of each worker (a shared worker's next test runs at full speed)."""
    for worker in workers:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            await chaos_pb2_grpc.ChaosServiceStub(channel).ClearFaults(
                chaos_pb2.ClearFaultsRequest(), metadata=[("authorization", f"Bearer {chaos_token}")], timeout=5,
            )


@contextlib.asynccontextmanager
async def busy_batch(stub: worker_pb2_grpc.WorkerServiceStub, sequences: int = 48) -> AsyncIterator[list[asyncio.Task]]:
    """`sequences` long streams running on the worker (each to 1,500 tokens), until the block ends; yields their tasks (a
    test checks none ended early). On the way out they are cancelled on the worker too: a broken stream's request runs on
    for a resume, and would take the worker's steps from the next test."""
    ids = [f"busy-{i}" for i in range(sequences)]

    async def stream(request_id: str) -> None:
        request = worker_pb2.GenerateRequest(
            request_id=request_id, text=f"busy stream {request_id}",
            sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True),
        )
        async for _ in stub.Generate(request):
            pass

    streams = [asyncio.create_task(stream(request_id)) for request_id in ids]
    try:
        yield streams
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await asyncio.gather(*(stub.Cancel(worker_pb2.CancelRequest(request_id=i), timeout=5) for i in ids), return_exceptions=True)
