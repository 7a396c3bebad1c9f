"""The fuzz suite's stack: every service once, on a NATS and an etcd of its own."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzing import CHAOS_TOKEN, MODEL, FuzzStack

from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import (
    ServiceHandle,
    start_checkpoint_store,
    start_encoder_pool,
    start_expert_worker,
    start_gateway,
    start_health,
    start_memory_service,
    start_migration,
    start_planner,
    start_router,
    start_worker,
)
from phalanx.launch.stack import unique_id

START_TIMEOUT_S = 180.0


# A directory without __init__.py is no package to pytest: a "package" fixture here would live to the end of the whole
# run, a dozen idle processes (health canaries included) beside every later test. The stack is closed after each stretch
# of this directory's tests instead (pytest_runtest_teardown below), and started again by the next fuzz test: under
# pytest-xdist other files may run between this directory's.
_running = contextlib.ExitStack()
_started: list[FuzzStack] = []  # the running stack, if any


@pytest.fixture
def fuzz_stack() -> FuzzStack:
    if not _started:
        _started.append(_running.enter_context(_stack()))
    return _started[0]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or Path(__file__).parent not in Path(nextitem.path).parents:
        _running.close()
        _started.clear()


@contextlib.contextmanager
def _stack() -> Iterator[FuzzStack]:
    """Every service once, on a NATS and an etcd of the fuzz suite's own (nothing it breaks reaches other tests)."""
    with NatsServer() as nats, EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="phalanx-fuzz-", dir="/dev/shm") as tmp:
        etcd_config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        handles: list[ServiceHandle] = []

        async def _started(*starts) -> list[ServiceHandle]:
            """Every start awaited, each process kept for the teardown; the first failure raised after."""
            results = await asyncio.gather(*starts, return_exceptions=True)
            handles.extend(r for r in results if isinstance(r, ServiceHandle))
            for failure in results:
                if isinstance(failure, BaseException):
                    raise failure
            return list(results)

        async def start() -> FuzzStack:
            # In two waves (the router needs a worker, the gateway the router): most of a start is imports, and a dozen
            # at once on a loaded box only makes each slower. Hence the long timeouts too.
            chaos = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN}
            first = await _started(
                start_worker(unique_id("w"), nats.url, etcd_config, "--deterministic", model=MODEL, env=chaos, timeout=START_TIMEOUT_S),
                start_checkpoint_store(unique_id("ckpt"), etcd_config, timeout=START_TIMEOUT_S),
                start_health(unique_id("h"), nats.url, etcd_config, timeout=START_TIMEOUT_S),
                start_migration(unique_id("mig"), nats.url, etcd_config, timeout=START_TIMEOUT_S),
            )
            worker, store, health, migration = first
            second = await _started(
                start_router(unique_id("r"), nats.url, etcd_config),
                start_encoder_pool(unique_id("enc"), etcd_config, "--llm-hidden-size", "64", timeout=START_TIMEOUT_S),
                start_expert_worker(unique_id("ew"), etcd_config, model=MODEL, index=0, num_expert_workers=1, timeout=START_TIMEOUT_S),
                start_planner("fuzz-planner", etcd_config, env={"PHALANX_PLANNER_POLL_S": "0.5"}, timeout=START_TIMEOUT_S),
                start_memory_service(f"{tmp}/memory.sock", f"{tmp}/segments", name="fuzz-memory", timeout=START_TIMEOUT_S),
            )
            router, encoder, expert, planner, memory = second
            gateway = await start_gateway(router.address, "--model", MODEL, name="fuzz-gateway", timeout=START_TIMEOUT_S)
            handles.append(gateway)
            return FuzzStack({
                "worker": worker, "router": router, "health": health, "checkpoint-store": store, "migration": migration,
                "encoder": encoder, "expert-worker": expert, "planner": planner, "gateway": gateway, "memory-service": memory,
            }, nats.url)

        try:
            yield asyncio.run(start())
        finally:
            for handle in reversed(handles):  # the gateway and the router first: nothing routes to a stopping worker
                with contextlib.suppress(Exception):
                    handle.terminate(timeout=20)
