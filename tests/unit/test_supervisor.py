"""The supervisor (phalanx.launch.supervisor): a dead worker is replaced under a new id after its backoff, and one whose
replacements keep failing at start-up is a crash loop that names it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.launch.events import ProcessState
from phalanx.launch.local_fleet import LocalSettings
from phalanx.launch.restarts import RestartPolicy
from phalanx.launch.services import WorkerHandle
from phalanx.launch.supervisor import Supervisor
from phalanx.launch.topology import Fleet
from phalanx.testing.supervisor import RecordedView

pytestmark = pytest.mark.unit

POLICY = RestartPolicy(initial_backoff_s=0.0, max_backoff_s=0.0, crash_loop_limit=2)


def dead_worker(supervisor: Supervisor) -> subprocess.Popen:
    """worker-0, serving (watched) and then exited with code 3."""
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait(30)
    supervisor.fleet.workers["worker-0"] = WorkerHandle("worker-0", process, "127.0.0.1:1", "127.0.0.1:2")
    supervisor.watch("worker-0")
    return process


async def test_a_dead_worker_is_replaced_under_a_new_id() -> None:
    view = RecordedView()
    supervisor = Supervisor(Fleet(), LocalSettings(model="phalanx-tiny-moe"), view, POLICY)
    process = dead_worker(supervisor)

    async def new_worker() -> tuple[str, int | None]:
        return "worker-1", 4242

    supervisor.fleet.new_worker = new_worker  # type: ignore[method-assign]
    assert supervisor.exited() == [("worker-0", process.pid, 3)]
    supervisor.replace("worker-0", process.pid, 3)
    assert supervisor.exited() == []  # being replaced: not reported twice
    await supervisor.replacing["worker-0"]
    assert [event.what for event in supervisor.events] == [
        "exited with code 3", f"started to replace worker-0 (pid {process.pid}), which exited with code 3",
    ]
    assert view.states["worker-0"] is ProcessState.REPLACED and "worker-1" in supervisor.trackers
    assert supervisor.crash_loop is None and not supervisor.replacing_workers


async def test_replacements_that_keep_failing_at_start_up_are_a_crash_loop_naming_the_process() -> None:
    view = RecordedView()
    supervisor = Supervisor(Fleet(), LocalSettings(model="phalanx-tiny-moe"), view, POLICY)
    process = dead_worker(supervisor)

    async def new_worker() -> tuple[str, int | None]:
        raise RuntimeError("out of memory")

    supervisor.fleet.new_worker = new_worker  # type: ignore[method-assign]
    supervisor.replace("worker-0", process.pid, 3)
    await supervisor.replacing["worker-0"]
    assert supervisor.crash_loop is not None
    assert str(supervisor.crash_loop) == "worker-0 keeps failing at start-up (2 times in a row; last: out of memory); see its output above"
    assert view.states["worker-0"] is ProcessState.FAILED
    assert supervisor.events[-1].what == f"crash loop: {supervisor.crash_loop}"
