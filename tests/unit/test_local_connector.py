"""The planner's local connector (`phalanx up --planner`): a scale-down cancels the starts still in flight before any
serving worker drains."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from phalanx.launch.events import ProcessState
from phalanx.launch.local_fleet import PLANNER_ID, LocalSettings
from phalanx.launch.services import WorkerHandle
from phalanx.launch.supervisor import Supervisor
from phalanx.launch.topology import Fleet
from phalanx.planner.local_connector import LocalConnector
from phalanx.testing.supervisor import RecordedView

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
