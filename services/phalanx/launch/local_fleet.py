"""A fleet's processes on this machine, as `phalanx up` runs them: started from the fleet's description, restarted one by one.

`LocalFleet` starts what a `Fleet` (phalanx.launch.topology) names, each kind with its launcher of
phalanx.launch.services and `phalanx up`'s ids (``worker-0``, ``router-0``), and starts any one of them again: a worker
under a new id (health and migration still hold the old one as dead), a failover engine as a new engine of its slot
that stands by, an expert worker in its placement slot under a new name, anything else under its old name and address.
When to start again is the supervisor's call (phalanx.launch.supervisor); what it shows goes to a `SupervisorView`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.launch.events import ProcessState, SupervisorView
from phalanx.launch.topology import Fleet, ProcessKind, ProcessSpec, WorkerRole

if TYPE_CHECKING:
    from phalanx.common.config import EtcdConfig
    from phalanx.launch.fork_server import ForkServer
    from phalanx.launch.infra import EtcdServer, NatsServer
    from phalanx.launch.services import (
        FailoverEngineHandle,
        GatewayHandle,
        HealthHandle,
        PlannerHandle,
        RouterHandle,
        ServiceHandle,
        WorkerHandle,
    )

__all__ = [
    "ERT_MANAGER_ID", "FORK_SERVER_ID", "GATEWAY_ID", "HEALTH_ID", "MIGRATION_ID", "PLANNER_ID", "ROUTER_ID", "STORE_ID", "LocalFleet",
    "LocalSettings", "StartError", "memory_name",
]

ROUTER_ID = ProcessSpec(ProcessKind.ROUTER).name
HEALTH_ID = ProcessSpec(ProcessKind.HEALTH).name
STORE_ID = ProcessSpec(ProcessKind.CHECKPOINT_STORE).name
MIGRATION_ID = ProcessSpec(ProcessKind.MIGRATION).name
GATEWAY_ID = ProcessSpec(ProcessKind.GATEWAY).name
PLANNER_ID = ProcessSpec(ProcessKind.PLANNER).name
ERT_MANAGER_ID = ProcessSpec(ProcessKind.ERT_MANAGER).name
FORK_SERVER_ID = ProcessSpec(ProcessKind.FORK_SERVER).name
_INFRA = frozenset({ProcessKind.NATS, ProcessKind.ETCD, ProcessKind.FORK_SERVER})


def memory_name(slot: int) -> str:
    """The name of a failover slot's memory service in `phalanx up` (``slot-<i>-memory``)."""
    return f"{ProcessSpec(ProcessKind.FAILOVER_SLOT, slot).name}-memory"


class StartError(Exception):
    """A process of the fleet did not start; the message says which and why."""


@dataclass(frozen=True)
class LocalSettings:
    """How this machine runs the fleet: the model, the workers' flags, ports, and the control plane if it is external."""

    model: str
    worker_flags: tuple[str, ...] = ()  # every engine worker's: numerics (--deterministic/--fast), --engine, --profile
    router_port: int = 0
    gateway_port: int = 0
    nats_url: str = ""  # external; empty: the fleet's own
    etcd_endpoint: str = ""
    certs_dir: Path | None = None  # mutual TLS between every process, with the certificates there
    profile: str = ""  # the simulated engine's profile, which the planner reads too
    min_workers: int = 1  # the planner's bounds
    max_workers: int = 2
    prefill_workers: int = 0  # a disaggregated fleet's prefill workers at start; the planner then plans two pools
    fork_preload: tuple[str, ...] = ()  # what the fork server imports, with a fork server in the fleet


