"""When and how hard the health monitor checks one worker. Pure logic, no I/O.

One round of checks is a small state machine: the monitor runs the effect it
returns (take the engine's Stats, send a canary with this deadline, pause,
record the outcome) and feeds back what happened, until the round ends with
the one outcome to record. Between rounds ``CheckSchedule`` says how long to
wait.

The rules: one slow or unanswered canary on a healthy worker is as often a
busy host as the worker. A missed deadline is confirmed by a second canary,
unless the engine computed nothing while it held the canary (a hang), and a
slow answer by ``latency_rechecks`` more; only the confirmation counts. A
worker that already failed gets no second chance, and after a counted miss the
next check goes out at once with a deadline short enough that the misses that
make a hang UNHEALTHY fit in about three intervals.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from phalanx.health.state import CheckOutcome, CheckResult, Circuit, FailureReason, Health, WorkerTracker

if TYPE_CHECKING:
    from phalanx.health.config import HealthConfig

__all__ = [
    "CanaryDone",
    "CheckPurpose",
    "CheckRound",
    "CheckSchedule",
    "Deadline",
    "EngineSample",
    "Paused",
    "Pause",
    "Record",
    "SchedulePolicy",
    "SendCanary",
    "StatsTaken",
    "TakeStats",
    "stuck_with_work",
]


class Deadline(Enum):
    """How long a canary may take, by what the worker did before."""

    # In good standing: up to 3x the latency limit (never past one interval). Past the limit the answer fails anyway;
    # waiting a little longer tells slow from hung.
    ROUTINE = "routine"
    # After a miss that did not count (or a half-open check after a counted one): the latency limit, with the peers'
    # slowdown and the worker's own load (health/load.py), since an answer past it fails anyway and busy is no fault.
    CONFIRMING = "confirming"
    # After a counted miss: the same limit, but at most half an interval, so that the misses after the first one of a
    # hang take one interval together and it reaches UNHEALTHY within about three. Not stretched by the worker's load:
    # a hung engine's last load report says whatever it was doing when it stopped.
    FOLLOW_UP = "follow_up"


class CheckPurpose(Enum):
    """Why a canary goes out (the monitor counts rechecks)."""

    CHECK = "check"
    TIMEOUT_RECHECK = "timeout_recheck"
    LATENCY_RECHECK = "latency_recheck"


@dataclass(frozen=True)
class SchedulePolicy:
    interval_s: float = 30.0
    jitter: float = 0.1
    timeout_s: float = 5.0
    min_timeout_s: float = 0.25
    failure_recheck_s: float = 0.25
    latency_rechecks: int = 2
    latency_recheck_delay_s: float = 0.2

    @classmethod
    def from_config(cls, config: HealthConfig) -> SchedulePolicy:
        return cls(
            interval_s=config.check_interval_s, jitter=config.check_jitter, timeout_s=config.check_timeout_s,
            min_timeout_s=config.min_check_timeout_s, failure_recheck_s=config.failure_recheck_s,
            latency_rechecks=config.latency_rechecks, latency_recheck_delay_s=config.latency_recheck_delay_s,
        )

    def deadline_s(
        self, kind: Deadline, tracker: WorkerTracker, fleet_slowdown: float = 1.0, slo_factor: float = 1.0, load_factor: float = 1.0
    ) -> float:
        """Seconds a canary of this kind may take; the full timeout until the worker has a latency baseline."""
        # Not stretched by the peers' slowdown: a hang must not hide behind a busy fleet.
        limit = tracker.latency_limit_s()
        if limit is None:
            return self.timeout_s
        if kind is Deadline.ROUTINE:
            # The worker's own load does stretch it (its steps are slower, and a hung engine's load allowance lapses
            # once its reports show no step for a while: health/load.py), never past one interval.
            return self._clamp(min(3 * limit * max(1.0, load_factor), self.interval_s))
        stretched = tracker.latency_limit_s(fleet_slowdown, slo_factor)
        assert stretched is not None  # None only without a baseline, handled above
        if kind is Deadline.CONFIRMING:
            return self._clamp(stretched * max(1.0, load_factor))
        return self._clamp(min(stretched, self.interval_s / 2))

    def latency_pause_s(self) -> float:
        """Between the rechecks of a slow answer: spread over a moment, so that they do not all land in one hiccup."""
        return min(self.latency_recheck_delay_s, self.interval_s / 2)

    def _clamp(self, seconds: float) -> float:
        return min(self.timeout_s, max(self.min_timeout_s, seconds))


@dataclass(frozen=True)
class EngineSample:
    """What the worker's Stats said about its engine."""

    computed_tokens: int
    held_requests: int  # queued plus running


