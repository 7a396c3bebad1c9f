"""Starts real service processes (python -m phalanx.cli …) against a NATS and an etcd, each returned once it serves.

Used by ``phalanx up``, the benchmarks and the test suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from prometheus_client.parser import text_string_to_metric_families

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, common_pb2, health_pb2, health_pb2_grpc
from phalanx.common.children import pdeathsig_preexec
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import (
    CheckpointStoreDirectory,
    EncoderDirectory,
    EtcdDirectory,
    ExpertWorkerDirectory,
    MigrationDirectory,
    WorkerDirectory,
)
from phalanx.common.lease import TRANSIENT_ERRORS
from phalanx.common.subjects import ROUTERS_PREFIX
from phalanx.common.tls import open_channel
from phalanx.launch.fork_server import ForkServer
from phalanx.launch.ports import free_port

__all__ = [
    "CheckpointStoreHandle",
    "ExitedBeforeServing",
    "FailoverEngineHandle",
    "GatewayHandle",
    "HealthHandle",
    "PlannerHandle",
    "RouterHandle",
    "ServiceHandle",
    "WorkerHandle",
    "metric_value",
    "on_fresh_ports",
    "scrape",
    "start_checkpoint_store",
    "start_failover_engine",
    "start_ert_manager",
    "start_expert_worker",
    "start_encoder_pool",
    "start_gateway",
    "start_health",
    "start_memory_service",
    "start_migration",
    "start_planner",
    "start_router",
    "start_worker",
    "use_certs",
    "use_fork_server",
    "wait_registered",
]


def scrape(metrics_address: str) -> str:
    """The Prometheus exposition text at ``metrics_address`` (host:port)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as reply:
        return reply.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of exposition ``text`` called ``name`` whose labels include ``labels``; None if there is none."""
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    return sum(values) if values else None


class ServiceHandle:
    """A service process we started, stopped by its PID only."""

    def __init__(self, name: str, process: subprocess.Popen, address: str, metrics_address: str = "") -> None:
        self.name = name
        self.process = process
        self.address = address
        self.metrics_address = metrics_address

    def metrics(self) -> str:
        """The process's Prometheus exposition text."""
        return scrape(self.metrics_address)

    def metric(self, name: str, **labels: str) -> float | None:
        """Sum of the samples called ``name`` (e.g. ``x_total``) whose labels include ``labels``; None if there is none."""
        return metric_value(self.metrics(), name, **labels)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.process.returncode


class WorkerHandle(ServiceHandle):
    @property
    def worker_id(self) -> str:
        return self.name

    def follower_pids(self) -> list[int]:
        """PIDs of the tensor-parallel follower ranks this worker started (its children running phalanx.worker.tp_follower)."""
        return self._children_running(b"phalanx.worker.tp_follower")

    def engine_process_pids(self) -> list[int]:
        """PID of the engine process this worker started (engine_core.py), if it runs its engine in one: [] or [pid]."""
        return self._children_running(b"phalanx.worker.engine_core")

    def _children_running(self, module: bytes) -> list[int]:
        pids = []
        for children in Path(f"/proc/{self.process.pid}/task").glob("*/children"):
            for pid in children.read_text().split():
                with contextlib.suppress(OSError):
                    if module in Path(f"/proc/{pid}/cmdline").read_bytes():
                        pids.append(int(pid))
        return sorted(pids)


