"""A supervisor's view for tests: it keeps what the supervisor shows it instead of drawing a board; and stand-in worker
processes for tests of what the supervisor and the planner's local connector do with workers, not of the workers."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from phalanx.launch.events import ProcessState, SupervisorEvent
from phalanx.launch.services import WorkerHandle

__all__ = ["RecordedView", "StandInWorkers"]


class RecordedView:
    """Keeps each process's last state and every event (phalanx.launch.events.SupervisorView)."""

    def __init__(self) -> None:
        self.states: dict[str, ProcessState] = {}
        self.events: list[SupervisorEvent] = []

    def show(self, name: str, state: ProcessState, address: str = "", pid: int | None = None, *, note: str = "") -> None:
        self.states[name] = state

    def forget(self, name: str) -> None:
        self.states.pop(name, None)

    def event(self, event: SupervisorEvent) -> None:
        self.events.append(event)

    def killing(self, name: str, pid: int) -> None:
        pass

    def stopped(self, name: str, pid: int | None = None, how: str = "") -> None:
        pass


class StandInWorkers:
    """A fleet's worker launcher (`LocalFleet.start_worker`) replaced by processes that run until signalled; each start's
    role flags are kept (None: the fleet's default role). The fleet's own bookkeeping (ids, roles, the workers it counts)
    runs unchanged around it."""

    def __init__(self) -> None:
        self.flags: list[tuple[str, ...] | None] = []
        self.processes: list[subprocess.Popen] = []

    async def __call__(self, worker_id: str, role_flags: tuple[str, ...] | None = None) -> WorkerHandle:
        self.flags.append(role_flags)
        process = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-c", "import time; time.sleep(60)"])
        self.processes.append(process)
        return WorkerHandle(worker_id, process, "127.0.0.1:1", "127.0.0.1:2")

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
