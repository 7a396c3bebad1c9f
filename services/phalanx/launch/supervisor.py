"""The supervisor: whatever of a local fleet dies is reported and started again after a backoff, as Kubernetes would.

It says which process died and how (to its `SupervisorView` and in its events), and starts a replacement after a
capped backoff (phalanx.launch.restarts): a worker under a new id, a failover engine as a new engine of its slot, an
expert worker in its placement slot, everything else under its old id and address, while the rest keeps serving. A
process that keeps dying at start-up is a crash loop: the supervisor names it (`crash_loop`) and its owner stops
everything; a fork server in a crash loop is given up on instead (workers are spawned from then on).

Workers may belong to an orchestrator too (`WorkerOwner`: the planner's local connector, phalanx.planner.local_connector),
which may take a dead worker's exit over (a hot spare's, or one whose capacity a spare's promotion restores).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from phalanx.common.children import describe_exit
from phalanx.launch.events import MAX_EVENTS, ProcessState, SupervisorEvent, SupervisorView
from phalanx.launch.local_fleet import (
    FORK_SERVER_ID,
    GATEWAY_ID,
    HEALTH_ID,
    MIGRATION_ID,
    PLANNER_ID,
    ROUTER_ID,
    STORE_ID,
    LocalFleet,
    LocalSettings,
)
from phalanx.launch.restarts import RestartDecision, RestartPolicy, RestartTracker
from phalanx.launch.topology import Fleet, WorkerRole

if TYPE_CHECKING:
    from phalanx.common.config import EtcdConfig
    from phalanx.launch.services import WorkerHandle

__all__ = ["CrashLoopError", "Supervisor", "WorkerOwner"]

# Together under `phalanx down`'s 60 s. The router's own grace is 5 s; workers let running
# requests finish for drain_grace_s (10 s by default) before handing them back.
SERVICE_STOP_S = 15.0
WORKER_STOP_S = 40.0


class CrashLoopError(Exception):
    """A process keeps dying at start-up: the message names it and says why."""


class WorkerOwner(Protocol):
    """An orchestrator of the fleet's workers beside the supervisor (the planner's local connector)."""

    def processes(self) -> dict[str, subprocess.Popen]:
        """Its own processes to watch (hot spares), by name."""
        ...

    def worker_exited(self, name: str, pid: int | None, code: int | None) -> bool:
        """``name`` (a worker or one of its own) exited; True if it takes that over, so that nothing is restarted here."""
        ...

    async def cancel_starts(self) -> None:
        """Cancels the starts it has in flight (each kills the process it was waiting for)."""
        ...

    async def close(self) -> None:
        """Releases what it holds (marks in etcd, its etcd client); the fleet is stopping."""
        ...

    def stopping(self) -> dict[str, subprocess.Popen]:
        """Its processes to stop with the workers (spares, draining workers), by name."""
        ...


class Supervisor:
    """Starts a fleet on this machine (`LocalFleet`), watches its processes and replaces the ones that die; the planner's
    local connector scales its workers through it (it is that connector's `WorkerPool`)."""

    def __init__(self, fleet: Fleet, settings: LocalSettings, view: SupervisorView, policy: RestartPolicy | None = None) -> None:
        self.fleet = LocalFleet(fleet, settings, view, self.ready)
        self.view = view
        self.policy = policy or RestartPolicy()
        self.owner: WorkerOwner | None = None
        self.trackers: dict[str, RestartTracker] = {}  # by the name of the process now in the slot
        self.replacing: dict[str, asyncio.Task] = {}  # by the name of the process that died
        self.replacing_workers: set[str] = set()
        self.events: list[SupervisorEvent] = []
        self.changed = asyncio.Event()  # a process was replaced: the state file is out of date
        self.crash_loop: CrashLoopError | None = None
        self.hurry = asyncio.Event()  # a second signal while stopping: SIGKILL what is left

    def ready(self, name: str, address: str, pid: int | None) -> None:
        """``name`` started and serves: shown ready, and watched from now on."""
        self.view.show(name, ProcessState.READY, address, pid)
        self.watch(name)

    def watch(self, name: str) -> None:
        """Restarts of ``name`` are counted from now on (it serves)."""
        self.trackers.setdefault(name, RestartTracker(self.policy)).ready(time.monotonic())

    def unwatch(self, name: str) -> None:
        self.trackers.pop(name, None)

    def record(self, process: str, pid: int | None, what: str) -> None:
        """An event: kept (the latest MAX_EVENTS) and shown; the state file is out of date."""
        event = SupervisorEvent(at=time.time(), process=process, pid=pid, what=what)
        self.events.append(event)
        del self.events[:-MAX_EVENTS]
        self.view.event(event)
        self.changed.set()

    # --- the workers, for an orchestrator (phalanx.planner.local_connector.WorkerPool) ------------------------------

    @property
    def workers(self) -> dict[str, WorkerHandle]:
        return self.fleet.workers

    @property
    def etcd_config(self) -> EtcdConfig:
        return self.fleet.etcd_config

    @property
    def retry_pause_s(self) -> float:
        return self.policy.initial_backoff_s

    def new_worker_id(self) -> str:
        return self.fleet.new_worker_id()

    async def start_worker(self, worker_id: str, role: str | None = None) -> WorkerHandle:
        handle = await (self.fleet.start_worker(worker_id) if role is None else self.fleet.start_worker(worker_id, WorkerRole(role).flags))
        if role is not None:
            self.fleet.worker_roles[worker_id] = WorkerRole(role)
        return handle

    async def new_worker(self, role: str | None = None) -> tuple[str, int | None]:
        return await (self.fleet.new_worker() if role is None else self.fleet.new_worker(WorkerRole(role)))

    def role_of(self, name: str) -> str:
        """A worker's role ("" when it runs the fleet's default, unrecorded)."""
        role = self.fleet.worker_roles.get(name)
        return role.value if role is not None else ""

    def show(self, name: str, state: str, address: str = "", pid: int | None = None, *, note: str = "") -> None:
        self.view.show(name, ProcessState(state), address, pid, note=note)

    def forget(self, name: str) -> None:
        self.view.forget(name)

    # --- replacing what died --------------------------------------------------------------------------------------

    def exited(self) -> list[tuple[str, int | None, int | None]]:
        """(name, pid, exit code) of every process of ours that exited and is not being replaced yet."""
        processes = {**self.fleet.processes(), **(self.owner.processes() if self.owner is not None else {})}
        return [(name, process.pid, process.returncode) for name, process in processes.items()
                if process.poll() is not None and name not in self.replacing]

    def replace(self, name: str, pid: int | None, code: int | None) -> None:
        """Report that ``name`` died and start its replacement in the background (after a backoff)."""
        if self.owner is not None and self.owner.worker_exited(name, pid, code):
            return
        decision = self.trackers[name].exited(time.monotonic())
        self.record(name, pid, f"exited with {describe_exit(code)}")
        fleet = self.fleet
        start: Callable[[], Awaitable[tuple[str, int | None]]]
        if fleet.workers.pop(name, None) is not None:
            slot = fleet.engine_slot.get(name)
            # An engine of a failover slot is succeeded in its slot, by an engine that stands by.
            # A prefill or decode worker is replaced by one of its role.
            role = fleet.worker_roles.pop(name, None)
            if slot is not None:
                start = functools.partial(fleet.replace_engine, slot)
            else:
                start = fleet.new_worker if role is None else functools.partial(fleet.new_worker, role)
            self.replacing_workers.add(name)
        elif fleet.expert_workers.pop(name, None) is not None:
            start = functools.partial(fleet.replace_expert_worker, fleet.expert_slots.pop(name))
        else:
            start = functools.partial(fleet.restart_in_place, name)
        self.replacing[name] = asyncio.create_task(self._replace(name, pid, code, decision, start))

    async def _replace(
        self, name: str, pid: int | None, code: int | None, decision: RestartDecision, start: Callable[[], Awaitable[tuple[str, int | None]]]
    ) -> None:
        tracker = self.trackers.pop(name)
        why = f"exited with {describe_exit(code)}"
        try:
            while True:
                if decision.give_up:
                    self._give_up(name, pid, why, decision)
                    return
                self.view.show(name, ProcessState.RESTARTING, note=f"{why}; restarting in {decision.delay_s:.1f} s")
                await asyncio.sleep(decision.delay_s)
                try:
                    new_name, new_pid = await start()
                except Exception as error:  # noqa: BLE001 - any start failure counts toward a crash loop
                    why = f"{error}" or type(error).__name__
                    decision = tracker.failed_to_start()
                    continue
                tracker.ready(time.monotonic())
                self.trackers[new_name] = tracker
                if new_name != name:
                    self.view.show(name, ProcessState.REPLACED, note=f"{why}; replaced by {new_name}")
                self.record(new_name, new_pid, f"started to replace {name} (pid {pid}), which {why}")
                self.changed.set()
                return
        finally:
            self.replacing.pop(name, None)
            self.replacing_workers.discard(name)

    def _give_up(self, name: str, pid: int | None, why: str, decision: RestartDecision) -> None:
        loop = f"keeps failing at start-up ({decision.failures_in_a_row} times in a row; last: {why})"
        if name == FORK_SERVER_ID:
            # It only makes starts faster: without it workers are spawned, as without a fork server.
            self.stop_forking(loop)
            return
        self.crash_loop = CrashLoopError(f"{name} {loop}; see its output above")
        self.record(name, pid, f"crash loop: {self.crash_loop}")
        self.view.show(name, ProcessState.FAILED, note=why)

    def stop_forking(self, why: str) -> None:
        pid = self.fleet.end_forking()
        self.view.show(FORK_SERVER_ID, ProcessState.FAILED, note=f"{why}; workers are spawned from now on")
        self.record(FORK_SERVER_ID, pid, f"{why}; workers are spawned from now on")

    # --- stopping -------------------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Replacements being started, the planner (it must not decide on a fleet that is going away), health (so it marks
        nobody dead on the way out), gateway, router, workers (SIGTERM: they drain), etcd, NATS."""
        fleet = self.fleet
        for task in list(self.replacing.values()):
            task.cancel()  # a start that is cancelled kills the process it was waiting for
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self.replacing.values(), return_exceptions=True)
        if self.owner is not None:
            await self.owner.cancel_starts()
        if fleet.fork_server is not None:  # nothing starts any more; the workers it forked are ours, stopped below
            pid = fleet.end_forking()
            if pid is not None:
                self.view.stopped(FORK_SERVER_ID, pid)
        if fleet.planner is not None:
            await self._terminate({PLANNER_ID: fleet.planner.process}, SERVICE_STOP_S)
        if self.owner is not None:
            await self.owner.close()
        for name, handle in ((HEALTH_ID, fleet.health), (GATEWAY_ID, fleet.gateway), (ROUTER_ID, fleet.router),
                             (MIGRATION_ID, fleet.migration)):
            if handle is not None:
                await self._terminate({name: handle.process}, SERVICE_STOP_S)
        await self._terminate({name: e.process for name, e in fleet.encoders.items()}, SERVICE_STOP_S)
        workers = {w.worker_id: w.process for w in fleet.workers.values()}
        await self._terminate({**workers, **(self.owner.stopping() if self.owner is not None else {})}, WORKER_STOP_S)
        if fleet.store is not None:
            await self._terminate({STORE_ID: fleet.store.process}, SERVICE_STOP_S)
        # After the attention workers, which drain through them.
        await self._terminate({name: h.process for name, h in fleet.expert_workers.items()}, SERVICE_STOP_S)
        if fleet.ert_manager is not None:
            await self._terminate({fleet.ert_manager.name: fleet.ert_manager.process}, SERVICE_STOP_S)
        await self._terminate({name: m.process for name, m in fleet.memories.items()}, SERVICE_STOP_S)
        fleet.remove_slots()
        fleet.close_infra()

    async def _terminate(self, processes: dict[str, subprocess.Popen], timeout: float) -> None:
        running = {name: p for name, p in processes.items() if p.poll() is None}
        for process in running.values():
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in running.values()):
            if time.monotonic() > deadline or self.hurry.is_set():
                for name, process in running.items():
                    if process.poll() is None:
                        self.view.killing(name, process.pid)
                        process.kill()
                        process.wait(10)
                break
            await asyncio.sleep(0.05)
        for name, process in running.items():
            self.view.stopped(name, process.pid, describe_exit(process.returncode))
