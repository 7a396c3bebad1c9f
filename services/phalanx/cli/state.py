"""The state file of `phalanx up`: who supervises the local stack and where its pieces listen.

One JSON file (default ``~/.phalanx/up.json``, env ``PHALANX_STATE_FILE``).
The supervisor claims it atomically when it starts (``status: "starting"``),
so two `phalanx up` on one file cannot both run; rewrites it once every
process is ready (``status: "ready"``); removes it when it stops cleanly.
`phalanx down` signals the PID it names, but only after /proc shows that PID
is still a `phalanx up` (PIDs are reused); `phalanx generate` and `phalanx
status` read the router's address from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from phalanx.launch.events import SupervisorEvent

__all__ = [
    "DEFAULT_TARGET",
    "ProcessEntry",
    "SupervisorEvent",
    "UpState",
    "WorkerEntry",
    "claim_state",
    "default_state_file",
    "is_phalanx_up",
    "live_state",
    "log_file_for",
    "pid_alive",
    "read_state",
    "remove_state",
    "resolve_target",
    "write_state",
]

DEFAULT_TARGET = "127.0.0.1:50051"
_VERSION = 1


@dataclass
class WorkerEntry:
    worker_id: str
    address: str  # "" for an engine of a failover slot that stands by (not registered yet)
    pid: int
    # `phalanx up --failover`: the role it started in (primary, shadow), its slot, and where its /metrics (and probes) are.
    role: str = ""
    slot: str = ""
    metrics_address: str = ""


@dataclass
class ProcessEntry:
    """A service other than the router and the workers (health, checkpoint store, migration)."""

    name: str
    address: str
    pid: int
    metrics_address: str = ""  # its Prometheus /metrics (host:port), where it has one


@dataclass
class UpState:
    """What the state file holds; ``status`` is "starting" until every process is ready."""

    supervisor_pid: int
    started_at: float = field(default_factory=time.time)
    status: Literal["starting", "ready"] = "starting"
    model: str = ""
    router_id: str = ""
    router_address: str = ""
    router_metrics_address: str = ""
    router_pid: int | None = None
    workers: list[WorkerEntry] = field(default_factory=list)
    services: list[ProcessEntry] = field(default_factory=list)
    nats_url: str = ""
    nats_pid: int | None = None  # None: an external NATS we did not start
    etcd_endpoint: str = ""
    etcd_pid: int | None = None
    log_file: str = ""  # set by `phalanx up --detach`
    gateway_url: str = ""  # the OpenAI-compatible gateway's base URL ("" when none runs)
    ready_at: float | None = None
    events: list[SupervisorEvent] = field(default_factory=list)
    # `phalanx up --planner`: the planner's bounds and targets, the decision followed (phalanx.planner.local_connector LocalConnector.state).
    planner: dict[str, Any] | None = None
    certs_dir: str = ""  # `phalanx up --tls`: the CA and one directory per identity (admin/, client/ ...); "" without TLS

    def pids(self) -> list[int]:
        """Every process of the stack that the supervisor started, supervisor included."""
        pids = [self.supervisor_pid, self.router_pid, *(w.pid for w in self.workers), *(s.pid for s in self.services), self.etcd_pid,
                self.nats_pid]
        return [pid for pid in pids if pid]

    def to_json(self) -> str:
        return json.dumps({"version": _VERSION, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> UpState:
        """Parse a state file; ValueError when it is not one."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("not an object")
            known = {f.name for f in fields(cls)}  # a newer writer's extra keys are ignored
            data = {k: v for k, v in data.items() if k in known}
            data["workers"] = [WorkerEntry(**w) for w in data.get("workers", [])]
            data["services"] = [ProcessEntry(**p) for p in data.get("services", [])]
            data["events"] = [SupervisorEvent(**e) for e in data.get("events", [])]
            return cls(**data)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a phalanx state file: {error}") from error


def default_state_file() -> Path:
    """``$PHALANX_STATE_FILE``, else ``~/.phalanx/up.json``."""
    return Path(os.environ.get("PHALANX_STATE_FILE") or Path.home() / ".phalanx" / "up.json")


def log_file_for(state_file: Path) -> Path:
    """Where a detached supervisor writes its output: next to the state file."""
    return state_file.with_name(state_file.stem + ".log")


def read_state(path: Path) -> UpState | None:
    """The state in ``path``; None when there is none. Raises ValueError for a file that is not one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return UpState.from_json(text)


def pid_alive(pid: int) -> bool:
    """Whether a process (not a zombie) with this PID exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        # A zombie still answers kill(0) but is gone for our purposes: its cmdline is empty.
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    return True


def is_phalanx_up(pid: int) -> bool:
    """Whether ``pid`` is a live `phalanx up` supervisor (and not some process that reused the PID).

    Matches both ``python -m phalanx.cli up …`` and the ``phalanx up …`` console script.
    """
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    for i, arg in enumerate(args[:-1]):
        if arg in (b"phalanx.cli", b"phalanx.cli.main") or os.path.basename(arg) == b"phalanx":
            return args[i + 1] == b"up"
    return False


def live_state(path: Path) -> UpState | None:
    """The state in ``path`` if its supervisor is alive; None if there is no file or it is stale."""
    try:
        state = read_state(path)
    except ValueError:
        return None
    if state is None or not is_phalanx_up(state.supervisor_pid):
        return None
    return state


def _write_new(path: Path, text: str) -> bool:
    """Create ``path`` with ``text`` atomically; False if it already exists."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # fails if path exists: the exclusive create that also never shows a half-written file
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def claim_state(path: Path, state: UpState) -> UpState | None:
    """Write ``state`` to a fresh ``path``, replacing a stale file. Returns the live state in the way, else None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        if _write_new(path, state.to_json()):
            return None
        existing = live_state(path)
        if existing is not None:
            return existing
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # stale: its supervisor is gone
    raise RuntimeError(f"could not claim {path}: another phalanx up keeps recreating it")


def write_state(path: Path, state: UpState) -> None:
    """Replace the state atomically (readers never see a half-written file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(state.to_json())
    os.replace(tmp, path)


def remove_state(path: Path, supervisor_pid: int | None = None) -> bool:
    """Remove the state file; with ``supervisor_pid``, only if it still names that supervisor."""
    if supervisor_pid is not None:
        try:
            state = read_state(path)
        except ValueError:
            return False
        if state is None or state.supervisor_pid != supervisor_pid:
            return False
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def resolve_target(target: str | None, state_file: Path | None = None) -> str:
    """The router to talk to: ``target`` (--target / $PHALANX_TARGET), else the running stack's, else 127.0.0.1:50051."""
    if target:
        return target
    state = live_state(state_file or default_state_file())
    if state is not None and state.router_address:
        return state.router_address
    return DEFAULT_TARGET
