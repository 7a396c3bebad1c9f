"""One real worker shared by a test module's tests that do not kill it (a start costs about two seconds)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc

from phalanx._proto import worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import WorkerHandle, start_worker


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
