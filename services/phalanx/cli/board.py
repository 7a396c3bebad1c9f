"""`phalanx up`'s live board: each process's state as a live table on a terminal, one line per change otherwise (a log file).

It is the supervisor's view (phalanx.launch.events.SupervisorView): the supervisor reports, the board shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from phalanx.launch.events import ProcessState, SupervisorEvent
from phalanx.launch.local_fleet import PLANNER_ID

__all__ = ["Board"]


@dataclass
class _Row:
    state: str = ProcessState.STARTING
    address: str = ""
    pid: int | None = None
    note: str = ""


# Rows of processes that died and were replaced stay on the board as a record; this many at most.
_MAX_REPLACED_ROWS = 8
_MARKS = {"ready": ("✓", "green"), "external": ("✓", "green"), "failed": ("✗", "red"), "replaced": ("✗", "red"),
          "restarting": ("↻", "yellow"), "spare": ("✓", "cyan")}


@dataclass
class Board:
    """Each component's status: a live table on a terminal, one line per change otherwise (a log file)."""

    console: Console
    rows: dict[str, _Row] = field(default_factory=dict)
    _live: Live | None = None

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        if not self.console.is_terminal:
            yield
            return
        with Live(self._render(), console=self.console, refresh_per_second=8) as self._live:
            try:
                yield
            finally:
                self._live.update(self._render(), refresh=True)
                self._live = None

    def show(self, name: str, state: ProcessState, address: str = "", pid: int | None = None, *, note: str = "") -> None:
        self.rows[name] = _Row(state, address, pid, note)
        replaced = [n for n, row in self.rows.items() if row.state == ProcessState.REPLACED]
        for old in replaced[:-_MAX_REPLACED_ROWS]:
            del self.rows[old]
        if self._live is not None:
            self._live.update(self._render())
        else:
            self.console.print(self._line(name, self.rows[name]))

    def forget(self, name: str) -> None:
        self.rows.pop(name, None)

    def event(self, event: SupervisorEvent) -> None:
        if event.what.startswith("started"):
            mark, style = "✓", "green"
        elif event.process == PLANNER_ID or event.what.startswith(("draining:", "stopped after draining")):
            mark, style = "→", "cyan"  # the planner's decisions and their effects: no failure
        else:
            mark, style = "✗", "red"
        pid = f" (pid {event.pid})" if event.pid else ""
        self.console.print(f"[{style}]{mark} {event.process}{pid} {event.what}[/]", highlight=False)

    def killing(self, name: str, pid: int) -> None:
        self.console.print(f"  [red]{name} (pid {pid}) did not stop; killing it[/]")

    def stopped(self, name: str, pid: int | None = None, how: str = "") -> None:
        details = ", ".join(part for part in (f"pid {pid}" if pid else "", how) if part)
        self.console.print(f"  stopped {name}{f' ({details})' if details else ''}", highlight=False)

    def _line(self, name: str, row: _Row) -> Text:
        mark = _MARKS.get(row.state, ("…", "yellow"))
        text = Text.assemble((mark[0], mark[1]), f" {name:<12} {row.state:<10}")
        if row.address:
            text.append(f" {row.address}")
        if row.pid:
            text.append(f"  pid {row.pid}")
        if row.note:
            text.append(f"  ({row.note})")
        return text

    def _render(self) -> Table:
        table = Table(box=None, show_header=False, padding=(0, 1))
        for name, row in self.rows.items():
            if row.state == ProcessState.STARTING:
                table.add_row(Spinner("dots", style="yellow"), name, Text("starting…", style="yellow"), "", "")
            else:
                line = self._line(name, row)
                pid = f"pid {row.pid}" if row.pid else ""
                table.add_row(line[:1], name, row.state, row.address, f"{pid}  {row.note}".strip())
        return table