class FailoverEngineHandle(WorkerHandle):
    """An engine of a failover slot: a worker that may be standing by (not registered yet), with its HTTP probes."""

    role = ""  # the role it was started in: primary or shadow

    def failover_state(self) -> str:
        """init, standby, waking, active or dead (its /metrics' phalanx_failover_state); "gone" if it does not answer."""
        try:
            value = self.metric("phalanx_failover_state")
        except (urllib.error.URLError, OSError):
            return "gone"
        names = ("init", "standby", "waking", "active", "dead")
        return names[int(value)] if value is not None and 0 <= int(value) < len(names) else "gone"

    def probe(self, name: str) -> int | None:
        """The status of /startup, /live or /ready; None if the port refuses (the process is gone or not listening yet)."""
        try:
            with urllib.request.urlopen(f"http://{self.metrics_address}/{name}", timeout=2) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as error:
            return int(error.code)
        except (urllib.error.URLError, OSError):
            return None

    def memory_kib(self) -> dict[str, int]:
        """/proc/PID/smaps_rollup in KiB (Rss, Pss, Shared_Clean, Private_Dirty …)."""
        fields = {}
        for line in Path(f"/proc/{self.process.pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
        return fields


class RouterHandle(ServiceHandle):
    @property
    def router_id(self) -> str:
        return self.name


class HealthHandle(ServiceHandle):
    @property
    def instance_id(self) -> str:
        return self.name

    async def list_health(self, timeout: float = 2.0) -> health_pb2.ListWorkerHealthResponse:
        async with open_channel(self.address) as channel:
            return await health_pb2_grpc.HealthServiceStub(channel).ListWorkerHealth(health_pb2.ListWorkerHealthRequest(), timeout=timeout)


_certs_root: Path | None = None
_control_plane_tls: tuple[str, ...] = ()


def use_certs(root: str | os.PathLike[str] | None, *, etcd: bool = False, nats: bool = False) -> None:
    """Start every later service with mutual TLS: ``PHALANX_TLS_DIR=<root>/<command>`` (the layout of ``phalanx certs init``,
    one identity per service command: worker, router, health ...), unless its env names one; None: as the environment says.

    ``etcd``/``nats``: the same identity's directory for its connection to etcd / NATS too (``PHALANX_ETCD_TLS_DIR``,
    ``PHALANX_NATS_TLS_DIR``): servers that want client certificates of the same CA.
    """
    global _certs_root, _control_plane_tls
    _certs_root = Path(root) if root is not None else None
    _control_plane_tls = tuple(name for name, wanted in (("ETCD", etcd), ("NATS", nats)) if wanted and root is not None)


# glibc's malloc backs its heap with transparent huge pages (madvise; THP "madvise" or "always" in the kernel). A
# SIGKILLed process's sockets close only after the kernel has unmapped its memory, and 2 MiB pages unmap in far fewer
# steps: measured 2026-11-26 (CPU of the kill-to-reaped exit path, load-independent), a tiny-MoE attention worker 17 ->
# 12 ms, a process holding 1 GiB of torch tensors 66 -> 20 ms, 2 GiB 106 -> 31 ms. On a busy host that CPU time
# stretches several-fold before peers see the death (docs/migration.md, "How fast a dead worker is seen").
_HUGE_PAGE_HEAP = "glibc.malloc.hugetlb=1"
_HUGE_PAGE_COMMANDS = frozenset({"worker", "expert-worker"})


# The program every service process runs (``python -m phalanx.cli ARGS``): named, never imported, here.
COMMAND_MODULE = "phalanx.cli"
_fork_server: ForkServer | None = None


def use_fork_server(preload: Sequence[str] | None) -> ForkServer | None:
    """Fork every later worker process from a server that has imported ``preload`` (phalanx.launch.fork_server), while
    it is ready; spawn it otherwise. Starts the server (call from a long-lived thread) and makes this process a child
    subreaper; None: spawn every worker, and stop the server if one runs. Returns the server: its process is the
    caller's to watch, and to start again with ``server.start()`` when it dies."""
    global _fork_server
    if _fork_server is not None:
        _fork_server.close()
        _fork_server = None
    if preload is None:
        return None
    # The server's own environment is a worker's (what glibc reads at start-up, for one): its children inherit it.
    _fork_server = ForkServer(preload, env=_with_huge_page_heap({}), main=COMMAND_MODULE)
    _fork_server.start()
    return _fork_server


def _with_huge_page_heap(env: dict[str, str]) -> dict[str, str]:
    """``env`` with glibc's huge-page heap tunable added to GLIBC_TUNABLES (the process's own or its parent's), unless
    that names a ``glibc.malloc.hugetlb`` of its own."""
    tunables = env.get("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES", ""))
    if "glibc.malloc.hugetlb" in tunables:
        return env
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{_HUGE_PAGE_HEAP}" if tunables else _HUGE_PAGE_HEAP}


def _etcd_env(etcd_config: EtcdConfig) -> dict[str, str]:
    """The child's etcd settings that its command line does not carry: the lease TTL and the TLS files."""
    return {"PHALANX_ETCD_LEASE_TTL_S": str(etcd_config.lease_ttl_s), **etcd_config.tls_env()}


