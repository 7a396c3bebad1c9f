"""Starts real worker and router processes (python -m phalanx.cli …) against a NATS and an etcd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EtcdDirectory, WorkerDirectory
from phalanx.common.subjects import ROUTERS_PREFIX
from phalanx.testing.infra import pdeathsig_preexec

__all__ = ["RouterHandle", "ServiceHandle", "WorkerHandle", "start_router", "start_worker"]


class ServiceHandle:
    """A service process we started, stopped by its PID only."""

    def __init__(self, name: str, process: subprocess.Popen, address: str, metrics_address: str = "") -> None:
        self.name = name
        self.process = process
        self.address = address
        self.metrics_address = metrics_address

    def metrics(self) -> str:
        """The process's Prometheus exposition text."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as reply:
            return reply.read().decode()

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


class RouterHandle(ServiceHandle):
    @property
    def router_id(self) -> str:
        return self.name


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", *args],
        env={**os.environ, **env},
        start_new_session=True,
        preexec_fn=pdeathsig_preexec(),  # dies with us: no orphans if we are SIGKILLed
    )


async def _registration(process: subprocess.Popen, directory: EtcdDirectory, name: str, timeout: float):
    """Wait until ``process`` registered ``name`` (a previous holder of the name may linger until its lease lapses)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} before registering")
            entries = await directory.list()
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


async def start_worker(worker_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None) -> WorkerHandle:
    """A worker process, returned once it registered (model loaded, serving)."""
    process = _spawn(
        ["worker", "--worker-id", worker_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", "0",
         "--log-level", "WARNING", *extra],
        {"PHALANX_ETCD_LEASE_TTL_S": str(etcd_config.lease_ttl_s), **(env or {})},
    )
    registration = await _registration(process, WorkerDirectory(etcd_config), worker_id, 60)
    return WorkerHandle(worker_id, process, registration.address, registration.metrics_address)


async def start_router(
    router_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, port: int = 0, env: dict | None = None
) -> RouterHandle:
    """A router process, returned once it registered (index built, SERVING)."""
    process = _spawn(
        ["router", "--router-id", router_id, "--nats-url", nats_url, "--etcd-endpoint", etcd_config.endpoint, "--port", str(port),
         "--log-level", "WARNING", *extra],
        {"PHALANX_ETCD_LEASE_TTL_S": str(etcd_config.lease_ttl_s), **(env or {})},
    )
    directory = EtcdDirectory(etcd_config, prefix=ROUTERS_PREFIX, message_type=common_pb2.RouterRegistration)
    registration = await _registration(process, directory, router_id, 60)
    return RouterHandle(router_id, process, registration.address, registration.metrics_address)
