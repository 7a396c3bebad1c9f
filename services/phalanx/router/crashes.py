"""Which request kills the workers that run it: crash attribution for the poison-request quarantine. Pure logic, no I/O.

A request that crashes its worker (a kernel bug on a rare shape, a malformed
image, an out-of-memory on one prompt) would be moved to the next worker and
crash that one too, up to the relay's ``MAX_MOVES``. `CrashPolicy`, one per
router, follows which worker holds each request this router relays (events
in) and says what to do (effects out); the router's quarantine executes them.

The rule:

- A *crash* is a worker's death while it held requests: their streams broke
  as a dead process's do (UNAVAILABLE, UNKNOWN or INTERNAL with no status a
  living worker would attach). A drain hands requests back and is no crash;
  nor is a refusal, which carries the worker's reasons.
- The crash's *suspects* are the requests the worker held at that moment. A
  request sent to a worker that had died already (within ``same_death_s``:
  its registration outlives it by a lease) saw no crash of its own: it is
  not a suspect of anything.
- A suspect that moved and then ran ``probation_s`` on its new worker without
  a crash is *cleared*: it leaves the suspects of the crashes before its move.
- A request is quarantined when it has seen ``after_crashes`` crashes (K) and
  is the single common member of their suspect sets: no other uncleared
  request was in the batch at every one of them.
- A suspect is *scattered*: it moves to a worker where no other suspect of a
  crash it saw is on probation (it moved there less than ``probation_s`` ago
  and has not crashed it since); with no such worker it waits for the first
  probation to end (``Wait``). So the poison reaches its next worker without
  an uncleared request that shared its last one, and its next crash names it
  alone: with K = 2 a poison costs two workers.

Limits, stated so that nobody relies on more:

- Each router sees only the requests it relays: with several replicas a
  crash's suspects are each router's share of the batch, and scattering keeps
  apart only one router's suspects. A good request of router A that meets
  router B's poison on K workers in a row is blamed, though scattering makes
  that unlikely.
- Two poison requests that always travel together, or a crash that comes later
  than the probation after the move, are not told apart: such a request is
  moved until the relay's ``MAX_MOVES`` ends it, as before.
- A worker declared DEAD by health while it hung (its streams cancelled by the
  router) is no crash here: only process deaths count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CrashPolicy",
    "Crashed",
    "Held",
    "Move",
    "Placed",
    "Placing",
    "Quarantine",
    "Released",
    "Wait",
]


# -- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """The request runs on `worker_id` now (its relay reads it from there)."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Released:
    """The request's relay is over (finished, failed, or the client left)."""

    request_id: str


@dataclass(frozen=True)
class Crashed:
    """The request's stream from `worker_id` broke as a dead process's does, at monotonic time `at`."""

    request_id: str
    worker_id: str
    at: float


@dataclass(frozen=True)
class Placing:
    """The request is about to move, at monotonic time `at`, to one of `candidates` (the workers it may go to)."""

    request_id: str
    candidates: frozenset[str]
    at: float


@dataclass(frozen=True)
class Placed:
    """The request moved to `worker_id` at `at`."""

    request_id: str
    worker_id: str
    at: float


Event = Held | Released | Crashed | Placing | Placed


# -- effects -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Quarantine:
    """End the request: it was the one common suspect of `crashes` worker deaths."""

    request_id: str
    crashes: int


@dataclass(frozen=True)
class Move:
    """Move the request to a worker outside `avoid`."""

    request_id: str
    avoid: frozenset[str]


@dataclass(frozen=True)
class Wait:
    """Every candidate holds another suspect on probation: ask again in `seconds`."""

    request_id: str
    seconds: float


Effect = Quarantine | Move | Wait


@dataclass
class _OpenCrash:
    """One worker's death while this router relays its requests: the suspects, and those whose stream is yet to break."""

    suspects: set[str]  # shared with the requests' histories: a suspect cleared later leaves it
    pending: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Probation:
    worker_id: str
    until: float


