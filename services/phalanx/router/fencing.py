"""Which relays stop reading a worker because their request moved off it, or because it was declared dead. Pure logic, no I/O.

A relay reads a request's tokens from one worker at a time. The migration
service may move the request while the relay still reads that worker (it
hung, or its lease lapsed); from then on the old worker must deliver nothing
more to the client (fencing). `FencingPolicy`, one per router, follows which
worker each relay reads (events in) and says what to do (effects out); the
router's moves execute the effects:

- a migration moved a request off the worker its relay reads: stop reading,
  and once the stream is over continue where the request went, from the next
  index the client lacks, and ask the old worker to drop its copy;
- health declared a worker DEAD: relays still reading it stop, as if its
  stream broke, and their relay policy moves them (a hung worker's streams
  never break by themselves), unless a migration moved them already; a record
  of another incarnation of the worker (a stable id, restarted) changes
  nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Fence",
    "FencingPolicy",
    "Migrated",
    "ReadStarted",
    "ReadStopped",
    "StopReading",
    "StreamOver",
    "WorkerDead",
]


# -- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReadStarted:
    """A relay reads the request's stream from `worker_id` now."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class ReadStopped:
    """The relay's stream of the request is closed."""

    request_id: str


@dataclass(frozen=True)
class Migrated:
    """The migration service moved the request from `from_worker_id` to `worker_id` (at `worker_address`)."""

    request_id: str
    from_worker_id: str
    worker_id: str
    worker_address: str


@dataclass(frozen=True)
class WorkerDead:
    """Health declared the incarnation of `worker_id` started at `started_at` (0: any) DEAD; `registered_started_at`: the
    start of the incarnation registered now (None: none is)."""

    worker_id: str
    started_at: float
    registered_started_at: float | None


@dataclass(frozen=True)
class StreamOver:
    """The relay's stream of the request is over; `handed_back`: its worker handed the request back (it carries its state)."""

    request_id: str
    handed_back: bool


Event = ReadStarted | ReadStopped | Migrated | WorkerDead | StreamOver


# -- effects -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StopReading:
    """Cancel the relay's stream of the request: it ends as if it broke."""

    request_id: str


@dataclass(frozen=True)
class Fence:
    """The request was moved under its relay: count the move, ask `from_worker_id` to drop its copy, and continue on
    `worker_id` from the next index the client lacks."""

    request_id: str
    from_worker_id: str
    worker_id: str
    worker_address: str


Effect = StopReading | Fence


class FencingPolicy:
    """The fencing decisions of a router's relays. `on(event)` returns the effects to execute, in order."""

    def __init__(self) -> None:
        self._reading: dict[str, str] = {}  # request id -> the worker its relay reads from
        self._moved_under: dict[str, Migrated] = {}  # request id -> the move a relay has yet to follow

    def on(self, event: Event) -> tuple[Effect, ...]:
        if isinstance(event, ReadStarted):
            self._reading[event.request_id] = event.worker_id
            return ()
        if isinstance(event, ReadStopped):
            self._reading.pop(event.request_id, None)
            return ()
        if isinstance(event, Migrated):
            return self._migrated(event)
        if isinstance(event, WorkerDead):
            return self._dead(event)
        if isinstance(event, StreamOver):
            moved = self._moved_under.pop(event.request_id, None)
            if moved is None or event.handed_back:
                return ()  # a handoff carries its own state: the relay policy moves it
            return (Fence(moved.request_id, moved.from_worker_id, moved.worker_id, moved.worker_address),)
        raise TypeError(f"not a fencing event: {event!r}")

    def _migrated(self, event: Migrated) -> tuple[Effect, ...]:
        if self._reading.get(event.request_id) != event.from_worker_id or not event.worker_id or event.worker_id == event.from_worker_id:
            return ()  # not relayed here, or the relay already follows it (the router asked for this migration itself)
        self._moved_under[event.request_id] = event
        return (StopReading(event.request_id),)

    def _dead(self, event: WorkerDead) -> tuple[Effect, ...]:
        if event.registered_started_at is not None and event.started_at and event.registered_started_at != event.started_at:
            return ()  # another incarnation's record
        return tuple(
            StopReading(request_id) for request_id, worker_id in self._reading.items()
            if worker_id == event.worker_id and request_id not in self._moved_under
        )
