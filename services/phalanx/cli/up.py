"""`phalanx up`: NATS, etcd and N workers as supervised local processes on loopback.

This issue's version brings up the serving layer (workers); the router and
the other services join it as they land. Nothing restarts silently: a
worker that exits takes the whole group down with a message, and Ctrl-C /
SIGTERM stops every process this command started, by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from rich.console import Console

from phalanx.common.config import EtcdConfig
from phalanx.testing.infra import EtcdServer, NatsServer
from phalanx.testing.workers import WorkerHandle, start_worker


async def run_up(*, workers: int, model: str, deterministic: bool, nats_url: str | None, etcd_endpoint: str | None, console: Console) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.ExitStack() as stack:
        with console.status("starting NATS and etcd…"):
            if nats_url is None:
                nats_url = stack.enter_context(NatsServer()).url
            if etcd_endpoint is None:
                etcd_endpoint = stack.enter_context(EtcdServer()).endpoint
        console.print(f"[green]✓[/] NATS {nats_url}   etcd {etcd_endpoint}")
        etcd = EtcdConfig(endpoint=etcd_endpoint, lease_ttl_s=1)
        extra = ["--deterministic" if deterministic else "--fast"]
        handles: list[WorkerHandle] = []
        try:
            with console.status(f"starting {workers} worker(s) of {model}…"):
                started = time.monotonic()
                handles = list(
                    await asyncio.gather(
                        *(start_worker(f"worker-{i}", nats_url, etcd, *extra, env={"PHALANX_ENGINE_MODEL": model}) for i in range(workers))
                    )
                )
            for h in handles:
                console.print(f"[green]✓[/] {h.worker_id}  grpc {h.address}  pid {h.process.pid}")
            console.print(f"[bold]Phalanx is up[/] in {time.monotonic() - started:.1f} s. Ctrl-C stops everything.")
            while not stop.is_set():
                dead = [h for h in handles if h.process.poll() is not None]
                if dead:
                    console.print(f"[red]✗ {dead[0].worker_id} exited with {dead[0].process.returncode}; stopping[/]")
                    return 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
            return 0
        finally:
            with console.status("stopping…"):
                for h in handles:
                    with contextlib.suppress(Exception):
                        h.terminate(timeout=30)
            console.print("stopped")
