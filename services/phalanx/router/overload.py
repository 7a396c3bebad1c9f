"""SLO-aware admission: serve through overload instead of flipping between admitting all and refusing all. Pure logic, no I/O.

A new request is admitted when, on the worker it would go to, both its predicted time to first token and the
inter-token latency that worker's batch would have with it fit its tier's SLOs (times ``headroom``). Otherwise it is
held in a bounded queue (higher tiers first, first come first served within a tier) until a worker has room, for
at most ``max_hold_share`` of its TTFT SLO, and refused only when it cannot make its TTFT SLO any more: at once when
the batch slot its place in the queue needs will not open within its hold (`OverloadPolicy._hold_prediction`: so most
refusals are answered in microseconds, not after a hold), later if it was held and its slot came too late after all.
The router's shell (phalanx.router.gate) feeds it events and executes its effects.

Predictions, per routable worker, from what the router already knows (phalanx.router.routing.WorkerLoad):

- batch = running + queued at the worker, plus the requests this router sent there since its last load report,
  minus those that finished since (a finished stream frees its slot before the next report says so);
- ITL with the request = step time at batch + 1, from a line fitted to (batch, token gap) pairs: every gap between
  two tokens the router relays from the worker, with the running sequences of its last load report (exponentially
  forgotten; the batch with routed requests added counts some still in their prefill, and made the slope too flat). The gaps are
  live; the step time of the load reports is an average over the last ten or so steps, seconds behind a burst, and a
  line through it admitted a whole burst onto a batch that was already full. While a worker's gaps show no spread
  of batch sizes, the fleet's line counts; while neither has one, the mean gap scaled by (batch + 1) / its mean
  batch, which overestimates a step with a fixed cost, so it errs on the side of the SLO; and while nothing was
  measured at all (a cold fleet), one sequence per worker, until the first gaps say what a step costs. Two guards
  keep a wrong line from filling a worker: the batch grows to at most twice (or two more than) the running
  sequences of the last load report, and not at all while the worker's recent gaps are over the SLO already;
- TTFT = prompt tokens queued ahead and its own over the measured prefill rate, plus one step at batch + 1; a held
  request's budget is what is left of its SLO since it arrived.

A request is held only when its slot is predicted to open within its hold by more than the hold margin: the
`hold_confidence` quantile of how late recent holds' slots came against their prediction (a failed hold counts at least
as late as its deadline). The predictions err (streams end early or late, batches of other routers grow, prompts queue
ahead) and a hold that fails answers its client with a refusal up to half a TTFT SLO late: the margin keeps failed holds
as rare as `hold_confidence` says, measured on this fleet rather than assumed.

A held request ``k`` places from the head waits for the ``k``-th batch slot to free: the ``k``-th soonest end of the
streams this router relays (each within its tokens left, at its worker's step time), or, where those are too few to
tell (requests without max_tokens, streams of other routers), about ``k / drain``, the drain rate being the streams
that finished per second over the last ``drain_window_s``. The retry hint of a refusal is the time the queue ahead of it
takes to drain (clamped), so clients come back when there is room rather than all at once.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from phalanx.router.routing import WorkerLoad

__all__ = [
    "Admit",
    "AdmissionSettings",
    "Arrival",
    "Hold",
    "OverloadPolicy",
    "Refuse",
    "RefuseReason",
    "StepModel",
    "TierSlo",
]


@dataclass(frozen=True)
class TierSlo:
    """The latency a tier is promised: time to first token and inter-token latency, in seconds (0: none)."""

    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class AdmissionSettings:
    max_queued: int = 256  # requests held at once; beyond, the lowest tier's newest is refused
    headroom: float = 0.9  # admit when the predictions are within this share of the SLOs
    # Hold a request at most this share of its TTFT SLO. The router sees its TTFT only from its own door: the client's,
    # the gateway's and the network's share of it come on top, and a request admitted at the very end of its budget
    # missed it (the goodput bench on a busy box: 61 % of admitted requests met the SLOs at 4x with the whole budget).
    max_hold_share: float = 0.5
    # Hold a request only when it reaches a worker within its hold at least this likely (`OverloadPolicy._hold_prediction`); a
    # refusal after a hold comes late (the client waited for nothing), one at arrival in microseconds.
    hold_confidence: float = 0.95
    drain_window_s: float = 5.0  # finished streams counted for the drain rate
    min_retry_after_s: float = 0.5
    max_retry_after_s: float = 30.0
    default_retry_after_s: float = 1.0  # while no drain rate is measured
    default_prefill_tokens_per_s: float = 4000.0  # for workers (and a fleet) that measured none


@dataclass(frozen=True)
class Arrival:
    request_id: str
    tier: int  # phalanx.router.admission.Tier: lower is served first
    prompt_tokens: int
    arrived_at: float
    slo: TierSlo
    max_tokens: int = 0  # the most tokens it may generate (0: unknown): how long its batch slot may stay taken


class RefuseReason(StrEnum):
    QUEUE_TOO_SLOW = "queue_too_slow"  # the queue ahead drains too slowly for its TTFT budget
    BUDGET_SPENT = "budget_spent"  # held until its TTFT budget ran out
    QUEUE_FULL = "queue_full"  # the queue is full of requests of its tier or higher
    DISPLACED = "displaced"  # held, and pushed out of a full queue by a higher tier


@dataclass(frozen=True)
class Admit:
    request_id: str
    worker_id: str | None  # None: no routable worker; routing answers UNAVAILABLE (that is not overload)
    waited_s: float = 0.0
    prompt_tokens: int = field(default=0, compare=False)  # what the worker will prefill (the shell notes it as routed)
    late_s: float | None = field(default=None, compare=False)  # held: how much later than predicted it went (None: no prediction)


@dataclass(frozen=True)
class Hold:
    request_id: str


@dataclass(frozen=True)
class Refuse:
    request_id: str
    reason: RefuseReason
    retry_after_s: float
    waited_s: float = 0.0
    late_s: float | None = field(default=None, compare=False)  # held: at least how much later than predicted it would have gone


Decision = Admit | Hold | Refuse


# A worker's batch may grow to this multiple of the running sequences of its last load report (or by this many), and
# further once a report shows the bigger batch: the gaps' batch sizes are as old as the report, and a burst admitted on
# a line measured at small batches overshot the ITL SLO several times over on a busy box.
# Finished streams in the drain window for its rate to count (fewer: the last rate that had as many).
MIN_DRAIN_EVENTS = 3
SLOW_START_FACTOR = 2
SLOW_START_STEP = 2
# A worker's first token gaps are left out of the step models: a fresh process's first steps pay its kernels' first-call
# setup, and a cold fleet's burst, held while those gaps said a step took most of a second, was refused as hopeless (the
# fault-free wave of `bench failover`: 12 streams on 3 fresh workers).
WARMUP_GAPS = 2
# The hold margin counts the last HOLD_ERRORS_KEPT holds' errors of at most HOLD_ERROR_AGE_S ago: a fleet's errors change
# with its load, and a margin grown by a burst's failed holds must not refuse every hold for good once it passed.
HOLD_ERRORS_KEPT = 32
HOLD_ERROR_AGE_S = 30.0


class StepModel:
    """step_s = a + b * batch, least squares over exponentially forgotten samples (token gaps and their batch)."""

    MIN_WEIGHT = 3.0  # samples (after forgetting) before the line counts
    MIN_SPREAD = 0.25  # variance of the batch sizes seen: below, a line through them says nothing of other sizes

    def __init__(self, forget: float = 0.99) -> None:
        self.forget = forget
        self._w = self._n = self._y = self._nn = self._ny = 0.0
        self.recent = 0.0  # the last few gaps' moving average
        self.largest_batch = 0  # the largest batch a gap was measured at: up to it, the line is no guess

    def add(self, running: int, step_s: float) -> None:
        if running <= 0 or step_s <= 0:
            return
        self.recent = step_s if not self.recent else 0.7 * self.recent + 0.3 * step_s
        self.largest_batch = max(self.largest_batch, running)
        f = self.forget
        self._w = self._w * f + 1.0
        self._n = self._n * f + running
        self._y = self._y * f + step_s
        self._nn = self._nn * f + running * running
        self._ny = self._ny * f + running * step_s

    def mean(self) -> tuple[float, float] | None:
        """(mean batch, mean step) of the samples; None before the first."""
        if self._w <= 0:
            return None
        return self._n / self._w, self._y / self._w

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None while the samples cannot tell a slope (too few, too little spread, or falling)."""
        if self._w < self.MIN_WEIGHT:
            return None
        mean_n, mean_y = self._n / self._w, self._y / self._w
        spread = self._nn / self._w - mean_n * mean_n
        if spread < self.MIN_SPREAD:
            return None
        slope = (self._ny / self._w - mean_n * mean_y) / spread
        if slope < 0:
            return None
        return mean_y - slope * mean_n, slope


