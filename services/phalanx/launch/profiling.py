"""`phalanx profile`'s worker: the one it sweeps (phalanx.planner.profiler), started here unless one runs already."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

from phalanx.planner.profile import PerformanceProfile
from phalanx.planner.profiler import SweepPlan, profile_address

__all__ = ["profile_worker"]


async def profile_worker(model: str, plan: SweepPlan, *, target: str | None = None, log: Callable[[str], None] | None = None) -> PerformanceProfile:
    """Sweeps the worker at `target`, or one of `model` started here for the purpose (with its own NATS and etcd; stopped after)."""
    if target:
        return await profile_address(target, model, plan, log=log)
    from phalanx.common.config import EtcdConfig
    from phalanx.launch.infra import EtcdServer, NatsServer
    from phalanx.launch.services import start_worker

    with contextlib.ExitStack() as stack:
        nats = stack.enter_context(NatsServer())
        etcd = stack.enter_context(EtcdServer())
        worker = await start_worker(f"profile-{uuid.uuid4().hex[:8]}", nats.url, EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=2), model=model)
        stack.callback(worker.terminate)
        return await profile_address(worker.address, model, plan, log=log)
