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
  nor is a refusal, which carries the worker's reasons. A request sent to a
  worker that had died already (within ``same_death_s``: its registration
  outlives it by a lease) saw no crash: the death came before it.
- The crash's *suspects* are the requests that worker had taken but not yet
  streamed a token of: they were being prefilled or restored, where an
  out-of-memory, a malformed image or a kernel on a new shape strikes. A
  death while every request was decoding (most deaths: a lost machine, a
  kill) has no suspects and blames no one.
- A suspect that moved and then ran ``probation_s`` on its new worker without
  a crash is *cleared*: it leaves the suspects of the crashes before its move.
- A request is quarantined when it has been a suspect of ``after_crashes``
  crashes (K) and is the single common member of their suspects: no other
  uncleared request was a suspect of every one of them.
- Suspects are *scattered*: a suspect moves away from the workers other
  uncleared suspects of its crashes went to, while another worker can take it
  (``Move.avoid``; nothing waits for it), so that the next crash has one
  common suspect. A poison caught at its prefill, among streams that had
  started before it came, costs K workers.

Limits, stated so that nobody relies on more:

- Each router sees only the requests it relays: with several replicas a
  crash's suspects are each router's share of the batch, and scattering keeps
  apart only one router's suspects. A good request of router A that meets
  router B's poison on K workers in a row is blamed, though scattering makes
  that unlikely.
- Requests that came to a worker together and crashed it together stay
  co-suspects until scattering parts them; with more of them than workers to
  part them on, the poison may cost more than K workers. Two poisons that
  always travel together are never told apart.
- A poison that crashes its worker only after it streamed tokens there (in
  its decode) is no suspect: it is moved until the relay's ``MAX_MOVES`` ends
  it, as before; so is one whose crash comes later than ``probation_s`` after
  each move.
- Two unrelated deaths, each while a request was in its prefill or restore
  on the dying worker and no other suspect of the first was with it on the
  second, look like a poison and blame that request (with K = 2: a chaos run
  that kills a worker mid-prefill and then the worker its requests were
  restored on, within their restore).
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
    "Streamed",
]


# -- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """The request runs on `worker_id` now (its relay reads it from there)."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Streamed:
    """The request's worker streamed it a token: it is past its prefill (or restore) there."""

    request_id: str


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


Event = Held | Streamed | Released | Crashed | Placing | Placed


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


Effect = Quarantine | Move


@dataclass
class _OpenCrash:
    """One worker's death while this router relays its requests: the suspects, and those whose stream is yet to break."""

    suspects: set[str]  # shared with the requests' histories: a suspect cleared later leaves it
    pending: set[str] = field(default_factory=set)  # what the worker held, whose streams are yet to break


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
        self._fresh: set[str] = set()  # held requests their worker has not streamed a token of yet
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
        if isinstance(event, Streamed):
            self._fresh.discard(event.request_id)
            return ()
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
        self._fresh.add(event.request_id)
        return ()

    def _on_crashed(self, event: Crashed) -> tuple[Effect, ...]:
        request_id, worker_id = event.request_id, event.worker_id
        self._clear(event.at)
        crash = self._open.get(worker_id)
        if crash is None or request_id not in crash.pending:
            died = self._died.get(worker_id)
            if died is not None and event.at - died < self.same_death_s:
                self._held.pop(request_id, None)
                return ()  # sent to a worker already dead (still registered): its death was before this request came
            # The first stream of this death to break: the worker's requests in their prefill or restore are the suspects.
            held = {r for r, w in self._held.items() if w == worker_id} | {request_id}
            crash = self._open[worker_id] = _OpenCrash(held & self._fresh, set(held))
            self._note_death(worker_id, event.at)
        self._held.pop(request_id, None)
        self._fresh.discard(request_id)
        crash.pending.discard(request_id)
        if not crash.pending:
            del self._open[worker_id]
        if request_id not in crash.suspects:
            return ()
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

    def _place(self, event: Placing) -> Move:
        seen = self._seen.get(event.request_id)
        if not seen:
            return Move(event.request_id, frozenset())
        mates = set().union(*seen) - {event.request_id}
        busy = frozenset(p.worker_id for mate in mates if (p := self._probation.get(mate)) is not None and p.until > event.at)
        return Move(event.request_id, busy if event.candidates - busy else frozenset())

    def _forget(self, request_id: str) -> None:
        worker_id = self._held.pop(request_id, "")
        self._fresh.discard(request_id)
        crash = self._open.get(worker_id)
        if crash is not None:
            crash.pending.discard(request_id)
            if not crash.pending:
                del self._open[worker_id]
        self._seen.pop(request_id, None)
        self._probation.pop(request_id, None)
