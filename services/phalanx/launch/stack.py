"""Services started together for a benchmark or a test (workers, routers, health, checkpoint stores, migration), stopped by PID when done."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.common.config import EtcdConfig
from phalanx.launch.services import (
    CheckpointStoreHandle,
    FailoverEngineHandle,
    HealthHandle,
    RouterHandle,
    ServiceHandle,
    WorkerHandle,
    start_checkpoint_store,
    start_encoder_pool,
    start_ert_manager,
    start_expert_worker,
    start_failover_engine,
    start_health,
    start_memory_service,
    start_migration,
    start_router,
    start_worker,
    wait_registered,
)

__all__ = ["FailoverSlot", "Stack", "unique_id"]


def unique_id(name: str) -> str:
    """``name`` with a random suffix: a killed service's etcd key may outlive it by a lease TTL."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


@dataclass
class FailoverSlot:
    """One failover slot: its directory (lock, memory socket, weight segments: the pod's emptyDir), memory service, engines."""

    name: str
    directory: Path
    memory: ServiceHandle
    engines: list[FailoverEngineHandle] = field(default_factory=list)
    next_engine_id: int = 0

    @property
    def lock(self) -> str:
        return str(self.directory / "failover.lock")

    @property
    def socket(self) -> str:
        return str(self.directory / "memory.sock")

    @property
    def segments(self) -> str:
        return str(self.directory / "segments")


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
        self.slots: list[FailoverSlot] = []
        # A disaggregated MoE deployment's expert workers and ERT managers (docs/moe.md).
        self.expert_workers: list[ServiceHandle] = []
        self.ert_managers: list[ServiceHandle] = []
        self.encoders: list[ServiceHandle] = []

    async def add_workers(
        self, count: int, *extra: str, env: dict | None = None, tensor_parallel_size: int = 1, prefix: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> list[WorkerHandle]:
        """``count`` workers started in parallel (deterministic numerics unless ``extra`` says --fast); each one a group
        of ``tensor_parallel_size`` processes, run through ``prefix`` if given (see ``start_worker``)."""
        flags = extra if "--fast" in extra else ("--deterministic", *extra)
        started = await asyncio.gather(
            *(start_worker(unique_id(f"w{i}"), self.nats_url, self.etcd_config, *flags, model=self.model, env=env,
                           tensor_parallel_size=tensor_parallel_size, prefix=prefix, timeout=timeout)
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

    async def add_failover_slot(self, *extra: str, env: dict | None = None, engines: bool = True) -> FailoverSlot:
        """A slot serving: its memory service, a primary engine (id 0, registered) and a shadow (id 1, standing by);
        without ``engines`` its memory service only."""
        directory = Path(tempfile.mkdtemp(prefix="phalanx-slot-", dir="/dev/shm"))
        name = unique_id("slot")
        try:
            memory = await start_memory_service(str(directory / "memory.sock"), str(directory / "segments"), name=f"{name}-memory")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        slot = FailoverSlot(name, directory, memory)
        self.slots.append(slot)
        if not engines:
            return slot
        primary = await self.add_failover_engine(slot, "primary", *extra, env=env)
        await wait_registered(primary, self.etcd_config)
        await self.add_failover_engine(slot, "shadow", *extra, env=env)
        return slot

    async def add_failover_engine(
        self, slot: FailoverSlot, role: str, *extra: str, env: dict | None = None, wait_startup: bool = True
    ) -> FailoverEngineHandle:
        """One more engine of ``slot`` (deterministic numerics unless ``extra`` says --fast), returned once standing by
        (or once its probes answer, without ``wait_startup``); the slot's first engine gets id 0 and loads the weights."""
        flags = extra if "--fast" in extra else ("--deterministic", *extra)
        engine_id, slot.next_engine_id = slot.next_engine_id, slot.next_engine_id + 1
        engine = await start_failover_engine(
            unique_id(f"{slot.name}-e{engine_id}"), self.nats_url, self.etcd_config, *flags, model=self.model, role=role,
            engine_id=engine_id, lock=slot.lock, memory_socket=slot.socket, slot=slot.name, env=env, wait_startup=wait_startup,
        )
        slot.engines.append(engine)
        return engine

    async def add_expert_workers(self, count: int, *extra: str, copies: int = 1, env: dict | None = None) -> list[ServiceHandle]:
        """``count`` expert workers, slots 0..count-1 of one placement with ``copies`` copies of each expert, started in parallel."""
        started = await asyncio.gather(
            *(start_expert_worker(unique_id(f"ew{i}"), self.etcd_config, *extra, model=self.model, index=i, num_expert_workers=count,
                                  copies=copies, env=env)
              for i in range(count))
        )
        self.expert_workers.extend(started)
        return list(started)

    async def add_ert_manager(self, *extra: str, instance_id: str | None = None, env: dict | None = None) -> ServiceHandle:
        handle = await start_ert_manager(instance_id or unique_id("ert"), self.etcd_config, *extra, model=self.model, env=env)
        self.ert_managers.append(handle)
        return handle

    async def add_encoder(self, *extra: str, encoder_id: str | None = None, env: dict | None = None) -> ServiceHandle:
        handle = await start_encoder_pool(encoder_id or unique_id("enc"), self.etcd_config, *extra, env=env)
        self.encoders.append(handle)
        return handle

    def stop(self) -> None:
        """SIGTERM every process (health first, so that it marks nothing dead on the way out; then routers, so that none
        routes to a stopping worker)."""
        engines = [e for slot in self.slots for e in slot.engines]
        for handle in [
            *self.healths, *self.routers, *self.migrations, *self.workers, *engines, *self.stores, *(s.memory for s in self.slots),
            *self.ert_managers, *self.expert_workers, *self.encoders,
        ]:
            with contextlib.suppress(Exception):
                handle.terminate(timeout=20)
        for slot in self.slots:
            shutil.rmtree(slot.directory, ignore_errors=True)
