"""One chaos scenario run: a fresh local stack, a fault-free baseline, the same load with the fault, and the verdict.

The stack runs on its own nats-server and etcd (a scenario may restart them). The load is `streams` greedy SDK
streams of distinct prompts, plus one OpenAI streaming completion through the gateway when the topology has one.
The fault starts once every SDK stream has `fault_after` tokens; like Kubernetes, the fault then starts a
replacement for whatever it killed. What the clients saw is compared to the baseline run of the same prompts on the
same stack before the fault: every token index exactly once, the same tokens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import math
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from phalanx._proto import common_pb2, expert_pb2
from phalanx.chaos.disk import ScenarioSkipped, SmallDisk
from phalanx.chaos.link import DelayLink
from phalanx.chaos.netns import VethNamespace
from phalanx.client import Client, PhalanxClientError, RetryPolicy
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import (
    CheckpointStoreDirectory,
    EncoderDirectory,
    EtcdDirectory,
    ExpertWorkerDirectory,
    MigrationDirectory,
    WorkerDirectory,
    decode_json,
)
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import ERT_KEY, ROUTERS_PREFIX
from phalanx.ert_manager.table import ExpertRoutingTable
from phalanx.launch.infra import EtcdCluster, EtcdServer, NatsServer
from phalanx.launch.ports import free_port
from phalanx.launch.services import (
    CheckpointStoreHandle,
    FailoverEngineHandle,
    GatewayHandle,
    HealthHandle,
    PlannerHandle,
    RouterHandle,
    ServiceHandle,
    WorkerHandle,
    on_fresh_ports,
    start_checkpoint_store,
    start_encoder_pool,
    start_expert_worker,
    start_gateway,
    start_health,
    start_migration,
    start_planner,
    start_worker,
)
from phalanx.launch.stack import Stack, unique_id
from phalanx.launch.topology import Fleet, ProcessKind, ProcessSpec, WorkerGroup, WorkerRole

__all__ = ["ChaosRun", "LoadOptions", "ScenarioResult", "ScenarioSkipped", "StreamRecord", "Topology", "run_scenario"]

MODEL = "phalanx-tiny-moe"
# Health tuned for a test stack: quick canaries and leader handover; slowness is not what these scenarios break, so a
# loaded box's slow canary must not count as a failure; degradation off, so that no stream is shed for capacity.
HEALTH_ENV = {
    "PHALANX_HEALTH_CHECK_INTERVAL_S": "1",
    "PHALANX_HEALTH_FAILURE_RECHECK_S": "0.25",
    "PHALANX_HEALTH_CIRCUIT_RECOVERY_S": "2",
    "PHALANX_HEALTH_LEADER_TTL_S": "1",
    "PHALANX_HEALTH_LATENCY_FACTOR": "50",
    "PHALANX_HEALTH_CHECK_TIMEOUT_S": "10",
    # Not tightened by the latency baseline: a canary queued behind a starved engine is not a fault here.
    "PHALANX_HEALTH_MIN_CHECK_TIMEOUT_S": "10",
    "PHALANX_DEGRADATION_ENABLED": "false",
}
PLANNER_ENV = {"PHALANX_PLANNER_POLL_S": "0.2", "PHALANX_PLANNER_INTERVAL_S": "1"}
# Longest one stream may take, stalls and resumes included; a stream past it counts as lost.
STREAM_TIMEOUT_S = 180.0
# How long the stack may take to get back to full health after the fault before the run says it did not.
RECOVERY_TIMEOUT_S = 90.0
LEASE_TTL_S = 2
# Copies of each expert over a topology's expert workers.
EXPERT_COPIES = 2
# How long a service may take to start: a loaded 2-core box needs far more than the launchers' defaults.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Topology:
    """What one scenario's stack runs."""

    workers: int = 3
    routers: int = 1
    healths: int = 1
    gateway: bool = True
    planner: bool = False
    store: bool = True
    migration: bool = True
    encoders: int = 0
    # Calls the SDK makes in a row without a new token before it gives up (its default: 8, about 5 s of backoff).
    sdk_max_attempts: int = 8
    # Disaggregated MoE (docs/moe.md): this many expert workers (2 copies of each expert) and an ERT manager, and the
    # workers run as attention workers.
    expert_workers: int = 0
    # etcd members: 1 (one etcd process) or a cluster (every client is given every member's endpoint).
    etcd_members: int = 1
    # Every client reaches etcd through a DelayLink (phalanx.chaos.link) whose latency the fault raises.
    etcd_link: bool = False
    # One of the workers runs in a network namespace of its own, joined to the rest by a veth pair (chaos.netns) that
    # a fault may cut; NATS, etcd, the stores, migration and the other workers then listen on the pair's root end.
    netns_worker: bool = False
    # The checkpoint store's settings (PHALANX_CHECKPOINT_*), e.g. a small memory limit so that it spills.
    store_env: tuple[tuple[str, str], ...] = ()
    # > 0: the store spills into a tmpfs of this many bytes, mounted for the run (ChaosRun.spill_disk; needs root).
    store_spill_disk_bytes: int = 0
    # Engine-failover slots (docs/failover.md), beside the workers: each a memory service sharing the weights, a primary
    # engine that serves and a shadow standing by.
    failover_slots: int = 0

    @property
    def worker_role(self) -> WorkerRole:
        return WorkerRole.ATTENTION if self.expert_workers else WorkerRole.MONOLITHIC

    @property
    def worker_flags(self) -> tuple[str, ...]:
        return self.worker_role.flags

    @property
    def fleet(self) -> Fleet:
        """The processes this topology runs, in the order ChaosRun starts them."""
        return Fleet(
            workers=(WorkerGroup(self.worker_role, self.workers),), failover_slots=self.failover_slots,
            expert_workers=self.expert_workers, expert_copies=EXPERT_COPIES if self.expert_workers else 1, encoders=self.encoders,
            checkpoint_stores=int(self.store), migrations=int(self.migration), routers=self.routers, gateways=int(self.gateway),
            healths=self.healths, planner=self.planner,
        )


