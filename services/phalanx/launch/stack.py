"""Services started together for a benchmark or a test (workers, routers, health, checkpoint stores, migration), stopped by PID when done.

A whole fleet starts from its description (`Stack.start`, phalanx.launch.topology); a test adds one process at a time with
the ``add_*`` methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.common.config import EtcdConfig
from phalanx.launch.services import (
    CheckpointStoreHandle,
    FailoverEngineHandle,
    GatewayHandle,
    HealthHandle,
    PlannerHandle,
    RouterHandle,
    ServiceHandle,
    WorkerHandle,
    start_checkpoint_store,
    start_encoder_pool,
    start_ert_manager,
    start_expert_worker,
    start_failover_engine,
    start_gateway,
    start_health,
    start_memory_service,
    start_migration,
    start_planner,
    start_router,
    start_worker,
    wait_registered,
)
from phalanx.launch.topology import Fleet, ProcessKind, ProcessSpec

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
        self.gateways: list[GatewayHandle] = []
        self.planners: list[PlannerHandle] = []

    async def start(self, fleet: Fleet, *extra: str, env: dict | None = None) -> None:
        """Every process of ``fleet`` but its NATS and etcd (this stack's are given), phase by phase, each phase's
        processes in parallel; ``extra`` and ``env`` go to every engine worker and failover engine."""
        for phase in fleet.phases():
            starts = [self._start_spec(spec, fleet, *extra, env=env) for spec in phase]
            await asyncio.gather(*(start for start in starts if start is not None))

    def _start_spec(self, spec: ProcessSpec, fleet: Fleet, *extra: str, env: dict | None) -> Awaitable[object] | None:
        """The start of ``spec`` (None: not this stack's to start, or started with the first of its kind)."""
        kind = spec.kind
        if kind is ProcessKind.WORKER:  # each role's workers together, with the first worker
            if spec.index:
                return None
            return asyncio.gather(*(self.add_workers(g.count, *g.role.flags, *extra, env=env) for g in fleet.workers if g.count))
        if kind is ProcessKind.EXPERT_WORKER:  # one placement: started together
            return self.add_expert_workers(fleet.expert_workers, copies=fleet.expert_copies) if spec.index == 0 else None
        if kind is ProcessKind.FAILOVER_SLOT:
            return self.add_failover_slot(*extra, env=env)
        if kind is ProcessKind.GATEWAY:
            return self.add_gateway()
        starts: dict[ProcessKind, Callable[[], Awaitable[object]]] = {
            ProcessKind.CHECKPOINT_STORE: self.add_checkpoint_store, ProcessKind.MIGRATION: self.add_migration,
            ProcessKind.ERT_MANAGER: self.add_ert_manager, ProcessKind.ENCODER: self.add_encoder, ProcessKind.ROUTER: self.add_router,
            ProcessKind.HEALTH: self.add_health, ProcessKind.PLANNER: self.add_planner,
        }
        start = starts.get(kind)  # NATS, etcd, the fork server: not this stack's to start
        return start() if start is not None else None

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

    async def add_gateway(self, *extra: str, port: int = 0) -> GatewayHandle:
        """An OpenAI-compatible gateway in front of every router of this stack."""
        target = "ipv4:" + ",".join(router.address for router in self.routers)
        handle = await start_gateway(target, *extra, "--model", self.model, name=unique_id("gateway"), port=port, etcd_config=self.etcd_config)
        self.gateways.append(handle)
        return handle

    async def add_planner(self, *, instance_id: str | None = None, env: dict | None = None) -> PlannerHandle:
        handle = await start_planner(instance_id or unique_id("planner"), self.etcd_config, env=env)
        self.planners.append(handle)
        return handle

    def stop(self) -> None:
        """SIGTERM every process (planners first, so that none decides on a fleet going away; health, so that it marks
        nothing dead on the way out; then gateways and routers, so that none routes to a stopping worker)."""
        engines = [e for slot in self.slots for e in slot.engines]
        for handle in [
            *self.planners, *self.healths, *self.gateways, *self.routers, *self.migrations,
            *self.workers, *engines, *self.stores, *(s.memory for s in self.slots),
            *self.ert_managers, *self.expert_workers, *self.encoders,
        ]:
            with contextlib.suppress(Exception):
                handle.terminate(timeout=20)
        for slot in self.slots:
            shutil.rmtree(slot.directory, ignore_errors=True)
