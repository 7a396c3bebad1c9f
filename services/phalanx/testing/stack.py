"""Workers and routers started together for a test or a benchmark, stopped by PID when done."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid

from phalanx.common.config import EtcdConfig
from phalanx.testing.workers import RouterHandle, WorkerHandle, start_router, start_worker

__all__ = ["Stack", "free_port", "unique_id"]


def unique_id(name: str) -> str:
    """``name`` with a random suffix: a killed service's etcd key may outlive it by a lease TTL."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


def free_port() -> int:
    """A loopback port free right now (for a service that must come back on the same port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """Workers and routers against one NATS and one etcd."""

    def __init__(self, nats_url: str, etcd_config: EtcdConfig) -> None:
        self.nats_url = nats_url
        self.etcd_config = etcd_config
        self.workers: list[WorkerHandle] = []
        self.routers: list[RouterHandle] = []

    async def add_workers(self, count: int, *extra: str, env: dict | None = None) -> list[WorkerHandle]:
        """``count`` workers started in parallel (deterministic numerics unless ``extra`` says --fast)."""
        flags = extra if "--fast" in extra else ("--deterministic", *extra)
        started = await asyncio.gather(
            *(start_worker(unique_id(f"w{i}"), self.nats_url, self.etcd_config, *flags, env=env) for i in range(count))
        )
        self.workers.extend(started)
        return list(started)

    async def add_router(self, *extra: str, port: int = 0, router_id: str | None = None, env: dict | None = None) -> RouterHandle:
        router = await start_router(router_id or unique_id("r"), self.nats_url, self.etcd_config, *extra, port=port, env=env)
        self.routers.append(router)
        return router

    def stop(self) -> None:
        """SIGTERM every process (routers first, so that none routes to a stopping worker)."""
        for handle in [*self.routers, *self.workers]:
            with contextlib.suppress(Exception):
                handle.terminate(timeout=20)
