"""Services started together for a benchmark or a test (workers, routers, health, checkpoint stores, migration), stopped by PID when done."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from phalanx.common.config import EtcdConfig
from phalanx.launch.services import (
    CheckpointStoreHandle,
    HealthHandle,
    RouterHandle,
    ServiceHandle,
    WorkerHandle,
    start_checkpoint_store,
    start_encoder_pool,
    start_health,
    start_migration,
    start_router,
    start_worker,
)

__all__ = ["Stack", "unique_id"]


def unique_id(name: str) -> str:
    """``name`` with a random suffix: a killed service's etcd key may outlive it by a lease TTL."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


class Stack:
    """Workers of one model, routers and health instances against one NATS and one etcd."""

    def __init__(self, nats_url: str, etcd_config: EtcdConfig, *, model: str) -> None:
        self.nats_url = nats_url
        self.etcd_config = etcd_config
        self.model = model
        self.workers: list[WorkerHandle] = []
        self.routers: list[RouterHandle] = []
        self.healths: list[HealthHandle] = []
        self.stores: list[CheckpointStoreHandle] = []
        self.migrations: list[ServiceHandle] = []
        self.encoders: list[ServiceHandle] = []

    async def add_workers(self, count: int, *extra: str, env: dict | None = None, tensor_parallel_size: int = 1) -> list[WorkerHandle]:
        """``count`` workers started in parallel (deterministic numerics unless ``extra`` says --fast); each one a group
        of ``tensor_parallel_size`` processes."""
        flags = extra if "--fast" in extra else ("--deterministic", *extra)
        started = await asyncio.gather(
            *(start_worker(unique_id(f"w{i}"), self.nats_url, self.etcd_config, *flags, model=self.model, env=env,
                           tensor_parallel_size=tensor_parallel_size)
              for i in range(count))
        )
        self.workers.extend(started)
        return list(started)

    async def add_router(self, *extra: str, port: int = 0, router_id: str | None = None, env: dict | None = None) -> RouterHandle:
        router = await start_router(router_id or unique_id("r"), self.nats_url, self.etcd_config, *extra, port=port, env=env)
        self.routers.append(router)
        return router

    async def add_health(self, *extra: str, instance_id: str | None = None, env: dict | None = None) -> HealthHandle:
        handle = await start_health(instance_id or unique_id("h"), self.nats_url, self.etcd_config, *extra, env=env)
        self.healths.append(handle)
        return handle

    async def add_checkpoint_store(self, *extra: str, store_id: str | None = None, env: dict | None = None) -> CheckpointStoreHandle:
        handle = await start_checkpoint_store(store_id or unique_id("ckpt"), self.etcd_config, *extra, env=env)
        self.stores.append(handle)
        return handle

    async def add_migration(self, *extra: str, instance_id: str | None = None, env: dict | None = None) -> ServiceHandle:
        handle = await start_migration(instance_id or unique_id("mig"), self.nats_url, self.etcd_config, *extra, env=env)
        self.migrations.append(handle)
        return handle

    async def add_encoder(self, *extra: str, encoder_id: str | None = None, env: dict | None = None) -> ServiceHandle:
        handle = await start_encoder_pool(encoder_id or unique_id("enc"), self.etcd_config, *extra, env=env)
        self.encoders.append(handle)
        return handle

    def stop(self) -> None:
        """SIGTERM every process (health first, so that it marks nothing dead on the way out; then routers, so that none
        routes to a stopping worker)."""
        for handle in [*self.healths, *self.routers, *self.migrations, *self.workers, *self.stores, *self.encoders]:
            with contextlib.suppress(Exception):
                handle.terminate(timeout=20)