@dataclass(frozen=True)
class _Held:
    arrival: Arrival
    order: tuple[int, float, int]
    expected_at: float | None = None  # when its slot was predicted to open (None: nothing measured to predict it)
    deadline_at: float = math.inf  # the latest it could go and still make its TTFT SLO, as predicted when it was held


@dataclass
class _Stream:
    """A stream this router admitted and relays: where it runs, and how many tokens it may still take (its slot's time)."""

    worker_id: str
    left: int
    last_at: float  # when its last token came (or it was admitted): its next comes a step after


@dataclass
class _Room:
    """A worker's predicted state while one poll admits requests onto it."""

    load: WorkerLoad
    batch: int
    pending_tokens: int


@dataclass
class OverloadPolicy:
    """Decides, for each new request, admit / hold / refuse, and which held requests go or are refused as load changes."""

    settings: AdmissionSettings = field(default_factory=AdmissionSettings)

    def __post_init__(self) -> None:
        self._models: dict[str, StepModel] = {}
        self._warm_up: dict[str, int] = {}  # gaps still to leave out, by worker
        self._fleet = StepModel()
        self._by_id: dict[str, _Held] = {}  # held requests, served by their order (tier, arrival, sequence)
        self._finished: deque[float] = deque()
        self._first_seen: float | None = None
        self._sequence = itertools.count()
        self._mean_prompt = 0.0
        self._last_drain: float | None = None
        self._streams: dict[str, _Stream] = {}  # admitted with a known max_tokens, until they end
        self._hold_errors: deque[tuple[float, float]] = deque(maxlen=HOLD_ERRORS_KEPT)  # (when, seconds later than predicted)

    # -- events ----------------------------------------------------------------------------
    def on_step(self, worker_id: str, batch: int, step_s: float, request_id: str = "", now: float = 0.0) -> None:
        """One step of the worker with `batch` sequences took `step_s` (a token gap of `request_id` the router relayed `now`)."""
        left_out = self._warm_up.setdefault(worker_id, WARMUP_GAPS)
        if left_out and batch > 0 and step_s > 0:
            self._warm_up[worker_id] = left_out - 1
        else:
            self._models.setdefault(worker_id, StepModel()).add(batch, step_s)
            self._fleet.add(batch, step_s)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.worker_id = worker_id  # it may have moved (migration)
            stream.left -= 1
            stream.last_at = now

    def stream_ended(self, request_id: str) -> None:
        """A stream this router relayed (or a request it admitted that never started) ended: its slot is no longer taken."""
        self._streams.pop(request_id, None)

    def forget_worker(self, worker_id: str) -> None:
        self._models.pop(worker_id, None)
        self._warm_up.pop(worker_id, None)

    def on_finished(self, now: float) -> None:
        """A stream this router relayed ended: one slot freed somewhere (the drain rate counts it)."""
        self._finished.append(now)
        self._trim(now)

    def arrive(self, arrival: Arrival, loads: Sequence[WorkerLoad]) -> tuple[Decision, list[Refuse]]:
        """The new request's decision, and the held requests it displaced from a full queue (refused)."""
        now = arrival.arrived_at
        if self._first_seen is None:
            self._first_seen = now
        self._mean_prompt = arrival.prompt_tokens if not self._mean_prompt else 0.9 * self._mean_prompt + 0.1 * arrival.prompt_tokens
        if not loads:
            return Admit(arrival.request_id, None), []
        ahead = self._ahead(arrival.tier)
        if not ahead:
            worker = self._fitting([_room(w) for w in loads], arrival, now)
            if worker is not None:
                self._track(arrival, worker.load.worker_id, now)
                return Admit(arrival.request_id, worker.load.worker_id, 0.0, arrival.prompt_tokens), []
        likely, expected_wait, may_wait = self._hold_prediction(arrival, ahead + 1, loads, now)
        if not likely:
            return Refuse(arrival.request_id, RefuseReason.QUEUE_TOO_SLOW, self._retry_after(ahead + 1, now)), []
        displaced: list[Refuse] = []
        if len(self._by_id) >= self.settings.max_queued:
            victim = self._last_held()
            if victim is None or victim.arrival.tier <= arrival.tier:
                return Refuse(arrival.request_id, RefuseReason.QUEUE_FULL, self._retry_after(len(self._by_id), now)), []
            self._drop(victim)
            displaced.append(Refuse(victim.arrival.request_id, RefuseReason.DISPLACED, self._retry_after(len(self._by_id), now),
                                    now - victim.arrival.arrived_at))
        self._by_id[arrival.request_id] = _Held(arrival, (arrival.tier, arrival.arrived_at, next(self._sequence)),
                                                None if expected_wait is None else now + expected_wait, now + may_wait)
        return Hold(arrival.request_id), displaced

    def cancel(self, request_id: str) -> None:
        """A held request's client went away."""
        held = self._by_id.get(request_id)
        if held is not None:
            self._drop(held)

    def poll(self, loads: Sequence[WorkerLoad], now: float) -> list[Admit | Refuse]:
        """What happens to the held requests now: the head goes while a worker has room; the hopeless are refused."""
        self._trim(now)
        effects: list[Admit | Refuse] = []
        rooms = [_room(w) for w in loads]
        for held in self._in_order():
            arrival = held.arrival
            waited = now - arrival.arrived_at
            if not rooms:
                self._drop(held)
                effects.append(Admit(arrival.request_id, None, waited))
                continue
            worker = self._fitting(rooms, arrival, now)
            if worker is not None:
                self._drop(held)
                worker.batch += 1
                worker.pending_tokens += arrival.prompt_tokens
                self._track(arrival, worker.load.worker_id, now)
                effects.append(Admit(arrival.request_id, worker.load.worker_id, waited, arrival.prompt_tokens, self._hold_ended(held, now)))
                continue
            if not self._any_itl_fits(rooms, arrival):
                break  # no worker has room in its batch: nobody behind it would fit either
            # Room in a batch, but not within its TTFT budget there (a long prefill queue): a slot on another worker may
            # still come in time, which `_refuse_hopeless` below judges. Refused here at once, such holds failed within
            # milliseconds of their arrival (25 of 51 at 2x-4x) once measured workers took bursts without slow start.
            if now < arrival.arrived_at + self._hold_s(arrival):
                continue
            self._drop(held)
            effects.append(Refuse(arrival.request_id, RefuseReason.BUDGET_SPENT, self._retry_after(len(self._by_id) + 1, now), waited,
                                  self._hold_ended(held, now, failed=True)))
        effects += self._refuse_hopeless(loads, now)
        return effects

    def next_deadline(self) -> float | None:
        """The earliest time a held request's budget runs out (the shell polls then at the latest)."""
        live = [h.arrival.arrived_at + self._hold_s(h.arrival) for h in self._by_id.values()]
        return min(live) if live else None

    @property
    def held(self) -> int:
        return len(self._by_id)

    def drain_per_s(self, now: float) -> float | None:
        """Streams finished per second over the drain window; None until a second of history exists.

        A window with fewer than MIN_DRAIN_EVENTS in it (an idle fleet that a burst just hit) gives the last rate measured
        with enough events: without it, the burst's first seconds would be held whole and refused only as their budgets
        ran out, rather than at arrival."""
        self._trim(now)
        if self._first_seen is None:
            return None
        span = min(self.settings.drain_window_s, now - self._first_seen)
        if span >= 1.0 and len(self._finished) >= MIN_DRAIN_EVENTS:
            self._last_drain = len(self._finished) / span
            return self._last_drain
        return self._last_drain

    # -- predictions ---------------------------------------------------------------------------
    def step_at(self, load: WorkerLoad, batch: int) -> float | None:
        """Predicted step time (the ITL of each sequence) of the worker running `batch` sequences; None: nothing measured."""
        own = self._models.get(load.worker_id)
        line = _line(own) or self._fleet.line()
        if line is not None:
            a, b = line
            return max(a + b * batch, 0.0)
        mean = (own.mean() if own is not None else None) or self._fleet.mean()
        if mean is None:
            return None
        mean_batch, mean_step = mean
        return mean_step * batch / max(1.0, mean_batch)

    def _itl_fits(self, room: _Room, limit_s: float, *, slow_start: bool = True) -> bool:
        """Whether one more sequence on the room's batch keeps its ITL within `limit_s`; `slow_start` False: as the batch
        may grow once load reports show it running (how many slots will open, not whether one is open now)."""
        if room.batch == 0:
            return True  # a lone sequence steps as fast as the worker can: holding it would not make its ITL any better
        load = room.load
        own = self._models.get(load.worker_id)
        measured = own.largest_batch if own is not None else 0
        if slow_start and room.batch + 1 > max(SLOW_START_FACTOR * load.running, load.running + SLOW_START_STEP, measured):
            # Beyond what its last report ran and what its gaps were measured at, the line is a guess: grow the batch step
            # by step (slow start). Within what was measured it is not: a burst of 16 on an idle worker that had run 16
            # before waited three load reports to double from 2, and `bench serve` lost 8 % of its throughput to it.
            return False
        if own is not None and 0 < own.recent <= limit_s and room.batch < load.running:
            # A slot that freed since its last report, refilled: the batch is what the worker ran, at gaps within the limit.
            # The line alone, noisy at the SLO's edge (the sim bench's 440 ms step at 9 against 450 ms), flipped its answer
            # from one poll to the next, and turned away a held request in two at 4x capacity.
            return True
        if own is not None and own.recent > limit_s and room.batch >= load.running:
            return False  # its tokens come slower than the SLO already, whatever the line says
        predicted = self.step_at(load, room.batch + 1)
        # Nothing measured yet (a cold fleet): one sequence per worker until its first token gaps say what a step costs.
        return predicted is not None and predicted <= limit_s

    def ttft_s(self, room: _Room | WorkerLoad, prompt_tokens: int) -> float:
        """Predicted time to first token of a request of `prompt_tokens` sent to the worker now."""
        if isinstance(room, WorkerLoad):
            room = _room(room)
        load = room.load
        rate = load.prefill_tokens_per_s or self.settings.default_prefill_tokens_per_s
        queued_tokens = room.pending_tokens + load.queue_depth * self._mean_prompt
        step = self.step_at(load, room.batch + 1)
        return (queued_tokens + prompt_tokens) / rate + (step if step is not None else load.step_s)

    # -- internals -------------------------------------------------------------------------------
    def _fitting(self, rooms: Iterable[_Room], arrival: Arrival, now: float) -> _Room | None:
        """The worker with the lowest predicted TTFT among those where the request fits both SLOs, if any."""
        headroom = self.settings.headroom
        budget = arrival.arrived_at + arrival.slo.ttft_s * headroom - now if arrival.slo.ttft_s > 0 else float("inf")
        itl_limit = arrival.slo.itl_s * headroom if arrival.slo.itl_s > 0 else float("inf")
        best, best_ttft = None, float("inf")
        # An idle worker serves the request as fast as this fleet can: when even that misses its TTFT SLO (a prompt longer
        # than the SLO allows on this hardware, a slow or busy host), holding or refusing it serves nobody better, so it
        # goes there; refusing it would refuse a lone user for good.
        idle, idle_ttft = None, float("inf")
        for room in rooms:
            if not self._itl_fits(room, itl_limit):
                continue
            ttft = self.ttft_s(room, arrival.prompt_tokens)
            if ttft <= budget and (ttft < best_ttft or (ttft == best_ttft and best is not None and room.batch < best.batch)):
                best, best_ttft = room, ttft
            elif _idle(room) and ttft < idle_ttft:
                idle, idle_ttft = room, ttft
        return best or idle

    def _any_itl_fits(self, rooms: Iterable[_Room], arrival: Arrival) -> bool:
        itl_limit = arrival.slo.itl_s * self.settings.headroom if arrival.slo.itl_s > 0 else float("inf")
        return any(self._itl_fits(room, itl_limit) for room in rooms)

    def _freed_slot_ttft(self, arrival: Arrival, loads: Sequence[WorkerLoad]) -> float:
        """The lowest TTFT the request could see once a slot frees for it: its prefill behind what is queued, and a step of
        the batch it joins (as full as now: one stream ended, one joins). An idle slot's step (the worker's fastest) let a
        held request wait so long that the TTFT of the full batch it then joined no longer fit, 1 hold in 3 at 4x."""
        return min(self.ttft_s(_Room(w, max(w.batch - 1, 0), w.pending_prefill_tokens), arrival.prompt_tokens) for w in loads)

    def hold_margin_s(self, now: float) -> float:
        """How much later than predicted a held request's slot may come (the `hold_confidence` quantile of the recent
        holds' errors; 0 while none is known, and never below: the margin only makes holds stricter)."""
        while self._hold_errors and now - self._hold_errors[0][0] > HOLD_ERROR_AGE_S:
            self._hold_errors.popleft()
        if not self._hold_errors:
            return 0.0
        errors = sorted(error for _, error in self._hold_errors)
        return max(0.0, errors[min(len(errors) - 1, int(self.settings.hold_confidence * len(errors)))])

    def _hold_ended(self, held: _Held, now: float, *, failed: bool = False, wait_left: float = 0.0) -> float | None:
        """Records how much later than predicted the held request went (`failed`: would have gone; it was refused, `wait_left`
        before its slot as predicted now, and no sooner than its deadline, which it missed); None: it had no prediction."""
        if held.expected_at is None:
            return None
        went_at = max(now + wait_left, held.deadline_at) if failed else now
        late = went_at - held.expected_at
        self._hold_errors.append((now, late))
        return late

    def _hold_prediction(self, arrival: Arrival, place: int, loads: Sequence[WorkerLoad], now: float) -> tuple[bool, float | None, float]:
        """Whether a request that would be `place`-th in the queue reaches a worker within its hold, with the hold margin
        (`hold_margin_s`) to spare; when its slot is predicted to open (seconds from now; None: not measured); and how long
        it may wait.

        A request held on an even chance (its place over the drain rate within its hold) was refused after its hold 3
        times in 4 at 4x capacity (the goodput bench: 43 of 55 holds), and those refusals came half a second late. So a
        request is held only when `place` slots free in the time it may wait (its hold, and the TTFT budget the batch it
        joins leaves): by the streams this router relays, each done within its tokens left at its worker's step time
        (`_slot_opens`); where those are too few to tell, when slots freeing as a Poisson process at the drain rate bring
        `place` of them at `hold_confidence`. Otherwise it is refused at once. Unknown until either is measured: held (a
        cold fleet's burst waits for its first steps). Measured the same way: 54 of 76 holds admitted; then 40 of 64,
        before the hold margin."""
        budget = arrival.slo.ttft_s * self.settings.headroom - self._freed_slot_ttft(arrival, loads) if arrival.slo.ttft_s > 0 else math.inf
        may_wait = min(self._hold_s(arrival), budget)
        if may_wait == math.inf:
            return True, None, may_wait
        within = may_wait - self.hold_margin_s(now)
        slot = self._slot_wait_s(place, arrival, loads, now)
        if slot is not None:
            return slot <= within, slot, may_wait
        drain = self.drain_per_s(now)
        if drain is None:
            return True, None, may_wait
        likely = within > 0 and _poisson_at_least(place, drain * within) >= self.settings.hold_confidence
        return likely, place / drain, may_wait

    def _slot_wait_s(self, place: int, arrival: Arrival, loads: Sequence[WorkerLoad], now: float) -> float | None:
        """When the `place`-th batch slot the request fits in opens (`_slot_opens`); None when fewer than `place` tell."""
        opens = self._slot_opens(arrival, loads, now)
        return opens[place - 1] if len(opens) >= place else None

    def _slot_opens(self, arrival: Arrival, loads: Sequence[WorkerLoad], now: float) -> list[float]:
        """Seconds from now until each batch slot the request's ITL fits in opens, soonest first, by the streams this router
        relays: a stream ends (its slot free) with its last token, its tokens left a step each after its latest. On a
        worker whose batch is above what fits (`_itl_fits`, as admission will judge it), that many more must end first; a
        slot open now counts 0, and so does one that slow start holds back (the batch grows to it within a few load
        reports: otherwise a burst on an idle fleet was refused at once by a drain rate from before it, as `bench serve`'s 16
        streams were). Streams of other routers, or without max_tokens, are not counted (their ends are unknown)."""
        itl_limit = arrival.slo.itl_s * self.settings.headroom if arrival.slo.itl_s > 0 else math.inf
        streams: dict[str, list[_Stream]] = {}
        for stream in self._streams.values():
            streams.setdefault(stream.worker_id, []).append(stream)
        wanted = len(self._by_id) + 1  # no more slots than the queue and this request can take matter
        opens: list[float] = []
        for load in loads:
            step = self.step_at(load, max(load.batch, 1)) or load.step_s
            # Counted from its last token, not from now: a prediction that did not shrink between tokens refused a held
            # request a few milliseconds before the token that ended the stream ahead of it.
            ends = sorted(max(0.0, s.last_at + max(s.left, 0) * step - now) for s in streams.get(load.worker_id, ()))
            batch = max(load.batch, len(ends))
            # The largest batch the request's ITL fits in: above it, the batch must shrink by the difference before a slot opens.
            if _line(self._models.get(load.worker_id)) is None and self._fleet.line() is None:
                # No slope measured yet (gaps at one batch size, whose scaled mean errs high): slow start finds how far
                # the batch grows, and until then its slots count as opening.
                fits = batch + wanted
            else:
                fits = 0
                while fits < batch + wanted and self._itl_fits(_Room(load, fits, 0), itl_limit, slow_start=False):
                    fits += 1
            opens += [0.0] * (fits - batch) + ends if fits > batch else ends[batch - fits:]
        return sorted(opens)

    def _track(self, arrival: Arrival, worker_id: str, now: float) -> None:
        if arrival.max_tokens > 0:
            self._streams[arrival.request_id] = _Stream(worker_id, arrival.max_tokens - 1, now)  # its first token is no gap

    def _refuse_hopeless(self, loads: Sequence[WorkerLoad], now: float) -> list[Refuse]:
        """Held requests that cannot reach a worker before their budget ends, by their place in the queue."""
        drain = self.drain_per_s(now)
        refused = []
        opens: dict[float, list[float]] = {}
        for place, held in enumerate(self._in_order(), start=1):
            arrival = held.arrival
            budget_end = arrival.arrived_at + arrival.slo.ttft_s * self.settings.headroom
            hold_end = arrival.arrived_at + self._hold_s(arrival)
            if arrival.slo.itl_s not in opens:  # once a poll per ITL SLO: the same slots for every held request of it
                opens[arrival.slo.itl_s] = self._slot_opens(arrival, loads, now)
            slot = opens[arrival.slo.itl_s][place - 1] if len(opens[arrival.slo.itl_s]) >= place else None
            wait = slot if slot is not None else place / drain if drain else 0.0
            best = self._freed_slot_ttft(arrival, loads) if loads else 0.0
            if arrival.slo.ttft_s > 0 and (now + wait > hold_end or now + wait + best > budget_end):
                self._drop(held)
                spent = now >= hold_end or now + best >= budget_end
                refused.append(Refuse(arrival.request_id, RefuseReason.BUDGET_SPENT if spent else RefuseReason.QUEUE_TOO_SLOW,
                                      self._retry_after(place, now), now - arrival.arrived_at,
                                      self._hold_ended(held, now, failed=True, wait_left=wait)))
        return refused

    def _hold_s(self, arrival: Arrival) -> float:
        """How long the request may be held: a share of its TTFT SLO (forever without one)."""
        if arrival.slo.ttft_s <= 0:
            return float("inf")
        return arrival.slo.ttft_s * min(self.settings.max_hold_share, self.settings.headroom)

    def _retry_after(self, places: int, now: float) -> float:
        s = self.settings
        drain = self.drain_per_s(now)
        if drain is None:
            return s.default_retry_after_s
        return min(s.max_retry_after_s, max(s.min_retry_after_s, places / drain))

    def _ahead(self, tier: int) -> int:
        return sum(1 for h in self._by_id.values() if h.arrival.tier <= tier)

    def _in_order(self) -> list[_Held]:
        return sorted(self._by_id.values(), key=lambda h: h.order)

    def _last_held(self) -> _Held | None:
        return max(self._by_id.values(), key=lambda h: h.order, default=None)

    def _drop(self, held: _Held) -> None:
        self._by_id.pop(held.arrival.request_id, None)

    def _trim(self, now: float) -> None:
        horizon = now - self.settings.drain_window_s
        while self._finished and self._finished[0] < horizon:
            self._finished.popleft()


def _poisson_at_least(count: int, mean: float) -> float:
    """P(N >= count) for N Poisson with `mean` (the counts are places in a queue: the sum is short)."""
    term = total = math.exp(-mean)
    for k in range(1, count):
        term *= mean / k
        total += term
    return max(0.0, 1.0 - total)


def _room(load: WorkerLoad) -> _Room:
    return _Room(load, load.batch, load.pending_prefill_tokens)


def _idle(room: _Room) -> bool:
    return room.batch == 0 and room.pending_tokens == 0 and room.load.queue_depth == 0


def _line(model: StepModel | None) -> tuple[float, float] | None:
    return None if model is None else model.line()


def tier_slos(base: TierSlo, factors: Mapping[int, float]) -> dict[int, TierSlo]:
    """Each tier's SLOs: the deployment's times the tier's factor."""
    return {tier: TierSlo(base.ttft_s * f, base.itl_s * f) for tier, f in factors.items()}
