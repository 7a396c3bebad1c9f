"""The planner's local connector (`phalanx up --planner`): a scale-down cancels the starts still in flight before any
serving worker drains; a disaggregated fleet's prefill and decode pools are each scaled to their own target."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from phalanx.launch.events import ProcessState
from phalanx.launch.local_fleet import PLANNER_ID, LocalSettings
from phalanx.launch.services import WorkerHandle
from phalanx.launch.supervisor import Supervisor
from phalanx.launch.topology import Fleet, WorkerGroup, WorkerRole
from phalanx.planner.connectors import AckRecord, DecisionRecord
from phalanx.planner.local_connector import LocalConnector
from phalanx.testing.supervisor import RecordedView, StandInWorkers

pytestmark = pytest.mark.unit


@pytest.fixture
def serving() -> Iterator[subprocess.Popen]:
    """A serving worker's stand-in: a process that runs until signalled."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


async def test_a_scale_down_cancels_the_newest_starts_first_and_drains_only_what_is_left(serving: subprocess.Popen) -> None:
    view = RecordedView()
    supervisor = Supervisor(Fleet(planner=True), LocalSettings(model="phalanx-tiny-moe"), view)
    stack = LocalConnector(supervisor, hot_spares=0, planner_id=PLANNER_ID, orchestrator="test")
    supervisor.owner = stack
    supervisor.workers["worker-0"] = WorkerHandle("worker-0", serving, "127.0.0.1:1", "127.0.0.1:2")
    cancelled: list[int] = []
    starts = 0

    async def slow_start() -> tuple[str, int | None]:
        nonlocal starts
        starts += 1
        mine = starts
        try:
            await asyncio.sleep(60)  # a worker process still importing and registering
        except asyncio.CancelledError:
            cancelled.append(mine)
            raise
        return f"worker-{mine}", None

    supervisor.fleet.new_worker = slow_start  # type: ignore[method-assign]
    stack._scale_up(3)
    stack._scale_up(3)
    await asyncio.sleep(0)
    assert len(stack.scaling) == 2
    # Target 2 from 1 serving + 2 starting: the newest start goes, worker-0 serves on.
    stack._scale_down(1, 2)
    assert len(stack.scaling) == 1 and not stack.retiring
    # A start after the cancellation gets a key of its own: the cancelled start's clean-up leaves it counted.
    stack._scale_up(3)
    await asyncio.sleep(0.05)
    assert cancelled == [2] and len(stack.scaling) == 2
    # Target 0 from 1 serving + 2 starting: both starts go, then worker-0 drains (SIGTERM).
    stack._scale_down(3, 0)
    await asyncio.sleep(0.05)
    assert sorted(cancelled) == [1, 2, 3] and not stack.scaling
    assert list(stack.retiring) == ["worker-0"] and not supervisor.workers
    assert await asyncio.to_thread(serving.wait, 10) == -signal.SIGTERM
    assert view.states["worker-0"] is ProcessState.DRAINING
    events = [event.what for event in supervisor.events]
    assert events.count("1 worker start(s) cancelled: planner target 2 workers") == 1
    assert "2 worker start(s) cancelled: planner target 0 workers" in events
    assert "draining: planner target 0 workers" in events


def _disaggregated_supervisor(starts: StandInWorkers) -> Supervisor:
    """`phalanx up --planner --prefill-workers 1 --decode-workers 1`'s supervisor with its two workers serving."""
    fleet = Fleet(workers=(WorkerGroup(WorkerRole.DECODE, 1), WorkerGroup(WorkerRole.PREFILL, 1)), planner=True)
    supervisor = Supervisor(fleet, LocalSettings(model="phalanx-tiny-moe"), RecordedView())
    supervisor.fleet.start_worker = starts  # type: ignore[method-assign]
    for spec in fleet.worker_specs():
        supervisor.fleet.workers[spec.name] = asyncio.run(starts(spec.name, spec.role.flags if spec.role else ()))
        assert spec.role is not None
        supervisor.fleet.worker_roles[spec.name] = spec.role
    starts.flags.clear()
    return supervisor


def _decision(decision_id: int, workers: int, prefill: int | None) -> DecisionRecord:
    return DecisionRecord(id=decision_id, workers=workers, spares=0, reason="scale", issued_at=time.time(), deadline=time.time() + 60,
                          prefill_workers=prefill)


async def _carried_out(stack: LocalConnector) -> AckRecord:
    for _ in range(200):
        ack = await stack.acknowledged()
        if ack is not None:
            return ack
        await asyncio.gather(*stack.scaling.values(), return_exceptions=True)
        await asyncio.sleep(0.05)
    raise AssertionError(f"not carried out: {stack.state(1, 4)}")


def test_each_pool_of_a_disaggregated_fleet_is_scaled_to_its_own_target() -> None:
    starts = StandInWorkers()
    try:
        supervisor = _disaggregated_supervisor(starts)
        assert supervisor.role_of("worker-0") == "decode" and supervisor.role_of("worker-1") == "prefill"
        assert supervisor.fleet._worker_role_flags == ("--role", "decode")  # a start of the fleet's default role is a decode worker

        async def scenario() -> None:
            stack = LocalConnector(supervisor, hot_spares=0, planner_id=PLANNER_ID, orchestrator="test")
            supervisor.owner = stack
            # Up in both pools: one decode worker (the fleet's default role) and one prefill worker (--role prefill).
            assert await stack.publish(_decision(1, workers=2, prefill=2))
            ack = await _carried_out(stack)
            assert (ack.id, ack.workers, ack.prefill_workers) == (1, 2, 2)
            assert sorted(starts.flags, key=str) == [("--role", "prefill"), None]
            roles = {name: supervisor.role_of(name) for name in supervisor.workers}
            # The new decode worker runs the fleet's default role, which the fleet does not record ("").
            assert sorted(roles.values()) == ["", "decode", "prefill", "prefill"]
            # Down in the decode pool only: its newest worker drains, though a prefill worker is newer still.
            newest_decode = max((n for n, r in roles.items() if r != "prefill"), key=lambda n: int(n.rsplit("-", 1)[1]))
            newest = max(roles, key=lambda n: int(n.rsplit("-", 1)[1]))
            assert roles[newest] == "prefill" and newest != newest_decode
            assert await stack.publish(_decision(2, workers=1, prefill=2))
            assert await stack.acknowledged() is None
            assert list(stack.retiring) == [newest_decode]
            ack = await _carried_out(stack)
            assert (ack.id, ack.workers, ack.prefill_workers) == (2, 1, 2)
            assert stack.state(1, 4)["target_prefill_workers"] == 2 and stack.state(1, 4)["prefill_workers"] == 2
            # An aggregated decision is one pool of every worker: the three serving match it as they are.
            assert await stack.publish(_decision(3, workers=3, prefill=None))
            ack = await _carried_out(stack)
            assert (ack.id, ack.workers, ack.prefill_workers) == (3, 3, 0) and not stack.retiring and len(starts.flags) == 2

        asyncio.run(scenario())
    finally:
        starts.close()
