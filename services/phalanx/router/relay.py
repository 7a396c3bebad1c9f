"""What the router does when a worker's stream of one request ends, breaks or is handed back. Pure logic, no I/O.

The router relays a request's tokens from one worker at a time. When that
stream stops short, `RelayPolicy` decides what comes next from what happened
(events in) and says what to do (effects out); the servicer executes the
effects and reports their results back:

- a worker that refuses a new request before its first token (UNAVAILABLE,
  RESOURCE_EXHAUSTED) is replaced by another, up to ``MAX_ROUTE_ATTEMPTS``
  workers in all;
- a worker that hands the request back (it drains), or whose stream breaks
  mid-request in a way a migration can hide, has the request moved: by the
  migration service where there is one, else (a handoff only) by resuming the
  handed-back state on another worker;
- a stream broken with UNAVAILABLE is reported to health at once;
- after ``MAX_MOVES`` moves of one request, or on an error no move can hide,
  the client gets the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import grpc

__all__ = [
    "MAX_MOVES",
    "MAX_ROUTE_ATTEMPTS",
    "MIGRATABLE",
    "RETRY_ELSEWHERE",
    "AttachMoved",
    "Fail",
    "Finish",
    "GiveUp",
    "HandedBack",
    "Migrate",
    "MigrationResult",
    "MoveCause",
    "RelayPolicy",
    "ReportBroken",
    "ResumeElsewhere",
    "RetryElsewhere",
    "StreamBroke",
    "StreamEnded",
]

# Worker answers before the first token that mean "try another worker".
RETRY_ELSEWHERE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
MAX_ROUTE_ATTEMPTS = 3
MAX_MOVES = 8
# Mid-stream worker failures that a migration can hide from the client.
MIGRATABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
})


class MoveCause(Enum):
    HANDED_BACK = "handed back"
    STREAM_BROKE = "stream broke"


# -- events: what happened to the worker stream ----------------------------------------
@dataclass(frozen=True)
class StreamEnded:
    """The worker's stream ended by itself: the request is done."""


@dataclass(frozen=True)
class HandedBack:
    """The worker handed the request back (it drains) with the state to continue from."""

    worker_id: str


@dataclass(frozen=True)
class StreamBroke:
    worker_id: str
    code: grpc.StatusCode
    got_chunks: bool  # the worker sent something before it broke: the request already runs there


@dataclass(frozen=True)
class MigrationResult:
    """What the Migrate effect came to: the worker the request now runs on, or None (nothing moved it)."""

    moved_to: str | None


Event = StreamEnded | HandedBack | StreamBroke | MigrationResult


# -- effects: what the servicer does -----------------------------------------------------
@dataclass(frozen=True)
class ReportBroken:
    """Tell health the worker's stream broke (it probes the worker). Comes before the effect that decides."""

    worker_id: str


@dataclass(frozen=True)
class Finish:
    """The request is done: end the relay."""


@dataclass(frozen=True)
class RetryElsewhere:
    """Route the request again, to none of `exclude`, and open the same call there."""

    exclude: frozenset[str]


@dataclass(frozen=True)
class Migrate:
    """Ask the migration service to move the request off `worker_id`; report a MigrationResult."""

    worker_id: str
    cause: MoveCause
    code: grpc.StatusCode | None = None  # how the stream broke

    @property
    def reason(self) -> str:
        return self.cause.value if self.code is None else f"{self.cause.value}: {self.code.name}"


@dataclass(frozen=True)
class AttachMoved:
    """Attach to the request where the migration put it, from the next index the client lacks."""

    worker_id: str


@dataclass(frozen=True)
class ResumeElsewhere:
    """Route the handed-back request (prompt and output so far) to none of `exclude`, and continue it there."""

    exclude: frozenset[str]


@dataclass(frozen=True)
class Fail:
    """End the relay with the error of `worker_id`'s stream, passed on to the client."""

    worker_id: str


@dataclass(frozen=True)
class GiveUp:
    """The request moved too often: end the relay as unavailable."""

    moves: int


Effect = ReportBroken | Finish | RetryElsewhere | Migrate | AttachMoved | ResumeElsewhere | Fail | GiveUp


class RelayPolicy:
    """The failover decisions of one relayed request.

    `on(event)` returns the effects to execute, in order: at most a
    ReportBroken, then the one effect that decides how the relay goes on.
    """

    def __init__(self, *, retry_elsewhere: bool, can_migrate: bool) -> None:
        # Only a new request may go to another worker on refusal; one that runs somewhere must be moved.
        self.retry_elsewhere = retry_elsewhere
        self.can_migrate = can_migrate
        self.tried: set[str] = set()
        self.moves = 0
        self._migrating: Migrate | None = None

    def on(self, event: Event) -> tuple[Effect, ...]:
        if isinstance(event, StreamEnded):
            return (Finish(),)
        if isinstance(event, HandedBack):
            return (self._move(event.worker_id, MoveCause.HANDED_BACK),)
        if isinstance(event, StreamBroke):
            report = (ReportBroken(event.worker_id),) if event.code == grpc.StatusCode.UNAVAILABLE else ()
            return (*report, self._broke(event))
        if isinstance(event, MigrationResult):
            return (self._migrated(event),)
        raise TypeError(f"not a relay event: {event!r}")

    def moved_under(self) -> None:
        """A migration moved the request while its stream was still read (the relay was fenced off that worker):
        it runs elsewhere now, and counts as a move."""
        self.moves += 1
        self.retry_elsewhere = False

    def _broke(self, event: StreamBroke) -> Effect:
        if self._may_retry_elsewhere(event):
            self.tried.add(event.worker_id)
            return RetryElsewhere(frozenset(self.tried))
        if event.code not in MIGRATABLE or not self.can_migrate:
            return Fail(event.worker_id)
        return self._move(event.worker_id, MoveCause.STREAM_BROKE, event.code)

    def _may_retry_elsewhere(self, event: StreamBroke) -> bool:
        return (
            self.retry_elsewhere and not event.got_chunks and event.code in RETRY_ELSEWHERE
            and len(self.tried) + 1 < MAX_ROUTE_ATTEMPTS
        )

    def _move(self, worker_id: str, cause: MoveCause, code: grpc.StatusCode | None = None) -> Effect:
        self.moves += 1
        if self.moves > MAX_MOVES:
            return GiveUp(self.moves)
        if not self.can_migrate:
            # Only a handoff gets here (a broken stream without migration failed above): it carries its own state.
            return self._resume_elsewhere(worker_id)
        self._migrating = Migrate(worker_id, cause, code)
        return self._migrating

    def _migrated(self, result: MigrationResult) -> Effect:
        asked, self._migrating = self._migrating, None
        if asked is None:
            raise ValueError("a migration result without a migration")
        if result.moved_to is not None:
            self.retry_elsewhere = False
            return AttachMoved(result.moved_to)
        if asked.cause is MoveCause.STREAM_BROKE:
            return Fail(asked.worker_id)
        return self._resume_elsewhere(asked.worker_id)

    def _resume_elsewhere(self, worker_id: str) -> ResumeElsewhere:
        self.retry_elsewhere = False
        return ResumeElsewhere(frozenset({worker_id}))