def stuck_with_work(before: EngineSample | None, after: EngineSample | None) -> bool:
    """Since `before`, the engine computed nothing though it holds requests (the missed canary among them).

    One that holds nothing never got the canary (a stalled health process or host), and one that did not answer Stats
    may be a host that stalls everything: neither is the signature of a hang.
    """
    if before is None or after is None:
        return False
    return after.computed_tokens == before.computed_tokens and after.held_requests > 0


# -- effects: what the monitor does next ------------------------------------------------
@dataclass(frozen=True)
class TakeStats:
    """Ask the worker for its engine counters; answer with StatsTaken (None when it did not answer)."""


@dataclass(frozen=True)
class SendCanary:
    """Send one canary; answer with CanaryDone."""

    deadline: Deadline
    deadline_s: float
    purpose: CheckPurpose = CheckPurpose.CHECK
    # Given more than its deadline because the worker's steps move: cut short at this many seconds once they stop (a
    # hang that begins meanwhile is not waited out for the whole timeout). None: `deadline_s` holds.
    while_progressing_from_s: float | None = None


@dataclass(frozen=True)
class Pause:
    """Wait this long; answer with Paused."""

    seconds: float


@dataclass(frozen=True)
class Record:
    """The round is over: observe this outcome (and ask the schedule for the next delay)."""

    outcome: CheckOutcome


Effect = TakeStats | SendCanary | Pause | Record


# -- events: what happened --------------------------------------------------------------
@dataclass(frozen=True)
class StatsTaken:
    sample: EngineSample | None
    fleet_slowdown: float = 1.0
    load_factor: float = 1.0  # the worker's load allowance now (health/load.py)
    # Its load reports show its steps moving right now (health/load.py): whatever the counters say, not a hang.
    progressing: bool = False
    # None of its peers' steps move either (health/load.py): the host stalled, and a miss is no sign of a hang.
    host_stalled: bool = False


@dataclass(frozen=True)
class CanaryDone:
    outcome: CheckOutcome
    fleet_slowdown: float = 1.0
    load_factor: float = 1.0  # the worker's load allowance now (health/load.py)
    progressing: bool = False  # as StatsTaken's


@dataclass(frozen=True)
class Paused:
    fleet_slowdown: float = 1.0
    load_factor: float = 1.0  # the worker's load allowance now (health/load.py)
    progressing: bool = False  # as StatsTaken's


Event = StatsTaken | CanaryDone | Paused


class _Phase(Enum):
    STATS_BEFORE = "stats_before"
    CANARY = "canary"
    STATS_AFTER = "stats_after"
    CONFIRMING = "confirming"
    PAUSED = "paused"
    LATENCY_RECHECK = "latency_recheck"
    DONE = "done"