def _spawn(args: list[str], env: dict[str, str], prefix: Sequence[str] = ()) -> subprocess.Popen:
    """``python -m phalanx.cli ARGS``, run through ``prefix`` if given (a command that execs the rest, e.g. ``ip netns
    exec NS``, so that the PID is the service's own). A worker without a prefix is forked from the fork server instead,
    while one is in use and ready (``use_fork_server``)."""
    if _certs_root is not None and "PHALANX_TLS_DIR" not in env:
        own = str(_certs_root / args[0])
        env = {**env, "PHALANX_TLS_DIR": own, **{f"PHALANX_{server}_TLS_DIR": own for server in _control_plane_tls}}
    if args[0] in _HUGE_PAGE_COMMANDS:  # the processes whose death other processes wait to see
        env = _with_huge_page_heap(env)
    if args[0] == "worker" and not prefix and _fork_server is not None:
        forked = _fork_server.spawn(args, {**os.environ, **env})
        if forked is not None:
            return forked
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", COMMAND_MODULE, *args],
        env={**os.environ, **env},
        start_new_session=True,
        preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509 - only prctl; dies with us: no orphans if we are SIGKILLed
    )


# Starts tried by a launcher that picks a port for its service (free_port's race with other processes).
_PORT_ATTEMPTS = 3


class ExitedBeforeServing(RuntimeError):
    """A started process exited before it served (on a port it was given, most often: another process took it first)."""


_Started = TypeVar("_Started")


async def on_fresh_ports(start_once: Callable[[], Awaitable[_Started]]) -> _Started:
    """``start_once()``, tried again (it picks new ports each time) while its process exits before serving.

    free_port's port is free only a moment ago: a process of another test or service may bind it before ours does, and ours
    then exits on EADDRINUSE (CI saw it for a health service's metrics port and a migration service's)."""
    for _ in range(_PORT_ATTEMPTS - 1):
        with contextlib.suppress(ExitedBeforeServing):
            return await start_once()
    return await start_once()


async def _registration(process: subprocess.Popen, directory: EtcdDirectory, name: str, timeout: float):
    """Wait until ``process`` registered ``name`` (a previous holder of the name may linger until its lease lapses)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ExitedBeforeServing(f"{name} exited with {process.returncode} before registering")
            try:
                entries = await directory.list()
            except TRANSIENT_ERRORS:
                entries = {}  # an etcd slow to answer on a loaded host: asked again until the deadline
            if name in entries and entries[name].pid == process.pid:
                return entries[name]
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{name} did not register within {timeout:.0f} s")
    except BaseException:
        with contextlib.suppress(Exception):
            process.kill()
            process.wait(5)
        raise
    finally:
        await directory.close()


async def start_worker(
    worker_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, model: str, env: dict | None = None, tensor_parallel_size: int = 1,
    timeout: float = 60.0, prefix: Sequence[str] = (),
) -> WorkerHandle:
    """A worker process of ``model``, returned once it registered (model loaded, serving; with its follower ranks, if tensor-parallel).

    The model is named on every start: the worker's own default is a real model that takes seconds to load. ``prefix``
    runs it through a command that execs it (``ip netns exec NS``: a worker in a network namespace, docs/chaos.md).
    """
    process = _spawn(
        ["worker", "--worker-id", worker_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", "0",
         "--model", model, "--log-level", "WARNING",
         *(("--tensor-parallel-size", str(tensor_parallel_size)) if tensor_parallel_size != 1 else ()), *extra],
        {**_etcd_env(etcd_config), **(env or {})},
        prefix,
    )
    registration = await _registration(process, WorkerDirectory(etcd_config), worker_id, timeout)
    return WorkerHandle(worker_id, process, registration.address, registration.metrics_address)


async def start_memory_service(socket_path: str, root: str, *, name: str = "memory", timeout: float = 30.0) -> ServiceHandle:
    """A weight memory service (``phalanx memory-service``), returned once its socket is open; ``address`` is the socket,
    ``metrics_address`` its /metrics (grant counts)."""

    async def start_once() -> ServiceHandle:
        metrics_port = free_port()
        # A SIGKILLed predecessor leaves its socket file behind: it must not pass for this one's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        process = _spawn(["memory-service", "--socket-path", socket_path, "--root", root, "--port", "0", "--log-level", "WARNING"],
                         {"PHALANX_MEMORY_METRICS_PORT": str(metrics_port)})
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(os.path.exists, socket_path):  # it binds /metrics before it opens the socket
            if process.poll() is not None:
                raise ExitedBeforeServing(f"{name} exited with {process.returncode} before it opened {socket_path}")
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError(f"{name} did not open {socket_path} within {timeout:.0f} s")
            await asyncio.sleep(0.02)
        return ServiceHandle(name, process, socket_path, f"127.0.0.1:{metrics_port}")

    return await on_fresh_ports(start_once)


async def start_failover_engine(
    worker_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, model: str, role: str, engine_id: int, lock: str,
    memory_socket: str, slot: str, env: dict | None = None, timeout: float = 60.0, wait_startup: bool = True,
) -> FailoverEngineHandle:
    """An engine of a failover slot, returned once its startup probe passes (standing by, or further); without
    ``wait_startup`` once its probes answer at all."""

    async def start_once() -> FailoverEngineHandle:
        metrics_port = free_port()
        process = _spawn(
            ["worker", "--worker-id", worker_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", "0",
             "--metrics-port", str(metrics_port), "--model", model, "--log-level", "WARNING", "--failover-role", role,
             "--engine-id", str(engine_id), "--failover-lock", lock, "--memory-socket", memory_socket, "--failover-slot", slot, *extra],
            {**_etcd_env(etcd_config), **(env or {})},
        )
        handle = FailoverEngineHandle(worker_id, process, "", f"127.0.0.1:{metrics_port}")
        handle.role = role
        deadline = time.monotonic() + timeout
        try:
            while await asyncio.to_thread(handle.probe, "startup") not in ((200,) if wait_startup else (200, 503)):
                if process.poll() is not None:
                    raise ExitedBeforeServing(f"{worker_id} exited with {process.returncode} before it stood by")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{worker_id} did not pass its startup probe within {timeout:.0f} s")
                await asyncio.sleep(0.05)
        except BaseException:
            handle.kill()
            raise
        return handle

    return await on_fresh_ports(start_once)


async def wait_registered(handle: WorkerHandle, etcd_config: EtcdConfig, timeout: float = 30.0) -> common_pb2.WorkerRegistration:
    """``handle``'s registration once it is in etcd (its address and metrics address filled in on the handle)."""
    directory = WorkerDirectory(etcd_config)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if handle.process.poll() is not None:
                raise ExitedBeforeServing(f"{handle.name} exited with {handle.process.returncode} before registering")
            entry = (await directory.list()).get(handle.name)
            if entry is not None and entry.pid == handle.process.pid:
                handle.address = entry.address
                return entry
            if time.monotonic() > deadline:
                raise TimeoutError(f"{handle.name} did not register within {timeout:.0f} s")
            await asyncio.sleep(0.02)
    finally:
        await directory.close()


