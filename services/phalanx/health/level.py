"""The degradation level's one writer: the elected health instance's loop around `DegradationPolicy`.

Every `DegradationConfig.interval_s` it hands the policy what it knows of each registered worker (its health
weight from the fleet monitor, its last load report from NATS) and the planner's capacity view (followed in
etcd), and writes the decision to DEGRADATION_KEY (fenced by the leadership key) and NATS when what routers
and workers act on changed. docs/components.md draws its inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import encode_json
from phalanx.common.events import EventBus, Subscription, check_load_report
from phalanx.common.subjects import DEGRADATION_KEY, DEGRADATION_SUBJECT, LOAD_ALL
from phalanx.common.watched import DEGRADATION, PLANNER_CAPACITY, StateFollower
from phalanx.health.config import DegradationConfig
from phalanx.health.degradation import DegradationDecision, DegradationPolicy, PlannerView, WorkerCapacity, latency_slo_factor
from phalanx.health.metrics import HealthMetrics

__all__ = ["DegradationKeeper", "RoutedWorker"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutedWorker:
    """A registered worker as the fleet monitor knows it."""

    worker_id: str
    weight: float  # its health weight
    stopping: bool  # its grpc health said NOT_SERVING


class DegradationKeeper:
    """Reads the stored level (to resume from it), follows load reports and the planner's view, and keeps the level."""

    def __init__(
        self, config: DegradationConfig, etcd_config: EtcdConfig, bus: EventBus, metrics: HealthMetrics,
        fenced_put: Callable[[str, bytes], Awaitable[None]],
    ) -> None:
        self.config = config
        self.bus = bus
        self.metrics = metrics
        self._fenced_put = fenced_put
        self.state: common_pb2.DegradationState | None = None  # the level in force: stored, then ours
        self._stored = StateFollower(etcd_config, DEGRADATION)
        self._planner_views = StateFollower(etcd_config, PLANNER_CAPACITY)  # the planner's capacity-vs-demand, if any
        self._loads: dict[str, tuple[common_pb2.LoadReport, float]] = {}
        self._subscription: Subscription | None = None

    @property
    def slo_factor(self) -> float:
        """The latency SLO relaxation of the level in force (x2 from level 3 on)."""
        return latency_slo_factor(self.state.level if self.state is not None else 0)

    async def start(self) -> None:
        """Read the stored level and the planner's view, and subscribe to load reports."""
        self.state = await self._stored.read()  # ours to write: read once, to resume from its level
        await self._planner_views.read()
        self._subscription = await self.bus.subscribe(
            LOAD_ALL, common_pb2.LoadReport, self._on_load, check=check_load_report,
            on_rejected=lambda kind: self.metrics.bus_rejected.labels(subject_kind=kind).inc(),
        )

    async def run(self, workers: Callable[[], Iterable[RoutedWorker]]) -> None:
        """Follow the planner's view and, when enabled, evaluate the level every interval; until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._planner_views.follow())
            if self.config.enabled:
                tasks.create_task(self._loop(workers))

    async def close(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(Exception):  # a closed connection has no subscription left to end
                await subscription.unsubscribe()
        await self._stored.close()
        await self._planner_views.close()

    async def _on_load(self, report: common_pb2.LoadReport, subject: str, context) -> None:
        self._loads[report.worker_id] = (report, time.monotonic())

    async def _loop(self, workers: Callable[[], Iterable[RoutedWorker]]) -> None:
        policy = DegradationPolicy(self.config, level=self.state.level if self.state else 0)
        # Every live worker reports load within this; judged earlier, a new leader would see no capacity at all.
        await asyncio.sleep(self.config.report_stale_s)
        while True:
            decision = policy.evaluate(time.monotonic(), self._capacities(workers()), self._planner_view())
            self.metrics.degradation.set(decision.level)
            self.metrics.pressure.set(min(decision.pressure, 1e6))
            if self.state is None or _published(decision) != _published(self.state):
                await self._publish(decision)
            await asyncio.sleep(self.config.interval_s)

    async def _publish(self, decision: DegradationDecision) -> None:
        state = common_pb2.DegradationState(
            level=decision.level, reason=decision.reason, updated_at=time.time(), pressure=min(decision.pressure, 1e6),
            healthy_workers=decision.healthy_workers, ttft_slo_s=decision.ttft_slo_s, tpot_slo_s=decision.tpot_slo_s,
            batch_scale=decision.batch_scale,
        )
        await self._fenced_put(DEGRADATION_KEY, encode_json(state))
        await self.bus.publish(DEGRADATION_SUBJECT, state)
        previous = self.state.level if self.state else 0
        (log.warning if decision.level > previous else log.info)("degradation level %d -> %d: %s", previous, decision.level, decision.reason)
        self.state = state

    def _planner_view(self) -> PlannerView | None:
        view = self._planner_views.value
        if view is None:
            return None
        return PlannerView(pressure=view.pressure, needed_workers=view.needed_workers, serving_workers=view.serving_workers,
                           age_s=time.time() - view.updated_at, valid_for_s=view.valid_for_s)

    def _capacities(self, workers: Iterable[RoutedWorker]) -> list[WorkerCapacity]:
        now = time.monotonic()
        out = []
        for w in workers:
            loaded = self._loads.get(w.worker_id)
            report, at = loaded if loaded is not None else (None, 0.0)
            routable = w.weight > 0 and not w.stopping and not (report is not None and report.draining)
            if report is None:
                out.append(WorkerCapacity(w.worker_id, routable, w.weight, 0.0, 0.0, 0.0, 0, 0, 0, 0, float("inf")))
                continue
            out.append(
                WorkerCapacity(
                    w.worker_id, routable, w.weight, report.decode_tokens_per_s, report.prefill_tokens_per_s, report.step_time_ms / 1e3,
                    report.queue_depth, report.running_seqs, report.free_blocks, report.total_blocks, now - at,
                )
            )
        return out


def _published(state: DegradationDecision | common_pb2.DegradationState) -> tuple[int, float, float, float]:
    """What routers and workers act on: a new level, or new SLOs or batch scale at the same level (a changed config, an
    upgrade), is written again."""
    return state.level, state.ttft_slo_s, state.tpot_slo_s, state.batch_scale