class CheckRound:
    """One round of checks of one worker; `start()` returns the first effect, `on(event)` each next one."""

    def __init__(
        self, policy: SchedulePolicy, tracker: WorkerTracker, *, after: FailureReason | None, slo_factor: float = 1.0
    ) -> None:
        self.policy = policy
        self.tracker = tracker
        # The degradation level's latency SLO relaxation (x2 from level 3 on), fixed for the round.
        self.slo_factor = slo_factor
        self.after = after  # how the previous round failed, if it did
        # A worker that already failed gets no second chance: its miss counts at once.
        self.first_miss_counts = tracker.consecutive_failures > 0
        self._before: EngineSample | None = None
        self._missed: CheckOutcome | None = None
        self._rechecks_left = policy.latency_rechecks
        self._phase = _Phase.STATS_BEFORE

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    def start(self, fleet_slowdown: float = 1.0, load_factor: float = 1.0) -> Effect:
        if self.first_miss_counts:
            return self._first_canary(fleet_slowdown, load_factor)
        return TakeStats()

    def on(self, event: Event) -> Effect:
        phase = self._phase
        if phase is _Phase.STATS_BEFORE and isinstance(event, StatsTaken):
            self._before = event.sample
            return self._first_canary(event.fleet_slowdown, event.load_factor)
        if phase is _Phase.CANARY and isinstance(event, CanaryDone):
            # A worker that already failed gets no second chance, unless its reports show its steps moving: a miss
            # then is a starved host's, and a confirming check decides as for a healthy worker.
            if event.outcome.timed_out and (not self.first_miss_counts or event.progressing):
                self._missed = event.outcome
                self._phase = _Phase.STATS_AFTER
                return TakeStats()
            return self._judged(event.outcome, event.fleet_slowdown, event.load_factor)
        if phase is _Phase.STATS_AFTER and isinstance(event, StatsTaken):
            assert self._missed is not None
            if stuck_with_work(self._before, event.sample) and not event.progressing and not event.host_stalled:
                # A hung engine holds its work and computes nothing: its miss counts at once. (One whose reports show
                # steps moving was only slower than the deadline, a whole step of a starved host can be; and when
                # none of its peers moves either, the host stalled them all.)
                return self._judged(self._missed, event.fleet_slowdown, event.load_factor)
            # A busy host, a burst, a canary that never arrived: a confirming check decides.
            self._phase = _Phase.CONFIRMING
            deadline = self.policy.deadline_s(Deadline.CONFIRMING, self.tracker, event.fleet_slowdown, self.slo_factor, event.load_factor)
            if event.progressing:
                # Its steps visibly move: it is busy, so it gets the whole timeout while they keep moving (its answer is
                # still judged for latency against its load; a hang does not move, a slow step answers and fails that
                # judgment), and the confirming deadline once they stop: a hang that began within the round.
                return SendCanary(Deadline.CONFIRMING, self.policy.timeout_s, CheckPurpose.TIMEOUT_RECHECK, while_progressing_from_s=deadline)
            return SendCanary(Deadline.CONFIRMING, deadline, CheckPurpose.TIMEOUT_RECHECK)
        if phase in (_Phase.CONFIRMING, _Phase.LATENCY_RECHECK) and isinstance(event, CanaryDone):
            return self._judged(event.outcome, event.fleet_slowdown, event.load_factor)
        if phase is _Phase.PAUSED and isinstance(event, Paused):
            self._phase = _Phase.LATENCY_RECHECK
            deadline = self.policy.deadline_s(Deadline.ROUTINE, self.tracker, event.fleet_slowdown, self.slo_factor, event.load_factor)
            if event.progressing:
                # It answered, slowly, and its steps move: the recheck is for its latency, and an answer past the limit
                # fails that anyway. Cut short at the routine deadline, a slow answer became a timeout that counts; so it
                # gets the whole timeout while its steps keep moving, and the routine deadline once they stop (a hang).
                return SendCanary(Deadline.ROUTINE, self.policy.timeout_s, CheckPurpose.LATENCY_RECHECK, while_progressing_from_s=deadline)
            return SendCanary(Deadline.ROUTINE, deadline, CheckPurpose.LATENCY_RECHECK)
        raise ValueError(f"{type(event).__name__} does not fit a round in phase {phase.value}")

    def _first_canary(self, fleet_slowdown: float, load_factor: float) -> SendCanary:
        self._phase = _Phase.CANARY
        kind = self._first_deadline()
        return SendCanary(kind, self.policy.deadline_s(kind, self.tracker, fleet_slowdown, self.slo_factor, load_factor))

    def _first_deadline(self) -> Deadline:
        if self.after is not FailureReason.TIMEOUT:
            return Deadline.ROUTINE
        # The half-open canary of a recovering worker is no part of a hang's detection: it keeps the confirming one.
        return Deadline.FOLLOW_UP if self.tracker.circuit is Circuit.CLOSED else Deadline.CONFIRMING

    def _judged(self, outcome: CheckOutcome, fleet_slowdown: float, load_factor: float) -> Effect:
        judged = self.tracker.judge_latency(outcome, fleet_slowdown, self.slo_factor, load_factor)
        if self._rechecks_left > 0 and judged.reason is FailureReason.LATENCY:
            # One slow answer is as often the host's scheduler as the worker: more slow answers decide.
            self._rechecks_left -= 1
            self._phase = _Phase.PAUSED
            return Pause(self.policy.latency_pause_s())
        self._phase = _Phase.DONE
        return Record(outcome)


