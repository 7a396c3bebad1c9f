"""Starts real worker processes (python -m phalanx.cli worker) against a NATS and an etcd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import WorkerDirectory
from phalanx.testing.infra import pdeathsig_preexec


class WorkerHandle:
    def __init__(self, worker_id: str, process: subprocess.Popen, address: str) -> None:
        self.worker_id = worker_id
        self.process = process
        self.address = address

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


async def start_worker(worker_id: str, nats_url: str, etcd_config: EtcdConfig, *extra: str, env: dict | None = None) -> WorkerHandle:
    process = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "worker", "--worker-id", worker_id, "--nats-url", nats_url,
         "--etcd-endpoint", etcd_config.endpoint, "--port", "0", "--log-level", "WARNING", *extra],
        env={**os.environ, "PHALANX_ETCD_LEASE_TTL_S": str(etcd_config.lease_ttl_s), **(env or {})},
        start_new_session=True,
        preexec_fn=pdeathsig_preexec(),  # dies with us: no orphans if we are SIGKILLed
    )
    directory = WorkerDirectory(etcd_config)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"worker {worker_id} exited with {process.returncode} before registering")
            workers = await directory.list()
            # A previous worker of the same id may still hold its key until its lease lapses.
            if worker_id in workers and workers[worker_id].pid == process.pid:
                return WorkerHandle(worker_id, process, workers[worker_id].address)
            await asyncio.sleep(0.05)
        raise TimeoutError(f"worker {worker_id} did not register within 60 s")
    except BaseException:
        with contextlib.suppress(Exception):
            process.kill()
            process.wait(5)
        raise
    finally:
        await directory.close()
