"""What the supervisor reports, and to whom: process states and events, through a view it is given.

The supervisor (phalanx.launch.supervisor) knows nothing of a terminal: `phalanx up`'s live board
(phalanx.cli.board) is one `SupervisorView`; a test's is a list.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

__all__ = ["MAX_EVENTS", "ProcessState", "SupervisorEvent", "SupervisorView"]


class ProcessState(enum.StrEnum):
    """Where one supervised process stands."""

    WAITING = "waiting"  # for what it needs to start (the router for its workers)
    STARTING = "starting"
    READY = "ready"
    EXTERNAL = "external"  # not ours: NATS or etcd given by the operator
    RESTARTING = "restarting"  # died; its replacement starts after a backoff
    REPLACED = "replaced"  # died; replaced under another name
    FAILED = "failed"
    SPARE = "spare"  # a hot spare: warm, not routed to
    DRAINING = "draining"  # stopping after a scale-down: its requests move elsewhere


@dataclass
class SupervisorEvent:
    """Something the supervisor saw or did: a process that died, its replacement, a crash loop."""

    at: float
    process: str
    pid: int | None
    what: str


# The state file keeps the latest events only.
MAX_EVENTS = 50


class SupervisorView(Protocol):
    """Where the supervisor's reports go."""

    def show(self, name: str, state: ProcessState, address: str = "", pid: int | None = None, *, note: str = "") -> None:
        """``name`` is now in ``state``."""
        ...

    def forget(self, name: str) -> None:
        """``name`` is gone for good (a drained worker, a cancelled start): no longer shown."""
        ...

    def event(self, event: SupervisorEvent) -> None:
        """Something happened (also kept in the state file's events)."""
        ...

    def killing(self, name: str, pid: int) -> None:
        """``name`` did not stop in time on the way out: it gets SIGKILL."""
        ...

    def stopped(self, name: str, pid: int | None = None, how: str = "") -> None:
        """``name`` stopped on the way out (``how``: its exit status in words, where known)."""
        ...