_WRONG_ANSWERS = (FailureReason.TOKEN_MISMATCH, FailureReason.LOGIT_OUT_OF_RANGE)


class CheckSchedule:
    """The rounds of checks of one worker: when the next is due, and what the previous one left behind."""

    def __init__(self, policy: SchedulePolicy, tracker: WorkerTracker, *, uniform: Callable[[float, float], float] = random.uniform) -> None:
        self.policy = policy
        self.tracker = tracker
        self._uniform = uniform
        self.last_failure: FailureReason | None = None

    def first_delay(self) -> float:
        """Spread the first checks of many workers over a moment."""
        return self._uniform(0, min(self.policy.interval_s, 1.0))

    def hold_off(self, now: float, *, stopping: bool) -> float | None:
        """How long to wait before a round may start (None: start now). Moves a due open circuit to HALF_OPEN."""
        if not stopping and self.tracker.may_check(now):
            return None
        half_open_at = self.tracker.next_half_open_at()
        return max(0.01, half_open_at - now) if half_open_at is not None else self.policy.interval_s

    def begin(self, slo_factor: float = 1.0) -> CheckRound:
        return CheckRound(self.policy, self.tracker, after=self.last_failure, slo_factor=slo_factor)

    def rounds_due(self) -> int:
        """How many rounds go out together now: after a wrong answer, every further failure that would make the worker
        UNHEALTHY, each its own canary; else one.

        Wrong tokens or logits are no effect of load, and every one of them counts; one after the other, each waits
        for the last (three canaries of a busy host took 2.8 s against the 2.5 s goal). Sent together they run in the
        same batch and take about one canary's time; each still has to give wrong answers to count.
        """
        t = self.tracker
        if self.last_failure not in _WRONG_ANSWERS or t.health not in (Health.HEALTHY, Health.SUSPICIOUS) or t.circuit is not Circuit.CLOSED:
            return 1
        return max(1, min(t.policy.unhealthy_after, t.policy.failure_threshold) - t.consecutive_failures)

    def finish(self, outcome: CheckOutcome) -> float:
        """The round recorded `outcome`: the delay to the next one."""
        p = self.policy
        self.last_failure = outcome.reason if outcome.result is CheckResult.FAIL else None
        if self.last_failure is FailureReason.TIMEOUT:
            return 0.0  # the deadline already waited; a hang should not wait twice
        if self.last_failure in _WRONG_ANSWERS:
            # Wrong answers are no effect of load and do not clear by waiting; on a busy host each canary already takes
            # long, and the corruption goal counts from the first wrong answer to the third.
            return 0.0
        if outcome.result is CheckResult.FAIL:
            return min(p.interval_s, p.failure_recheck_s)
        return p.interval_s * self._uniform(1 - p.jitter, 1 + p.jitter)
