"""A supervisor's view for tests: it keeps what the supervisor shows it instead of drawing a board."""

from __future__ import annotations

from phalanx.launch.events import ProcessState, SupervisorEvent

__all__ = ["RecordedView"]


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