@dataclass(frozen=True)
class LoadOptions:
    streams: int = 8
    max_tokens: int = 96
    fault_after: int = 8
    prompt_repeat: int = 3


@dataclass
class StreamRecord:
    """What one client saw of one stream: each chunk's index, token and arrival time, and how it failed if it did."""

    kind: str  # "sdk" or "http"
    request_id: str = ""  # an SDK stream's
    indices: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    times: list[float] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    error: str = ""
    retries: int = 0  # an HTTP client's retries from scratch (OpenAI streams cannot resume)
    finished: bool = False  # an HTTP stream saw its finish_reason

    @property
    def max_gap_s(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0.0)


@dataclass
class ScenarioResult:
    scenario: str
    description: str
    requests: int
    lost: int
    tokens_lost: int
    tokens_repeated: int
    identical_fraction: float
    stall_p99_s: float
    baseline_stall_p99_s: float
    recovery_s: float | None
    http_retries: int
    details: dict[str, Any]
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def false_verdicts(self) -> int | None:
        """Live workers whose lease lapsed or that health held as anything but HEALTHY while a fault that kills no
        worker ran (None where the run did not watch for them)."""
        if "workers_lapsed" not in self.details:
            return None
        return len(self.details["workers_lapsed"]) + len(self.details.get("workers_not_healthy", []))

    @property
    def passed(self) -> bool:
        """No request lost, every index once, identical outputs, back to full health, no healthy worker declared dead."""
        return (self.lost == 0 and self.tokens_lost == 0 and self.tokens_repeated == 0 and self.identical_fraction == 1.0
                and self.recovery_s is not None and not self.false_verdicts)


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 3)


