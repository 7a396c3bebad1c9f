"""`phalanx chaos kill <process>`: kill a process of the local `phalanx up` stack, by the PID its state file names.

The demo of what Phalanx promises: the supervisor replaces what died and
everything else keeps serving. Only processes the state file lists are
touched, and only after /proc shows the PID still runs what we started
(PIDs are reused).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.cli.state import UpState, live_state

__all__ = ["KillError", "KillResult", "kill_process", "stack_processes"]

# What each kind of process runs, to tell it from an unrelated process that reused its PID.
_PHALANX = b"phalanx"
_COMMANDS = {"nats": b"nats-server", "etcd": b"etcd"}


class KillError(Exception):
    """Something the user should read."""


@dataclass(frozen=True)
class KillResult:
    process: str
    pid: int
    signal: str
    replaced_by: str = ""  # "worker-3 (pid 1234)", once the supervisor reported the replacement (--wait)
    replaced_after_s: float = 0.0


def stack_processes(state: UpState) -> dict[str, int]:
    """Every process of the stack by name (worker-0, router-0, health-0, checkpoint-0, migration-0, nats, etcd) -> PID."""
    processes = {w.worker_id: w.pid for w in state.workers}
    if state.router_pid:
        processes[state.router_id or "router"] = state.router_pid
    processes.update({s.name: s.pid for s in state.services})
    if state.nats_pid:
        processes["nats"] = state.nats_pid
    if state.etcd_pid:
        processes["etcd"] = state.etcd_pid
    return processes


def kill_process(state_file: Path, name: str, *, sig: signal.Signals = signal.SIGKILL, wait_s: float = 0.0) -> KillResult:
    """Send ``sig`` to the stack's process ``name`` ("worker" picks the first worker); with ``wait_s``, wait for its replacement."""
    state = live_state(state_file)
    if state is None:
        raise KillError(f"nothing is up (no live `phalanx up` in {state_file})")
    processes = stack_processes(state)
    if name == "worker" and state.workers:
        name = state.workers[0].worker_id
    if name not in processes:
        raise KillError(f"no process {name!r} in this stack; its processes: {', '.join(processes)}")
    pid = processes[name]
    if not _runs(pid, _COMMANDS.get(name, _PHALANX)):
        raise KillError(f"{name}'s pid {pid} no longer runs it (the supervisor may be replacing it); see `phalanx status`")
    killed_at = time.monotonic()
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise KillError(f"{name} (pid {pid}) exited before the signal reached it") from None
    result = KillResult(process=name, pid=pid, signal=sig.name)
    if wait_s <= 0:
        return result
    deadline = killed_at + wait_s
    while time.monotonic() < deadline:
        replacement = _replacement(live_state(state_file), name, pid)
        if replacement:
            return KillResult(name, pid, sig.name, replacement, time.monotonic() - killed_at)
        time.sleep(0.1)
    raise KillError(f"killed {name} (pid {pid}), but the supervisor reported no replacement within {wait_s:.0f} s")


def _replacement(state: UpState | None, name: str, pid: int) -> str:
    """ "worker-3 (pid 1234)" once the state file's events say a process replaced ``name`` (pid ``pid``)."""
    if state is None:
        return ""
    for event in state.events:
        if event.what.startswith(f"started to replace {name} (pid {pid})"):
            return f"{event.process} (pid {event.pid})"
    return ""


def _runs(pid: int, command: bytes) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return command in cmdline