class CrashPolicy:
    """The crash attribution of one router's relays. `on(event)` returns the effects to execute, in order.

    `after_crashes`: K, the crashes a request must have seen to be quarantined; `probation_s`: how long a moved suspect
    keeps its crash-mates off its new worker.
    """

    def __init__(self, *, after_crashes: int, probation_s: float, same_death_s: float = 10.0) -> None:
        if after_crashes < 1:
            raise ValueError("after_crashes must be >= 1")
        self.after_crashes = after_crashes
        self.probation_s = probation_s
        self.same_death_s = same_death_s
        self._died: dict[str, float] = {}  # worker id -> when its last death was seen
        self._held: dict[str, str] = {}  # request id -> its worker
        self._open: dict[str, _OpenCrash] = {}  # worker id -> its death, while some suspect's stream is yet to break
        self._seen: dict[str, list[set[str]]] = {}  # request id -> the suspects of every crash it saw
        self._probation: dict[str, _Probation] = {}
        self.deaths = 0  # worker deaths seen (each once, however many of its streams broke)

    def crashes_seen(self, request_id: str) -> int:
        return len(self._seen.get(request_id, ()))

    @property
    def tracked(self) -> int:
        """Requests with a crash history (bounded by the requests in flight: a released one is forgotten)."""
        return len(self._seen)

    def on(self, event: Event) -> tuple[Effect, ...]:
        if isinstance(event, Held):
            return self._on_held(event)
        if isinstance(event, Released):
            self._forget(event.request_id)
            return ()
        if isinstance(event, Crashed):
            return self._on_crashed(event)
        if isinstance(event, Placing):
            return (self._place(event),)
        if isinstance(event, Placed):
            if event.request_id in self._seen:
                self._probation[event.request_id] = _Probation(event.worker_id, event.at + self.probation_s)
            return ()
        raise TypeError(f"not a crash event: {event!r}")

    def _on_held(self, event: Held) -> tuple[Effect, ...]:
        self._held[event.request_id] = event.worker_id
        return ()

    def _on_crashed(self, event: Crashed) -> tuple[Effect, ...]:
        request_id, worker_id = event.request_id, event.worker_id
        self._clear(event.at)
        self._held.pop(request_id, None)
        crash = self._open.get(worker_id)
        if crash is None or request_id not in crash.pending:
            died = self._died.get(worker_id)
            if died is not None and event.at - died < self.same_death_s:
                return ()  # sent to a worker already dead (still registered): its death was before this request came
            # The first stream of this death to break: every request the worker held is a suspect.
            suspects = {request_id, *(r for r, w in self._held.items() if w == worker_id)}
            crash = self._open[worker_id] = _OpenCrash(suspects, set(suspects))
            self._note_death(worker_id, event.at)
        crash.pending.discard(request_id)
        if not crash.pending:
            del self._open[worker_id]
        self._probation.pop(request_id, None)  # it crashed its new worker: no longer a clean mate there
        seen = self._seen.setdefault(request_id, [])
        seen.append(crash.suspects)
        if len(seen) >= self.after_crashes and set.intersection(*seen) == {request_id}:
            return (Quarantine(request_id, len(seen)),)
        return ()

    def _note_death(self, worker_id: str, at: float) -> None:
        self.deaths += 1
        self._died[worker_id] = at
        for worker, died in list(self._died.items()):  # bounded by the workers that died lately
            if at - died >= self.same_death_s:
                del self._died[worker]

    def _clear(self, at: float) -> None:
        """Suspects whose probation ended by `at` without a crash leave the suspects of the crashes before their move."""
        for request_id, probation in list(self._probation.items()):
            if probation.until <= at:
                del self._probation[request_id]
                for suspects in self._seen.get(request_id, ()):
                    suspects.discard(request_id)

    def _place(self, event: Placing) -> Effect:
        seen = self._seen.get(event.request_id)
        if not seen:
            return Move(event.request_id, frozenset())
        mates = set().union(*seen) - {event.request_id}
        on_probation = [p for mate in mates if (p := self._probation.get(mate)) is not None and p.until > event.at]
        busy = frozenset(p.worker_id for p in on_probation)
        if event.candidates - busy or not on_probation:
            return Move(event.request_id, busy)
        return Wait(event.request_id, min(p.until for p in on_probation) - event.at)

    def _forget(self, request_id: str) -> None:
        worker_id = self._held.pop(request_id, "")
        crash = self._open.get(worker_id)
        if crash is not None:
            crash.pending.discard(request_id)
            if not crash.pending:
                del self._open[worker_id]
        self._seen.pop(request_id, None)
        self._probation.pop(request_id, None)