class ChaosRun:
    """A live stack and its load; what a scenario's fault acts on."""

    def __init__(self, topology: Topology, load: LoadOptions) -> None:
        self.topology = topology
        self.load = load
        # nats-server and etcd die with the thread that started them (PR_SET_PDEATHSIG): one long-lived thread starts,
        # restarts and stops them, off the event loop that carries the streams.
        self._infra_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-infra")
        self.netns = VethNamespace() if topology.netns_worker else None
        self.namespaced: WorkerHandle | None = None
        self.nats = NatsServer(host=self.host)
        self.etcd: EtcdServer | EtcdCluster = (
            EtcdCluster(topology.etcd_members) if topology.etcd_members > 1 else EtcdServer(host=self.host)
        )
        self.link: DelayLink | None = None
        self.stack: Stack | None = None
        self.gateway: GatewayHandle | None = None
        self.planners: list[PlannerHandle] = []
        self.expert_slots: dict[str, int] = {}  # expert worker name -> its placement slot
        self.router_ports: list[int] = []
        self.progress: collections.Counter[int] = collections.Counter()
        self.served_by: dict[int, str] = {}
        self.request_ids: dict[int, str] = {}
        self.fault_at: float | None = None
        self.notes: dict[str, Any] = {}
        self._watches: list[asyncio.Future[None]] = []
        self.spill_disk: SmallDisk | None = None

    # -- infrastructure ---------------------------------------------------------------------------------------------
    async def infra(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._infra_thread, fn)

    @property
    def host(self) -> str:
        """Where the root namespace's services listen: loopback, or the root end of the veth pair."""
        return self.netns.root_address if self.netns is not None else "127.0.0.1"

    def _listen_env(self, variable: str) -> dict[str, str] | None:
        """``{variable: host}`` when services must be reachable from the namespaced worker; None (the default) otherwise."""
        return {variable: self.host} if self.netns is not None else None

    @property
    def netns_worker(self) -> WorkerHandle:
        """The worker in the network namespace (topology ``netns_worker``)."""
        assert self.namespaced is not None, "the topology has no namespaced worker"
        return self.namespaced

    @property
    def etcd_config(self) -> EtcdConfig:
        """What every service (and the harness) uses: through the link where there is one."""
        # The production default TTL: at 1 s, a loaded box's starved keepalives let live workers' leases lapse.
        endpoint = self.link.endpoint if self.link is not None else self.etcd.endpoint
        return EtcdConfig(endpoint=endpoint, lease_ttl_s=LEASE_TTL_S)

    @property
    def observer_etcd_config(self) -> EtcdConfig:
        """etcd itself, past any link: what the harness reads to see what etcd holds while the link is slow."""
        return EtcdConfig(endpoint=self.etcd.endpoint, lease_ttl_s=LEASE_TTL_S)

    @property
    def fleet(self) -> Stack:
        assert self.stack is not None, "the stack is not started"
        return self.stack

    @property
    def router_target(self) -> str:
        return "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in self.router_ports)

    async def start(self) -> None:
        """The topology's fleet, one process at a time in the fleet's order (a phase's workers together)."""
        if self.netns is not None:
            await asyncio.to_thread(self.netns.create)
        if self.topology.store_spill_disk_bytes:
            disk = SmallDisk(self.topology.store_spill_disk_bytes)
            await asyncio.to_thread(disk.mount)
            self.spill_disk = disk
        starts: dict[ProcessKind, Callable[[ProcessSpec], Awaitable[Any]]] = {
            ProcessKind.NATS: lambda _: self.infra(self.nats.start), ProcessKind.ETCD: lambda _: self._start_etcd(),
            ProcessKind.CHECKPOINT_STORE: lambda _: self.add_store(), ProcessKind.MIGRATION: lambda _: self.add_migration(),
            ProcessKind.ERT_MANAGER: lambda _: self.fleet.add_ert_manager(), ProcessKind.EXPERT_WORKER: self._start_expert_worker,
            ProcessKind.ENCODER: lambda _: self.add_encoder(), ProcessKind.WORKER: self._start_workers,
            ProcessKind.FAILOVER_SLOT: lambda _: self.fleet.add_failover_slot(), ProcessKind.ROUTER: self._start_router,
            ProcessKind.GATEWAY: lambda _: self._start_gateway(), ProcessKind.HEALTH: lambda _: self.add_health(),
            ProcessKind.PLANNER: lambda _: self.add_planner(),
        }
        for spec in self.topology.fleet.processes():
            await starts[spec.kind](spec)

    async def _start_etcd(self) -> None:
        """etcd (through a delay link if the topology says so), and the stack on it and NATS."""
        await self.infra(self.etcd.start)
        if self.topology.etcd_link:
            assert isinstance(self.etcd, EtcdServer), "a delay link fronts a single etcd member"
            self.link = DelayLink("127.0.0.1", self.etcd.port).start()
        self.stack = Stack(self.nats.url, self.etcd_config, model=MODEL)

    async def _start_expert_worker(self, spec: ProcessSpec) -> None:
        await self.add_expert_worker(spec.index)
        if spec.index == self.topology.expert_workers - 1:  # the attention workers start on a complete table
            await self._wait_ert_complete()

    async def _start_workers(self, spec: ProcessSpec) -> None:
        if spec.index == 0:  # every worker at once
            await self.add_workers(self.topology.workers)

    async def _start_router(self, spec: ProcessSpec) -> None:
        # A port of its own rather than 0, so that a restarted router comes back where the clients' target list points.
        router_id = f"r{spec.index}-{unique_id('chaos')}"
        router = await on_fresh_ports(lambda: self.fleet.add_router(port=free_port(), router_id=router_id))
        self.router_ports.append(int(router.address.rsplit(":", 1)[1]))

    async def _start_gateway(self) -> None:
        self.gateway = await start_gateway(self.router_target, name=unique_id("gateway"), timeout=START_TIMEOUT_S)

    async def add_workers(self, count: int) -> list[WorkerHandle]:
        """``count`` workers; with a namespaced worker in the topology, the first runs in the namespace unless one does."""
        fleet = self.fleet
        if self.netns is None or count < 1 or self.namespaced in fleet.workers:
            return await fleet.add_workers(count, *self.topology.worker_flags, env=self._listen_env("PHALANX_WORKER_HOST"))
        namespaced = start_worker(
            unique_id("w-netns"), fleet.nats_url, fleet.etcd_config, "--deterministic", *self.topology.worker_flags, model=fleet.model,
            env={"PHALANX_WORKER_HOST": self.netns.namespace_address}, prefix=self.netns.exec_prefix, timeout=START_TIMEOUT_S,
        )
        others = fleet.add_workers(count - 1, *self.topology.worker_flags, env=self._listen_env("PHALANX_WORKER_HOST"))
        worker, rest = await asyncio.gather(namespaced, others)
        fleet.workers.append(worker)
        self.namespaced = worker
        return [worker, *rest]

    async def add_store(self) -> CheckpointStoreHandle:
        env = dict(self.topology.store_env)
        if self.spill_disk is not None:
            env["PHALANX_CHECKPOINT_SPILL_DIR"] = str(self.spill_disk.path)
        env.update(self._listen_env("PHALANX_CHECKPOINT_HOST") or {})
        store = await start_checkpoint_store(unique_id("ckpt"), self.etcd_config, env=env, timeout=START_TIMEOUT_S)
        self.fleet.stores.append(store)
        return store

    async def add_migration(self) -> ServiceHandle:
        migration = await start_migration(unique_id("mig"), self.nats.url, self.etcd_config, env=self._listen_env("PHALANX_MIGRATION_HOST"),
                                          timeout=START_TIMEOUT_S)
        self.fleet.migrations.append(migration)
        return migration

    async def add_health(self) -> HealthHandle:
        health = await start_health(unique_id("h"), self.nats.url, self.etcd_config, env=HEALTH_ENV, timeout=START_TIMEOUT_S)
        self.fleet.healths.append(health)
        return health

    async def add_encoder(self) -> ServiceHandle:
        encoder = await start_encoder_pool(unique_id("enc"), self.etcd_config, timeout=START_TIMEOUT_S)
        self.fleet.encoders.append(encoder)
        return encoder

    async def add_expert_worker(self, index: int) -> ServiceHandle:
        """The expert worker of placement slot ``index`` (EXPERT_COPIES copies of each expert over the topology's EWs)."""
        expert = await start_expert_worker(
            unique_id(f"ew{index}"), self.etcd_config, model=MODEL, index=index, num_expert_workers=self.topology.expert_workers,
            copies=EXPERT_COPIES, timeout=START_TIMEOUT_S,
        )
        self.expert_slots[expert.name] = index
        self.fleet.expert_workers.append(expert)
        return expert

    async def _ert_complete(self) -> bool:
        """Whether the ERT in etcd lists exactly the live expert workers and covers every expert."""
        client = connect_etcd(self.etcd_config)
        try:
            held = await client.get(ERT_KEY.encode())
        finally:
            await client.close()
        if held is None:
            return False
        table = ExpertRoutingTable.from_proto(decode_json(held.value, expert_pb2.ExpertRoutingTable))
        return table.complete and set(table.workers) == {e.name for e in self.fleet.expert_workers}

    async def _wait_ert_complete(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not await self._ert_complete():
            if time.monotonic() > deadline:
                raise TimeoutError("the expert routing table never listed every expert worker")
            await asyncio.sleep(0.1)

    async def add_planner(self) -> PlannerHandle:
        planner = await start_planner(unique_id("planner"), self.etcd_config, env=PLANNER_ENV, timeout=START_TIMEOUT_S)
        self.planners.append(planner)
        return planner

    async def stop(self) -> None:
        """SIGTERM to every process at once (the verdict is in: nothing here is judged any more), then wait for each."""
        for watch in self._watches:
            watch.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        try:
            handles: list[ServiceHandle] = [*self.planners, *([self.gateway] if self.gateway else [])]
            if self.stack is not None:
                fleet = self.stack
                handles += [*fleet.healths, *fleet.routers, *fleet.migrations, *fleet.workers, *self.slot_engines, *fleet.stores,
                            *(slot.memory for slot in fleet.slots), *fleet.ert_managers, *fleet.expert_workers, *fleet.encoders]
            live = [h for h in handles if h.process.poll() is None]
            for handle in live:
                with contextlib.suppress(ProcessLookupError):
                    handle.process.send_signal(signal.SIGTERM)
            for handle in live:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(handle.terminate, 20)
            await self.infra(self.etcd.close)
            await self.infra(self.nats.close)
        finally:
            try:
                if self.link is not None:
                    self.link.close()
            finally:
                self._infra_thread.shutdown(wait=True)
            for slot in self.stack.slots if self.stack is not None else ():
                shutil.rmtree(slot.directory, ignore_errors=True)
            if self.netns is not None:  # after the processes that used it: never left behind, whatever failed
                await asyncio.to_thread(self.netns.close)
            if self.spill_disk is not None:
                await asyncio.to_thread(self.spill_disk.unmount)

    @property
    def slot_engines(self) -> list[FailoverEngineHandle]:
        return [engine for slot in self.fleet.slots for engine in slot.engines] if self.stack is not None else []

    # -- what faults use --------------------------------------------------------------------------------------------
    def watch(self, check: Awaitable[None]) -> None:
        """Run ``check`` (an observation of the fault's aftermath, which writes its findings to ``notes``) beside the load
        and the wait for full health, so that it delays neither; the verdict waits for it."""
        self._watches.append(asyncio.ensure_future(check))

    async def watches_done(self) -> None:
        await asyncio.gather(*self._watches)

    def mark_fault(self) -> None:
        if self.fault_at is None:
            self.fault_at = time.monotonic()

    def busiest_worker(self) -> WorkerHandle:
        """The live worker serving the most unfinished SDK streams (the first worker if none is known)."""
        unfinished = [w for i, w in self.served_by.items() if self.progress[i] < self.load.max_tokens - 4]
        live = [w for w in self.fleet.workers if w.process.poll() is None]
        counts = collections.Counter(w for w in unfinished if any(h.worker_id == w for h in live))
        if counts:
            busiest = counts.most_common(1)[0][0]
            return next(w for w in live if w.worker_id == busiest)
        return live[0]

    async def replace_worker(self, victim: WorkerHandle) -> WorkerHandle:
        """A new worker in place of ``victim`` (what a supervisor does after a crash)."""
        self.fleet.workers.remove(victim)
        (replacement,) = await self.add_workers(1)
        return replacement

    async def replace(self, handles: list, victim: ServiceHandle, start: Callable[[], Awaitable[Any]]) -> Any:
        """Drop ``victim`` from ``handles`` and start its replacement with ``start`` (which adds it to the stack)."""
        handles.remove(victim)
        return await start()

    async def restart_router(self, router: RouterHandle) -> RouterHandle:
        """``router`` again on its port (its address is what clients hold), under its id."""
        port = int(router.address.rsplit(":", 1)[1])
        self.fleet.routers.remove(router)
        return await self.fleet.add_router(port=port, router_id=router.router_id)

    async def restart_gateway(self) -> GatewayHandle:
        assert self.gateway is not None
        port = int(self.gateway.address.rsplit(":", 1)[1])
        self.gateway = await start_gateway(self.router_target, name=unique_id("gateway"), port=port, timeout=START_TIMEOUT_S)
        return self.gateway

    async def health_leader(self) -> tuple[Any, list[str]]:
        """The health instance that leads, and every instance's idea of the leader (two leaders: split brain)."""
        leaders, views = None, []
        for handle in self.fleet.healths:
            if handle.process.poll() is not None:
                continue
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await handle.list_health(timeout=2.0)
                views.append(reply.leader_id)
                if reply.leader:
                    if leaders is not None:
                        raise AssertionError("split brain: two health instances say they lead")
                    leaders = reply
        return leaders, views

    @contextlib.asynccontextmanager
    async def false_verdict_watch(self) -> AsyncIterator[None]:
        """While inside: which live workers' keys vanished from etcd, and which the health leader held as anything but
        HEALTHY (``workers_lapsed``, ``workers_not_healthy`` in the notes). For faults that kill no worker (etcd slow,
        an etcd member lost), both must stay empty: a healthy worker must not be declared dead because etcd is slow.
        etcd is read past any link, so that the watch sees what etcd holds, not the slowness it is judging."""
        stop = asyncio.Event()
        lapsed: set[str] = set()
        not_healthy: set[str] = set()
        leaders: list[str] = []  # each health leader seen, in order (a change: a new leader was elected)

        async def poll() -> None:
            directory = WorkerDirectory(self.observer_etcd_config)
            try:
                while not stop.is_set():
                    live = {w.worker_id for w in self.fleet.workers if w.process.poll() is None}
                    with contextlib.suppress(Exception):
                        listed = await directory.list()
                        lapsed.update(live - set(listed))
                    try:
                        leader, _ = await self.health_leader()
                    except AssertionError:
                        self.notes["split_brain_seen"] = True
                        leader = None
                    except Exception:  # noqa: BLE001 - an instance that does not answer this round is looked at next round
                        leader = None
                    if leader is not None and (not leaders or leaders[-1] != leader.leader_id):
                        leaders.append(leader.leader_id)
                    for record in leader.workers if leader is not None else ():
                        if record.worker_id in live and record.health != common_pb2.WORKER_HEALTH_HEALTHY:
                            not_healthy.add(f"{record.worker_id}:{common_pb2.WorkerHealth.Name(record.health)}")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.25)
            finally:
                await directory.close()

        task = asyncio.create_task(poll())
        try:
            yield
        finally:
            stop.set()
            await task
            self.notes["workers_lapsed"] = sorted(lapsed)
            self.notes["workers_not_healthy"] = sorted(not_healthy)
            self.notes["health_leader_changes"] = max(0, len(leaders) - 1)

    # -- full health ------------------------------------------------------------------------------------------------
    async def unhealthy_reason(self) -> str | None:
        """Why the stack is not at full health yet; None once it is (every process up and registered, every worker
        HEALTHY with weight 1 at the one health leader)."""
        if not (self.nats.running and self.etcd.running):
            return "nats or etcd (a member of it) is down"
        if self.link is not None and self.link.delay_s > 0:
            return "the etcd link is still slow"
        t, fleet = self.topology, self.fleet
        processes = [*fleet.workers, *fleet.routers, *fleet.healths, *fleet.stores, *fleet.migrations, *self.planners, *fleet.encoders,
                     *fleet.expert_workers, *fleet.ert_managers, *(slot.memory for slot in fleet.slots), *self.slot_engines]
        if dead := [h.name for h in processes if h.process.poll() is not None]:
            return f"dead processes still in the stack: {dead}"
        if len(fleet.workers) != t.workers or len(fleet.routers) != t.routers or len(fleet.healths) != t.healths:
            return "a replacement is still starting"
        config = self.etcd_config
        directories: list[tuple[str, EtcdDirectory, list[ServiceHandle]]] = [
            ("workers", WorkerDirectory(config), list(fleet.workers)),
            ("routers", EtcdDirectory(config, prefix=ROUTERS_PREFIX, message_type=common_pb2.RouterRegistration), list(fleet.routers)),
            ("stores", CheckpointStoreDirectory(config), list(fleet.stores)),
            ("migration", MigrationDirectory(config), list(fleet.migrations)),
            ("encoders", EncoderDirectory(config), list(fleet.encoders)),
            ("expert workers", ExpertWorkerDirectory(config), list(fleet.expert_workers)),
        ]
        for name, directory, handles in directories:
            try:
                entries = await directory.list()
            finally:
                await directory.close()
            missing = [h.name for h in handles if h.name not in entries or entries[h.name].pid != h.process.pid]
            if missing:
                return f"{name} not registered: {missing}"
        active: list[WorkerHandle] = []
        for slot in fleet.slots:
            states = {e.worker_id: await asyncio.to_thread(e.failover_state) for e in slot.engines}
            serving = [e for e in slot.engines if states[e.worker_id] == "active"]
            if len(serving) != 1 or "standby" not in states.values():
                return f"failover slot {slot.name} is not one active engine and a standby: {states}"
            active += serving
        directory = WorkerDirectory(config)
        try:
            entries = await directory.list()
        finally:
            await directory.close()
        if missing := [e.worker_id for e in active if e.worker_id not in entries or entries[e.worker_id].pid != e.process.pid]:
            return f"active failover engines not registered: {missing}"
        if t.expert_workers and not await self._ert_complete():
            return "the expert routing table does not list every live expert worker"
        if self.gateway is not None and not await asyncio.to_thread(self.gateway.healthy):
            return "the gateway does not answer /health"
        if t.healths:
            leader, views = await self.health_leader()
            if leader is None:
                return "no health leader"
            if len(set(views)) > 1:
                return f"health instances disagree on the leader: {views}"
            records = {r.worker_id: r for r in leader.workers}
            for worker in [*fleet.workers, *active]:
                record = records.get(worker.worker_id)
                if record is None or record.health != common_pb2.WORKER_HEALTH_HEALTHY or record.routing_weight != 1.0:
                    state = "unknown" if record is None else common_pb2.WorkerHealth.Name(record.health)
                    return f"worker {worker.worker_id} is {state} at the health leader"
        return None

    async def wait_full_health(self, timeout: float) -> float | None:
        """Seconds from the fault to full health (None if not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        reason: str | None = "not checked"
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                reason = await self.unhealthy_reason()
            if reason is None:
                return round(time.monotonic() - (self.fault_at or time.monotonic()), 2)
            await asyncio.sleep(0.25)
        self.notes["not_healthy"] = reason
        return None

    # -- load -------------------------------------------------------------------------------------------------------
    def prompts(self) -> list[str]:
        line = "Stream {i} of the chaos run: tell the long story of the keeper of lighthouse {i} through the winter storm. "
        return [line.format(i=i) * self.load.prompt_repeat for i in range(self.load.streams)]

    async def _sdk_stream(self, client: Client, i: int, prompt: str, record: StreamRecord, track: bool) -> None:
        stream = client.generate(prompt, max_tokens=self.load.max_tokens, ignore_eos=True)
        record.request_id = stream.request_id
        if track:
            self.request_ids[i] = stream.request_id
        async for chunk in stream:
            record.times.append(time.monotonic())
            record.indices.append(chunk.index)
            record.tokens.append(chunk.token_id)
            record.workers.append(chunk.worker_id)
            if track:
                self.served_by[i] = chunk.worker_id
                self.progress[i] += 1

    async def _http_stream(self, prompt: str, record: StreamRecord) -> None:
        """One OpenAI streaming completion; a broken connection is retried from scratch, as an OpenAI client does."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.load.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        for attempt in itertools.count():
            gateway = self.gateway
            assert gateway is not None
            record.text, record.times, record.finished = "", [], False
            try:
                async with httpx.AsyncClient(base_url=gateway.url, timeout=httpx.Timeout(60.0)) as http:
                    async with http.stream("POST", "/v1/completions", json=body) as reply:
                        reply.raise_for_status()
                        async for line in reply.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            data = json.loads(line[6:])
                            if "error" in data:  # the gateway gave up mid-stream: the client got an error, not a completion
                                raise _GatewayStreamError(str(data["error"])[:200])
                            for choice in data.get("choices", []):
                                record.text += choice.get("text", "")
                                record.times.append(time.monotonic())
                                record.finished = record.finished or bool(choice.get("finish_reason"))
                return
            except (httpx.HTTPError, json.JSONDecodeError):
                if attempt >= 20:
                    raise
                record.retries += 1
                await asyncio.sleep(0.5)

    async def wave(self, client: Client, *, track: bool) -> list[StreamRecord]:
        """Every prompt as an SDK stream, and prompt 0 through the gateway too; errors are kept, not raised."""

        async def guarded(record: StreamRecord, work: Awaitable[None]) -> StreamRecord:
            try:
                await asyncio.wait_for(work, STREAM_TIMEOUT_S)
            except (PhalanxClientError, grpc.aio.AioRpcError, httpx.HTTPError, TimeoutError, _GatewayStreamError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"[:300]
            return record

        prompts = self.prompts()
        records = [StreamRecord("sdk") for _ in prompts]
        tasks = [guarded(r, self._sdk_stream(client, i, p, r, track)) for i, (p, r) in enumerate(zip(prompts, records, strict=True))]
        if self.gateway is not None:
            http = StreamRecord("http")
            records.append(http)
            tasks.append(guarded(http, self._http_stream(prompts[0], http)))
        return list(await asyncio.gather(*tasks))

    async def wait_progress(self, tokens: int) -> None:
        """Until every SDK stream has ``tokens`` tokens."""
        while min((self.progress[i] for i in range(self.load.streams)), default=0) < tokens:
            await asyncio.sleep(0.01)


Fault = Callable[[ChaosRun], Awaitable[None]]


class _GatewayStreamError(Exception):
    """The gateway ended a streamed completion with an error event."""


def _verdict(name: str, description: str, baseline: list[StreamRecord], faulted: list[StreamRecord], recovery_s: float | None,
             run: ChaosRun, wall_s: float) -> ScenarioResult:
    n = run.load.max_tokens
    lost = tokens_lost = repeated = identical = 0
    for before, after in zip(baseline, faulted, strict=True):
        counts = collections.Counter(after.indices)
        if after.kind == "sdk":
            tokens_lost += sum(1 for index in range(n) if counts[index] == 0)
            repeated += sum(c - 1 for c in counts.values() if c > 1)
            complete = not after.error and sorted(counts) == list(range(n))
            same = after.tokens == before.tokens and after.indices == list(range(n))
        else:
            complete = not after.error and after.finished
            same = complete and after.text == before.text
        lost += not complete
        identical += same
    moved = sum(1 for r in faulted if r.kind == "sdk" and len(set(r.workers)) > 1)
    fence = run.notes.pop("fenced_from", None)
    if fence is not None:
        # Tokens a fenced worker (its requests moved while it hung) delivered after it ran again: must be none.
        victim, resumed_at = fence
        run.notes["tokens_after_fence"] = sum(
            1 for r in faulted if r.kind == "sdk" for worker, at in zip(r.workers, r.times, strict=True) if worker == victim and at >= resumed_at
        )
    return ScenarioResult(
        scenario=name, description=description, requests=len(faulted), lost=lost, tokens_lost=tokens_lost, tokens_repeated=repeated,
        identical_fraction=round(identical / len(faulted), 3), stall_p99_s=_p99([r.max_gap_s for r in faulted]),
        baseline_stall_p99_s=_p99([r.max_gap_s for r in baseline]), recovery_s=recovery_s,
        http_retries=sum(r.retries for r in faulted),
        details={"streams_moved": moved, "errors": [r.error for r in faulted if r.error][:5], **run.notes},
        wall_s=round(wall_s, 1),
    )


async def run_scenario(name: str, description: str, topology: Topology, fault: Fault, load: LoadOptions | None = None) -> ScenarioResult:
    """Start the stack, run the baseline, run the load with ``fault``, wait for full health, stop everything."""
    started = time.monotonic()
    load = load or LoadOptions()
    run = ChaosRun(topology, load)
    try:
        phases: dict[str, float] = {}
        run.notes["phases_s"] = phases
        await run.start()
        phases["start"] = round(time.monotonic() - started, 1)
        retry = RetryPolicy(max_attempts=topology.sdk_max_attempts)
        async with await Client.connect(run.router_target, timeout=STREAM_TIMEOUT_S, retry=retry) as client:
            if await run.wait_full_health(RECOVERY_TIMEOUT_S) is None:
                raise RuntimeError(f"the fresh stack never reached full health: {run.notes.get('not_healthy')}")
            run.fault_at = None
            phases["healthy"] = round(time.monotonic() - started, 1)
            baseline = await run.wave(client, track=False)
            phases["baseline"] = round(time.monotonic() - started, 1)
            if failed := [r.error for r in baseline if r.error]:
                raise RuntimeError(f"the fault-free run failed: {failed[0]}")

            fired = asyncio.Event()

            async def inject() -> float | None:
                """The fault, then the wait for full health, polled while the load still runs."""
                await run.wait_progress(load.fault_after)
                fired.set()
                await fault(run)
                run.mark_fault()
                recovered = await run.wait_full_health(RECOVERY_TIMEOUT_S)
                phases["recovered"] = round(time.monotonic() - started, 1)
                return recovered

            injecting = asyncio.ensure_future(inject())
            faulted = await run.wave(client, track=True)
            phases["faulted"] = round(time.monotonic() - started, 1)
            recovery_s = None
            if fired.is_set():
                recovery_s = await injecting
                await run.watches_done()
            else:  # the streams ended before the fault was due: there is no fault to wait for
                injecting.cancel()
                await asyncio.gather(injecting, return_exceptions=True)
                run.notes["fault_not_injected"] = True
        return _verdict(name, description, baseline, faulted, recovery_s, run, time.monotonic() - started)
    finally:
        await run.stop()