class LocalFleet:
    """The processes of one fleet on this machine, by name; `start_infra` then `start_services` start them all."""

    def __init__(self, fleet: Fleet, settings: LocalSettings, view: SupervisorView, ready: Callable[[str, str, int | None], None]) -> None:
        self.fleet = fleet
        self.settings = settings
        self.view = view
        self._ready = ready  # a process started and serves: shown, and watched from now on
        self.nats: NatsServer | None = None  # None: external, or not started yet
        self.etcd: EtcdServer | None = None
        self.nats_url = settings.nats_url
        self.etcd_endpoint = settings.etcd_endpoint
        self.workers: dict[str, WorkerHandle] = {}  # in id order once all started
        # Each worker's role when the fleet has several (prefill and decode): its replacement runs the same one.
        self.worker_roles: dict[str, WorkerRole] = {}
        self.router: RouterHandle | None = None
        self.router_address = ""  # kept while a replacement router starts: it binds the same port
        self.gateway_url = ""  # likewise
        self.router_metrics = ""
        self.health: HealthHandle | None = None
        self.store: ServiceHandle | None = None
        self.migration: ServiceHandle | None = None
        self.encoders: dict[str, ServiceHandle] = {}  # by id: encoder-0, encoder-1 ...
        self.gateway: GatewayHandle | None = None
        self.planner: PlannerHandle | None = None
        self._next_worker = fleet.worker_count + fleet.failover_slots
        # Failover slots: their directory (locks, memory sockets, weight segments), each slot's memory service by name, each
        # engine's slot, and the next engine id per slot (a restarted engine gets a new one and stands by).
        self.slots_dir: Path | None = None
        self.memories: dict[str, ServiceHandle] = {}
        self.engine_slot: dict[str, int] = {}
        self._next_engine: dict[int, int] = {}
        # Disaggregated MoE: the ERT manager and the expert workers by name, with each one's placement slot.
        self.ert_manager: ServiceHandle | None = None
        self.expert_workers: dict[str, ServiceHandle] = {}
        self.expert_slots: dict[str, int] = {}
        self._expert_generation = 0
        self.fork_server: ForkServer | None = None

    # --- infrastructure -------------------------------------------------------------------------------------------

    def start_infra(self) -> None:
        """NATS and etcd (unless external), the fork server (if any); blocking, from the main thread so PR_SET_PDEATHSIG holds."""
        from phalanx.launch.infra import EtcdServer, NatsServer, ServerTls
        from phalanx.launch.services import use_certs

        for name, given in (("nats", self.nats_url), ("etcd", self.etcd_endpoint)):
            self.view.show(name, ProcessState.EXTERNAL if given else ProcessState.STARTING, given)
        certs = self.settings.certs_dir
        if certs is not None:
            # With TLS our own NATS and etcd want client certificates of the same CA, and each service presents its own
            # identity's; external ones are configured by the environment (PHALANX_NATS_*, PHALANX_ETCD_*).
            use_certs(certs, nats=not self.nats_url, etcd=not self.etcd_endpoint)
        if not self.nats_url:
            self.nats = NatsServer(tls=None if certs is None else ServerTls.from_dir(certs / "nats")).start()
            self.nats_url = self.nats.url
            self._ready("nats", self.nats_url, self.nats.pid)
        if not self.etcd_endpoint:
            # With TLS, authorization too: each identity gets its own keys (phalanx.common.control_plane_acl), set up as
            # admin (the supervisor's identity) before any service starts.
            self.etcd = EtcdServer(
                tls=None if certs is None else ServerTls.from_dir(certs / "etcd"), authorize=None if certs is None else certs / "admin"
            ).start()
            self.etcd_endpoint = self.etcd.endpoint
            self._ready("etcd", self.etcd_endpoint, self.etcd.pid)
        if self.fleet.fork_server:
            from phalanx.launch.services import use_fork_server

            # Workers started before it has imported are spawned, as they are without it.
            self.fork_server = use_fork_server(self.settings.fork_preload)
            assert self.fork_server is not None and self.fork_server.process is not None
            self._ready(FORK_SERVER_ID, "", self.fork_server.process.pid)

    @property
    def etcd_config(self) -> EtcdConfig:
        from phalanx.common.config import EtcdConfig

        if self.etcd is not None and self.etcd.tls is not None and self.settings.certs_dir is not None:
            return EtcdConfig(endpoint=self.etcd_endpoint, tls_dir=str(self.settings.certs_dir / "admin"))
        return EtcdConfig(endpoint=self.etcd_endpoint)

    @property
    def _env(self) -> dict[str, str]:
        # Free ports for every process: an environment made for one service per host (the
        # container image sets fixed metrics ports) must not make the second one fail to bind.
        return {"PHALANX_WORKER_METRICS_PORT": "0", "PHALANX_ROUTER_METRICS_PORT": "0"}

    @property
    def forks(self) -> subprocess.Popen | None:
        """The fork server's process, alive or not; None without one."""
        return self.fork_server.process if self.fork_server is not None else None

    def end_forking(self) -> int | None:
        """Stops the fork server: workers are spawned from now on. Its last process's PID, if it had one."""
        from phalanx.launch.services import use_fork_server

        forks = self.forks
        use_fork_server(None)
        self.fork_server = None
        return forks.pid if forks is not None else None

    # --- starting the fleet ---------------------------------------------------------------------------------------

    async def start_services(self) -> None:
        """Every process of the fleet but the infrastructure, phase by phase (phalanx.launch.topology says why in this order)."""
        phases = [phase for phase in self.fleet.phases() if phase[0].kind not in _INFRA]
        specs = [spec for phase in phases for spec in phase]
        for spec in specs:
            if spec.kind is ProcessKind.WORKER:
                self.view.show(spec.name, ProcessState.STARTING)
        for spec in specs:
            if spec.kind in (ProcessKind.ROUTER, ProcessKind.GATEWAY, ProcessKind.HEALTH):
                self.view.show(spec.name, ProcessState.WAITING)  # for the workers
        for spec in specs:
            if spec.kind in (ProcessKind.CHECKPOINT_STORE, ProcessKind.MIGRATION):
                self.view.show(spec.name, ProcessState.STARTING)
        for phase in phases:
            await self._start_phase(phase)

    async def _start_phase(self, phase: tuple[ProcessSpec, ...]) -> None:
        kind = phase[0].kind
        if kind in (ProcessKind.WORKER, ProcessKind.FAILOVER_SLOT):
            await self._start_workers(phase)
        elif kind is ProcessKind.EXPERT_WORKER:
            try:
                async with asyncio.TaskGroup() as group:
                    for spec in phase:
                        group.create_task(self._start_expert_worker(spec.index))
            except* Exception as failed:  # noqa: BLE001 - the first failure cancels the other starts, which kill their process
                raise StartError("expert workers: " + "; ".join(f"{e}" or type(e).__name__ for e in failed.exceptions)) from None
        else:
            for spec in phase:
                await self._start_one(spec)

    async def _start_one(self, spec: ProcessSpec) -> None:
        """One service, shown starting then ready; a failure is a StartError that says which and, where it helps, what to try."""
        name, kind = spec.name, spec.kind
        if kind is not ProcessKind.MIGRATION and kind is not ProcessKind.CHECKPOINT_STORE:
            self.view.show(name, ProcessState.STARTING)
        try:
            handle = await self._start(spec)
        except Exception as error:  # noqa: BLE001 - whatever it is, report it and stop the rest
            raise StartError(_start_failure(spec, error, self.settings)) from None
        if kind is ProcessKind.ROUTER:
            self._router_ready(handle)
        elif kind is ProcessKind.GATEWAY:
            self._ready(GATEWAY_ID, handle.url, handle.process.pid)
        else:
            self._ready(name, handle.address, handle.process.pid)

    async def _start(self, spec: ProcessSpec) -> Any:
        """Starts ``spec``'s service and keeps its handle."""
        kind = spec.kind
        if kind is ProcessKind.ENCODER:
            self.encoders[spec.name] = handle = await self._start_encoder(spec.name)
            return handle
        if kind is ProcessKind.ROUTER:
            self.router = await self._start_router(self.settings.router_port)
            return self.router
        if kind is ProcessKind.GATEWAY:
            self.gateway = await self._start_gateway(self.settings.gateway_port)
            self.gateway_url = self.gateway.url
            return self.gateway
        attribute, start = self._singletons[spec.name]
        handle = await start()
        setattr(self, attribute, handle)
        return handle

    @property
    def _singletons(self) -> dict[str, tuple[str, Callable[[], Any]]]:
        """The services started under their one name again and again: the attribute that holds each, and its start."""
        return {HEALTH_ID: ("health", self._start_health), STORE_ID: ("store", self._start_store),
                MIGRATION_ID: ("migration", self._start_migration), PLANNER_ID: ("planner", self._start_planner),
                ERT_MANAGER_ID: ("ert_manager", self._start_ert_manager)}

    async def _start_workers(self, phase: tuple[ProcessSpec, ...]) -> None:
        """The workers and failover slots, in parallel."""

        async def one(spec: ProcessSpec) -> None:
            handle = await self.start_worker(spec.name, spec.role.flags if spec.role else ())
            self.workers[spec.name] = handle
            if spec.role is not None:
                self.worker_roles[spec.name] = spec.role
            self._ready(spec.name, handle.address, handle.process.pid)

        slots = [spec for spec in phase if spec.kind is ProcessKind.FAILOVER_SLOT]
        if slots:
            self.slots_dir = Path(tempfile.mkdtemp(prefix="phalanx-up-", dir="/dev/shm"))
        try:
            async with asyncio.TaskGroup() as group:
                for spec in phase:
                    group.create_task(self._start_slot(spec.index) if spec.kind is ProcessKind.FAILOVER_SLOT else one(spec))
        except* Exception as failed:  # noqa: BLE001 - the first failure cancels the other starts, which kill their process
            raise StartError("; ".join(f"{e}" or type(e).__name__ for e in failed.exceptions)) from None
        if not slots:
            self.workers = {spec.name: self.workers[spec.name] for spec in phase}

    def _router_ready(self, router: RouterHandle) -> None:
        self.router_address = router.address
        self.router_metrics = router.metrics_address
        self._ready(ROUTER_ID, router.address, router.process.pid)

    # --- one process of each kind ---------------------------------------------------------------------------------

    def new_worker_id(self) -> str:
        """An id no worker of this fleet had: a dead worker's may linger in health and migration."""
        worker_id = ProcessSpec(ProcessKind.WORKER, self._next_worker).name
        self._next_worker += 1
        return worker_id

    @property
    def _worker_role_flags(self) -> tuple[str, ...]:
        """A new worker's role: the role of the fleet's (first) worker group."""
        role = next((group.role for group in self.fleet.workers if group.count), None)
        return role.flags if role is not None else ()

    async def start_worker(self, worker_id: str, role_flags: tuple[str, ...] | None = None) -> WorkerHandle:
        """A worker process, returned once it serves; nothing of this fleet's bookkeeping changes."""
        from phalanx.launch.services import start_worker

        flags = (*self.settings.worker_flags, *(self._worker_role_flags if role_flags is None else role_flags))
        return await start_worker(worker_id, self.nats_url, self.etcd_config, *flags, model=self.settings.model, env=self._env)

    async def new_worker(self, role: WorkerRole | None = None) -> tuple[str, int | None]:
        """A worker under a new id (of `role`, else of the first worker group's), one of the fleet's once it serves; its (id, pid)."""
        worker_id = self.new_worker_id()
        self.view.show(worker_id, ProcessState.STARTING)
        try:
            handle = await self.start_worker(worker_id, role.flags if role is not None else None)
            if role is not None:
                self.worker_roles[worker_id] = role
        except BaseException:
            self.view.forget(worker_id)
            raise
        self.workers[worker_id] = handle
        self.view.show(worker_id, ProcessState.READY, handle.address, handle.process.pid)
        return worker_id, handle.process.pid

    def _slot_dir(self, slot: int) -> Path:
        assert self.slots_dir is not None
        return self.slots_dir / f"slot-{slot}"

    async def _start_memory(self, slot: int) -> ServiceHandle:
        from phalanx.launch.services import start_memory_service

        directory = self._slot_dir(slot)
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        name = memory_name(slot)
        return await start_memory_service(str(directory / "memory.sock"), str(directory / "segments"), name=name)

    async def _start_engine(self, slot: int, role: str) -> FailoverEngineHandle:
        """An engine of `slot`, returned once it stands by (or serves: a primary, or one that found the lock free)."""
        from phalanx.launch.services import start_failover_engine

        engine_id = self._next_engine.get(slot, 0)
        self._next_engine[slot] = engine_id + 1
        directory = self._slot_dir(slot)
        name = f"worker-{slot}-e{engine_id}"
        self.engine_slot[name] = slot
        numerics = tuple(flag for flag in self.settings.worker_flags if flag in ("--deterministic", "--fast"))
        return await start_failover_engine(
            name, self.nats_url, self.etcd_config, *numerics, model=self.settings.model, role=role, engine_id=engine_id,
            lock=str(directory / "failover.lock"), memory_socket=str(directory / "memory.sock"), slot=f"slot-{slot}", env=self._env,
        )

    async def _start_slot(self, slot: int) -> None:
        """The slot's memory service, its primary (registered) and its shadow (standing by)."""
        from phalanx.launch.services import wait_registered

        self.memories[memory_name(slot)] = memory = await self._start_memory(slot)
        self._ready(memory.name, memory.address, memory.process.pid)
        primary = await self._start_engine(slot, "primary")
        await wait_registered(primary, self.etcd_config, timeout=60)
        self.workers[primary.name] = primary
        self._ready(primary.name, primary.address, primary.process.pid)
        shadow = await self._start_engine(slot, "shadow")
        self.workers[shadow.name] = shadow
        self._ready(shadow.name, "standing by", shadow.process.pid)

    async def replace_engine(self, slot: int) -> tuple[str, int | None]:
        """A dead engine's successor in its slot: a new engine that stands by (or takes over if the lock is free)."""
        handle = await self._start_engine(slot, "shadow")
        self.workers[handle.name] = handle
        self.view.show(handle.name, ProcessState.READY, handle.address or "standing by", handle.process.pid)
        return handle.name, handle.process.pid

    async def _start_ert_manager(self) -> ServiceHandle:
        from phalanx.launch.services import start_ert_manager

        return await start_ert_manager(ERT_MANAGER_ID, self.etcd_config, model=self.settings.model)

    async def _start_expert_worker(self, slot: int) -> tuple[str, ServiceHandle]:
        """The expert worker of placement slot `slot`, under a new name each start (a dead one's lease may linger)."""
        from phalanx.launch.services import start_expert_worker

        generation, self._expert_generation = self._expert_generation, self._expert_generation + 1
        name = ProcessSpec(ProcessKind.EXPERT_WORKER, slot).name
        if generation >= self.fleet.expert_workers:
            name = f"{name}-r{generation}"
        self.view.show(name, ProcessState.STARTING)
        handle = await start_expert_worker(
            name, self.etcd_config, model=self.settings.model, index=slot, num_expert_workers=self.fleet.expert_workers,
            copies=self.fleet.expert_copies, env={"PHALANX_EXPERT_METRICS_PORT": "0"},
        )
        self.expert_workers[name] = handle
        self.expert_slots[name] = slot
        self._ready(name, handle.address, handle.process.pid)
        return name, handle

    async def replace_expert_worker(self, slot: int) -> tuple[str, int | None]:
        name, handle = await self._start_expert_worker(slot)
        return name, handle.process.pid

    async def _start_router(self, port: int) -> RouterHandle:
        from phalanx.launch.services import start_router

        return await start_router(ROUTER_ID, self.nats_url, self.etcd_config, "--model", self.settings.model, port=port, env=self._env)

    async def _start_store(self) -> ServiceHandle:
        from phalanx.launch.services import start_checkpoint_store

        return await start_checkpoint_store(STORE_ID, self.etcd_config, env={"PHALANX_CHECKPOINT_METRICS_PORT": "0"})

    async def _start_migration(self) -> ServiceHandle:
        from phalanx.launch.services import start_migration

        # With a planner, capacity comes while workers are loaded (a burst): running requests rebalance onto it, unless
        # the environment says otherwise.
        rebalance = self.fleet.planner and "PHALANX_MIGRATION_REBALANCE" not in os.environ
        env = {"PHALANX_MIGRATION_REBALANCE": "true"} if rebalance else None
        return await start_migration(MIGRATION_ID, self.nats_url, self.etcd_config, env=env)

    async def _start_encoder(self, encoder_id: str) -> ServiceHandle:
        from phalanx.launch.services import start_encoder_pool
        from phalanx.model.config import model_hidden_size

        hidden = await asyncio.to_thread(model_hidden_size, self.settings.model)
        return await start_encoder_pool(encoder_id, self.etcd_config, "--llm-hidden-size", str(hidden))

    async def _start_gateway(self, port: int) -> GatewayHandle:
        from phalanx.launch.services import start_gateway

        return await start_gateway(
            self.router_address, "--model", self.settings.model, name=GATEWAY_ID, port=port, etcd_config=self.etcd_config
        )

    async def _start_health(self) -> HealthHandle:
        from phalanx.launch.services import start_health

        return await start_health(HEALTH_ID, self.nats_url, self.etcd_config)

    async def _start_planner(self) -> PlannerHandle:
        from phalanx.launch.services import start_planner

        settings = self.settings
        env = {"PHALANX_PLANNER_MIN_WORKERS": str(settings.min_workers), "PHALANX_PLANNER_MAX_WORKERS": str(settings.max_workers),
               "PHALANX_PLANNER_CONNECTOR": "virtual", "PHALANX_PLANNER_HOT_SPARES": str(self.fleet.hot_spares)}
        if settings.profile:
            env["PHALANX_PLANNER_PROFILE"] = settings.profile
        if settings.prefill_workers:
            # Two pools (docs/disagg.md, Planner): min/max_workers bound the decode pool, these the prefill pool; the same
            # number of hot spares in each.
            env |= {"PHALANX_PLANNER_DISAGGREGATED": "true", "PHALANX_PLANNER_PREFILL_MIN_WORKERS": "1",
                    "PHALANX_PLANNER_PREFILL_MAX_WORKERS": str(max(settings.max_workers, settings.prefill_workers)),
                    "PHALANX_PLANNER_PREFILL_HOT_SPARES": str(self.fleet.hot_spares)}
        return await start_planner(PLANNER_ID, self.etcd_config, env=env)

    # --- starting one again ---------------------------------------------------------------------------------------

    async def restart_in_place(self, name: str) -> tuple[str, int | None]:
        """Anything but a worker or an expert worker, started again under its old name; its (name, pid)."""
        if name == ROUTER_ID:
            self.router = None
            # The same port: clients (and the state file) keep the address they know.
            self.router = router = await self._start_router(int(self.router_address.rsplit(":", 1)[1]))
            self._router_ready(router)
            return ROUTER_ID, router.process.pid
        if name == GATEWAY_ID:
            self.gateway = None
            self.gateway = gateway = await self._start_gateway(int(self.gateway_url.rsplit(":", 1)[1]))
            self.view.show(GATEWAY_ID, ProcessState.READY, gateway.url, gateway.process.pid)
            return GATEWAY_ID, gateway.process.pid
        if name in self.memories:
            slot = int(name.split("-")[1])
            del self.memories[name]
            # Same socket and segments: its engines exited (they must, without it) and their successors map the weights again.
            self.memories[name] = memory = await self._start_memory(slot)
            self.view.show(name, ProcessState.READY, memory.address, memory.process.pid)
            return name, memory.process.pid
        if name in ("nats", "etcd"):
            return self._restart_infra(name)
        if name == FORK_SERVER_ID:
            assert self.fork_server is not None
            # On the main thread on purpose (PR_SET_PDEATHSIG); workers are spawned until it has imported.
            process = self.fork_server.start()
            self.view.show(name, ProcessState.READY, "", process.pid)
            return name, process.pid
        if name in self.encoders:
            self.encoders[name] = encoder = await self._start_encoder(name)
            self.view.show(name, ProcessState.READY, encoder.address, encoder.process.pid)
            return name, encoder.process.pid
        attribute, start = self._singletons[name]
        setattr(self, attribute, None)
        service = await start()
        setattr(self, attribute, service)
        self.view.show(name, ProcessState.READY, service.address, service.process.pid)
        return name, service.process.pid

    def _restart_infra(self, name: str) -> tuple[str, int | None]:
        server = self.nats if name == "nats" else self.etcd
        assert server is not None  # only ours are watched
        server.stop()  # reaps the dead process and closes its log
        # Blocking, and on the main thread on purpose: PR_SET_PDEATHSIG ties the child to this thread.
        # Same ports and data directory: every client reconnects, etcd keeps its keys and leases.
        server.start()
        self.view.show(name, ProcessState.READY, self.nats_url if name == "nats" else self.etcd_endpoint, server.pid)
        return name, server.pid

    # --- what runs ------------------------------------------------------------------------------------------------

    def services(self) -> list[ServiceHandle]:
        """Every service but the workers, the expert workers and the memory services."""
        extras = (self.router, self.gateway, self.health, self.store, self.migration, self.planner, self.ert_manager, *self.encoders.values())
        return [h for h in extras if h is not None]

    def processes(self) -> dict[str, subprocess.Popen]:
        """Every process this fleet started, by name, alive or not (external infrastructure not included)."""
        handles = [*self.workers.values(), *self.expert_workers.values(), *self.services(), *self.memories.values()]
        found = {handle.name: handle.process for handle in handles}
        for name, server in (("nats", self.nats), ("etcd", self.etcd)):
            # infra.py's servers expose no exit code; their Popen is the one place it lives.
            proc = getattr(server, "_proc", None)
            if server is not None and proc is not None:
                found[name] = proc
        if self.forks is not None:
            found[FORK_SERVER_ID] = self.forks
        return found

    def remove_slots(self) -> None:
        if self.slots_dir is not None:
            shutil.rmtree(self.slots_dir, ignore_errors=True)

    def close_infra(self) -> None:
        for name, server in (("etcd", self.etcd), ("nats", self.nats)):
            if server is not None:
                server.close()
                self.view.stopped(name)


def _start_failure(spec: ProcessSpec, error: Exception, settings: LocalSettings) -> str:
    """What a StartError says of ``spec``'s failed start."""
    what = f"{error}" or type(error).__name__
    if spec.kind is ProcessKind.ROUTER:
        return what + (f" (is port {settings.router_port} taken? try --port 0)" if settings.router_port else "")
    if spec.kind is ProcessKind.GATEWAY:
        return f"gateway: {what}" + (f" (is port {settings.gateway_port} taken? try --gateway-port 0)" if settings.gateway_port else "")
    prefixes = {ProcessKind.CHECKPOINT_STORE: "checkpoint store / migration", ProcessKind.MIGRATION: "checkpoint store / migration",
                ProcessKind.ERT_MANAGER: "expert workers", ProcessKind.ENCODER: "encoder", ProcessKind.HEALTH: "health service",
                ProcessKind.PLANNER: "planner"}
    return f"{prefixes[spec.kind]}: {what}"