async def start_router(
    router_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, port: int = 0, env: dict | None = None
) -> RouterHandle:
    """A router process, returned once it registered (index built, SERVING)."""
    process = _spawn(
        ["router", "--router-id", router_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", str(port),
         "--log-level", "WARNING", *extra],
        {**_etcd_env(etcd_config), **(env or {})},
    )
    directory = EtcdDirectory(etcd_config, prefix=ROUTERS_PREFIX, message_type=common_pb2.RouterRegistration)
    registration = await _registration(process, directory, router_id, 60)
    return RouterHandle(router_id, process, registration.address, registration.metrics_address)


async def start_health(
    instance_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None, timeout: float = 30.0
) -> HealthHandle:
    """A health service instance, returned once it answers (leader or standby)."""

    async def start_once() -> HealthHandle:
        port, metrics_port = free_port(), free_port()
        process = _spawn(
            ["health", "--instance-id", instance_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", str(port),
             "--log-level", "WARNING", *extra],
            {"PHALANX_HEALTH_METRICS_PORT": str(metrics_port), **(env or {})},
        )
        handle = HealthHandle(instance_id, process, f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}")
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise ExitedBeforeServing(f"{instance_id} exited with {process.returncode} before it served")
            try:
                await handle.list_health(timeout=1.0)
                return handle
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    handle.kill()
                    raise TimeoutError(f"{instance_id} did not serve within {timeout:.0f} s") from None
                await asyncio.sleep(0.1)

    return await on_fresh_ports(start_once)


class PlannerHandle(ServiceHandle):
    """A planner process; its interface is etcd (decisions, acknowledgements) and /metrics."""

    async def serving(self, timeout: float = 1.0) -> bool:
        from grpc_health.v1 import health_pb2 as grpc_health_pb2, health_pb2_grpc as grpc_health_pb2_grpc

        async with open_channel(self.address) as channel:
            reply = await grpc_health_pb2_grpc.HealthStub(channel).Check(grpc_health_pb2.HealthCheckRequest(), timeout=timeout)
        return reply.status == grpc_health_pb2.HealthCheckResponse.SERVING


async def start_planner(
    instance_id: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None, timeout: float = 30.0
) -> PlannerHandle:
    """A planner (``phalanx planner``), returned once its gRPC health says SERVING (it then campaigns, decides once ready).

    ``extra`` are more CLI flags; ``env`` more PHALANX_PLANNER_* settings (interval, bounds, profile).
    """

    async def start_once() -> PlannerHandle:
        port, metrics_port = free_port(), free_port()
        process = _spawn(
            ["planner", "--instance-id", instance_id, "--etcd-endpoint", etcd_config.endpoint, "--port", str(port), "--log-level",
             "INFO", *extra],
            {"PHALANX_PLANNER_METRICS_PORT": str(metrics_port), **(env or {})},
        )
        return await _serving(PlannerHandle(instance_id, process, f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}"), timeout)

    return await on_fresh_ports(start_once)


async def _serving(handle: PlannerHandle, timeout: float) -> PlannerHandle:
    """``handle`` once its gRPC health says SERVING; killed if it exits or does not serve within ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            if handle.process.poll() is not None:
                raise ExitedBeforeServing(f"{handle.name} exited with {handle.process.returncode} before it served")
            with contextlib.suppress(grpc.aio.AioRpcError):
                if await handle.serving():
                    return handle
            if time.monotonic() > deadline:
                raise TimeoutError(f"{handle.name} did not serve within {timeout:.0f} s")
            await asyncio.sleep(0.1)
    except BaseException:
        handle.kill()
        raise


class CheckpointStoreHandle(ServiceHandle):
    """A checkpoint store process; ``advertisement`` is the CheckpointStoreRegistration it put in etcd."""

    def __init__(self, name: str, process: subprocess.Popen, advertisement) -> None:
        super().__init__(name, process, advertisement.address, advertisement.metrics_address)
        self.advertisement = advertisement

    @property
    def store_id(self) -> str:
        return self.name

    @property
    def channel_endpoint(self) -> str:
        """Id of the store's tensor-channel endpoint (what SendKv sends from)."""
        return self.advertisement.channel_endpoint

    async def stats(self, timeout: float = 2.0):
        async with open_channel(self.address) as channel:
            return await checkpoint_pb2_grpc.CheckpointStoreStub(channel).Stats(checkpoint_pb2.StatsRequest(), timeout=timeout)

    async def list_commits(self, worker_id: str = "", timeout: float = 2.0):
        """The commit records the store holds for ``worker_id`` (every one if empty)."""
        async with open_channel(self.address) as channel:
            stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
            return list((await stub.ListCommits(checkpoint_pb2.ListCommitsRequest(worker_id=worker_id), timeout=timeout)).commits)

    async def get_commit(self, request_id: str, timeout: float = 2.0):
        async with open_channel(self.address) as channel:
            stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
            return (await stub.GetCommit(checkpoint_pb2.GetCommitRequest(request_id=request_id), timeout=timeout)).commit


async def start_checkpoint_store(
    store_id: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None, timeout: float = 30.0
) -> CheckpointStoreHandle:
    """A checkpoint store process (``phalanx checkpoint-store``), returned once it advertised itself in etcd (SERVING).

    ``extra`` are more CLI flags (e.g. ``--memory-limit-bytes``); ``env`` more PHALANX_CHECKPOINT_* settings.
    """
    process = _spawn(
        ["checkpoint-store", "--store-id", store_id, "--etcd-endpoint", etcd_config.endpoint, "--port", "0", "--log-level", "WARNING",
         *extra],
        {**_etcd_env(etcd_config), **(env or {})},
    )
    advertisement = await _registration(process, CheckpointStoreDirectory(etcd_config), store_id, timeout)
    return CheckpointStoreHandle(store_id, process, advertisement)


async def start_migration(
    instance_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None, timeout: float = 30.0
) -> ServiceHandle:
    """A migration service (``phalanx migration``), returned once it advertised itself in etcd.

    Its registration carries no metrics address, so its metrics port is chosen here: a port free a moment ago, which another
    process may take first (a fuzz run's migration service exited on EADDRINUSE): on_fresh_ports tries again."""

    async def start_once() -> ServiceHandle:
        metrics_port = free_port()
        process = _spawn(
            ["migration", "--migration-id", instance_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", "0",
             "--log-level", "WARNING", *extra],
            {**_etcd_env(etcd_config), "PHALANX_MIGRATION_METRICS_PORT": str(metrics_port), **(env or {})},
        )
        advertisement = await _registration(process, MigrationDirectory(etcd_config), instance_id, timeout)
        return ServiceHandle(instance_id, process, advertisement.address, f"127.0.0.1:{metrics_port}")

    return await on_fresh_ports(start_once)


async def start_encoder_pool(
    encoder_id: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None, timeout: float = 60.0
) -> ServiceHandle:
    """An encoder (``phalanx encoder-pool``), returned once it advertised itself in etcd (SERVING, encoders loaded)."""
    process = _spawn(
        ["encoder-pool", "--encoder-id", encoder_id, "--etcd-endpoint", etcd_config.endpoint, "--port", "0", "--log-level", "WARNING",
         *extra],
        {**_etcd_env(etcd_config), **(env or {})},
    )
    advertisement = await _registration(process, EncoderDirectory(etcd_config), encoder_id, timeout)
    return ServiceHandle(encoder_id, process, advertisement.address, advertisement.metrics_address)


class GatewayHandle(ServiceHandle):
    """An OpenAI-compatible gateway process; ``url`` is its base (``{url}/v1`` for OpenAI clients), /metrics is on the same port."""

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False


async def start_gateway(
    router_target: str, *extra: str, name: str = "gateway", port: int = 0, env: dict | None = None, timeout: float = 30.0,
    etcd_config: EtcdConfig | None = None,
) -> GatewayHandle:
    """A gateway (``phalanx gateway``) in front of ``router_target`` ("host:port" or "ipv4:h1:p1,h2:p2"), returned once /health answers.

    ``extra`` are more CLI flags (e.g. ``--model``); ``env`` more PHALANX_GATEWAY_* settings (API keys, tenants);
    ``etcd_config`` the etcd its Responses API keeps responses in (default: PHALANX_ETCD_* of the environment).
    """

    async def start_once(port: int) -> GatewayHandle:
        etcd = [] if etcd_config is None else ["--etcd-endpoint", etcd_config.endpoint]
        process = _spawn(
            ["gateway", "--router", router_target, "--port", str(port), "--log-level", "WARNING", *etcd, *extra],
            {**(_etcd_env(etcd_config) if etcd_config is not None else {}), **(env or {})},
        )
        address = f"127.0.0.1:{port}"
        handle = GatewayHandle(name, process, address, address)
        deadline = time.monotonic() + timeout
        try:
            while not await asyncio.to_thread(handle.healthy):
                if process.poll() is not None:
                    raise ExitedBeforeServing(f"{name} exited with {process.returncode} before it served")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not serve within {timeout:.0f} s")
                await asyncio.sleep(0.05)
        except BaseException:  # a timeout, or a caller that gave up (cancelled): the process is ours to stop
            handle.kill()
            raise
        return handle

    if port:  # the caller's port: taken is taken
        return await start_once(port)
    return await on_fresh_ports(lambda: start_once(free_port()))


async def start_expert_worker(
    worker_id: str, etcd_config: EtcdConfig, *extra: str, model: str, index: int, num_expert_workers: int, copies: int = 1,
    env: dict | None = None, timeout: float = 60.0,
) -> ServiceHandle:
    """An expert worker (``phalanx expert-worker``) of placement slot ``index``, returned once it registered its experts."""
    process = _spawn(
        ["expert-worker", "--worker-id", worker_id, "--etcd-endpoint", etcd_config.endpoint, "--port", "0", "--model", model,
         "--index", str(index), "--num-expert-workers", str(num_expert_workers), "--copies", str(copies), "--log-level", "WARNING", *extra],
        {**_etcd_env(etcd_config), **(env or {})},
    )
    registration = await _registration(process, ExpertWorkerDirectory(etcd_config), worker_id, timeout)
    return ServiceHandle(worker_id, process, registration.address, registration.metrics_address)


async def start_ert_manager(
    instance_id: str, etcd_config: EtcdConfig, *extra: str, model: str, env: dict | None = None, timeout: float = 30.0
) -> PlannerHandle:
    """An ERT manager (``phalanx ert-manager``), returned once its gRPC health says SERVING (it then campaigns and leads)."""

    async def start_once() -> PlannerHandle:
        port, metrics_port = free_port(), free_port()
        process = _spawn(
            ["ert-manager", "--instance-id", instance_id, "--etcd-endpoint", etcd_config.endpoint, "--port", str(port), "--model", model,
             "--log-level", "WARNING", *extra],
            {"PHALANX_ERT_METRICS_PORT": str(metrics_port), **_etcd_env(etcd_config), **(env or {})},
        )
        return await _serving(PlannerHandle(instance_id, process, f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}"), timeout)

    return await on_fresh_ports(start_once)
