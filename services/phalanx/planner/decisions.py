"""When the planner decides: the decision state machine. Pure, no I/O; the caller passes `now`.

Events in, decisions out. The shell calls `tick` (often: every second is fine, the machine keeps its own
schedule), reports `worker_dead` from health's DEAD events and `spare_ready` / `spare_lost` for hot
spares, and calls `complete` when a connector has carried a decision out (the fleet matches its
targets). Connectors act on `Decision`s; nothing here touches a process.

Rules, each fixing a limit of Dynamo's planner named in its design notes:

- Readiness, not a start delay: no load-driven decision until the routers are SERVING, at least one
  worker is SERVING and metrics flow (`Readiness`); the first one comes at the first tick after that.
- One scaling decision at a time: while one is being carried out, ticks issue nothing; once it is past
  its deadline it is marked timed out and the next tick may issue a new one. Decisions do not pile up
  when scaling is slower than the interval.
- The interval adapts to how long scaling takes: interval = min(max_interval_s, max(interval_s,
  latency_multiple x the longest of the last `latency_window` scaling latencies)), a timed-out decision
  counting with its full wait. Deciding faster than the fleet can follow only reacts to a
  half-finished change.
- A decision changes something: a tick whose desired count equals the current target issues nothing.
- Capacity restoration does not wait: a worker health marks DEAD gets a decision at once, neither at the
  next interval nor behind a scaling decision in flight (replacing exactly what was lost cannot pile up:
  one decision per dead worker, repeats ignored). With a hot spare registered, the decision promotes it
  (capacity back as fast as routing learns of it) and the targets still ask for `hot_spares` spares, so
  the connector starts a new spare in the background; without one, it replaces the worker with a new one.
  Restorations are not gated on readiness: when the last worker dies, the fleet is not ready, and that is
  exactly when a replacement is needed.
- A surge does not wait for the interval (`surge`): when the arrivals of the last seconds already need more
  workers than the target, a SURGE decision goes at once, and it supersedes a scaling decision in flight
  (decisions carry the whole target, so the larger one subsumes it). With a hot spare ready it promotes it:
  one worker of the surge serves at once, the others and a new spare start. Measured (docs/results/, planner passes):
  waiting for the next tick, and then for the decision in flight, brought workers after a short burst had ended.
  What counts as a surge (`surge_workers`): at least a minimum count and, optionally (`surge_confidence`), a rise
  beyond the Poisson noise of the rate the last plan was made for: a bare count of 4 in 2 s (one window in seven
  at 1 request/s) surged a 10-minute trace's fleet 32 times, mostly between its bursts; gated at 0.99, 8 times,
  at 7 points fewer worker-seconds and 6 points less SLO attainment (docs/results/, the fifth planner pass). With a confidence, a surge
  asks for the rate its arrivals show beyond noise (their Poisson lower bound, `poisson_lower_bound`) over the
  window and two longer ones, not for the window's own rate, the upper tail of the noise that just passed the gate.
- A surge on noise is withdrawn (`withdraw_odds`): the arrivals after a surge are fresh evidence, untouched by the
  selection that fired it; once they favour the rate the fleet was planned for over the rate the surge was sized for by
  the given odds (a Poisson likelihood ratio, `surge_log_odds`), the surge goes back to the count before it, and its
  workers still starting are not needed; once they favour the surge by those odds, it stands. Measured (docs/results/, planner passes):
  at a gate that catches a 3x burst in about a second, noise surges the fleet a few times a minute, and each surge held
  its workers for a scale-down window and a confirmation, 10 s, however fast the arrivals fell back.
- Scale-down waits (`scale_down_window_s`): a tick never asks for fewer workers than the largest count
  wanted within the window, so a lull between bursts does not drain the workers the next burst needs.
  Scale-up is never held back.
- No scale-down while arrivals rise (`Arrivals`, `scale_down_confirm_s`): a tick that would scale down issues
  nothing while the last seconds' arrivals run above the rate the lower count was planned for, or need more
  workers than it (however few they are: the surge's minimum count guards a scale-up against noise, while
  holding a scale-down costs a worker for one interval more). Otherwise the scale-down waits, pending, for
  `scale_down_confirm_s` and is issued only if arrivals stayed down meanwhile; a rise or a surge cancels it.
  Measured (docs/results/, planner passes): the tick's forecast is the interval before, and ticks scaled down to 2 workers
  0.15-2.3 s into a burst, whose first second did not hold the surge's 4 arrivals; the burst then waited
  4-6 s for new workers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from phalanx.common.roles import PREFILL


class DecisionReason(StrEnum):
    SCALE = "scale"
    SURGE = "surge"
    REPLACE_DEAD = "replace_dead"
    PROMOTE_SPARE = "promote_spare"


class Outcome(StrEnum):
    COMPLETED = "completed"
    TIMED_OUT = "timed_out"
    SUPERSEDED = "superseded"  # a surge asked for more before it completed


@dataclass(frozen=True)
class Targets:
    """What the fleet should be: routed workers, and hot spares (registered, warm, not routed to). A disaggregated fleet
    (`prefill` not None) has two pools: `workers` and `spares` are its decode pool's, `prefill` and `prefill_spares` its
    prefill pool's (planner/pools.py)."""

    workers: int
    spares: int = 0
    prefill: int | None = None
    prefill_spares: int = 0


@dataclass(frozen=True)
class Decision:
    id: int
    targets: Targets
    reason: DecisionReason
    issued_at: float
    deadline: float
    # REPLACE_DEAD / PROMOTE_SPARE: the worker that died.
    replaces: str | None = None
    # PROMOTE_SPARE: the spare that takes its place.
    promote: str | None = None
    # Workers it starts (routed and prefill, beyond the targets before it; a replacement starts one): its completion measures
    # how long a new worker takes to become routable (`DecisionMachine.lead_time_s`).
    starts: int = 0


@dataclass(frozen=True)
class FinishedDecision:
    decision: Decision
    outcome: Outcome
    finished_at: float

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.decision.issued_at


@dataclass(frozen=True)
class Arrivals:
    """The arrivals of the last seconds as the shell measured them, however few: how many, their rate (requests/s) and the
    workers that rate needs (the last plan's maths)."""

    requests: float
    rate: float
    workers: int


@dataclass(frozen=True)
class PendingScaleDown:
    """A scale-down a tick decided, not yet issued: it goes at `due_at` unless arrivals rise before."""

    workers: int
    planned_rate: float | None  # requests/s the lower count was planned for
    decided_at: float
    due_at: float
    prefill: int | None = None  # a disaggregated fleet's prefill target to issue with it


@dataclass(frozen=True)
class ProvisionalSurge:
    """A surge the arrivals since have neither borne out nor withdrawn: the count before it, the rate the fleet was planned for
    and the rate the surge was sized for (the highest of a chain of surges)."""

    since: float
    workers_before: int
    base_rate: float
    surge_rate: float


@dataclass(frozen=True)
class Readiness:
    """What must hold before load-driven decisions make sense."""

    routers_serving: bool
    serving_workers: int
    metrics_flowing: bool

    @property
    def ready(self) -> bool:
        return self.routers_serving and self.serving_workers >= 1 and self.metrics_flowing


@dataclass(frozen=True)
class DecisionConfig:
    interval_s: float = 30.0
    # The interval is at least this multiple of recent scaling latencies ...
    latency_multiple: float = 2.0
    latency_window: int = 5
    # The lead time is the LEAD_QUANTILE of the last this many start-to-routable latencies.
    lead_window: int = 20
    # ... and at most this long, so a scaling that once took minutes does not blind the planner for hours.
    max_interval_s: float = 600.0
    # A scaling decision not completed after this long is marked timed out.
    scale_deadline_s: float = 120.0
    # A replacement starts one process; a promotion only re-routes.
    replace_deadline_s: float = 60.0
    promote_deadline_s: float = 5.0
    hot_spares: int = 0
    # A disaggregated fleet's hot spares of the prefill pool (`hot_spares`: the decode pool's).
    prefill_hot_spares: int = 0
    history: int = 100
    # A tick asks for no fewer workers than the most any tick or surge wanted within this window (0: no hold).
    scale_down_window_s: float = 0.0
    # A tick's scale-down, given the arrivals, is issued after they stayed down for this long (0: at once).
    scale_down_confirm_s: float = 0.0
    # > 0: arrivals hold a scale-down only when they are a rise beyond the Poisson noise of its planned rate at this confidence
    # (`beyond_noise`); 0: any rate above the planned one holds.
    hold_confidence: float = 0.0
    # > 1: a surge is withdrawn when the arrivals after it favour the planned rate over the surge's by these odds, and stands
    # when they favour the surge's by them (`surge_evidence`); 0: a surge stands until a tick scales down.
    withdraw_odds: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= self.max_interval_s:
            raise ValueError("need 0 < interval_s <= max_interval_s")
        if self.latency_multiple <= 0 or min(self.latency_window, self.lead_window) < 1 or min(self.hot_spares, self.prefill_hot_spares) < 0:
            raise ValueError("latency_multiple > 0, latency_window >= 1, lead_window >= 1 and hot_spares >= 0 are required")
        if min(self.scale_deadline_s, self.replace_deadline_s, self.promote_deadline_s) <= 0:
            raise ValueError("deadlines must be > 0")
        if self.scale_down_window_s < 0 or self.scale_down_confirm_s < 0:
            raise ValueError("scale_down_window_s and scale_down_confirm_s must be >= 0")
        if not 0 <= self.hold_confidence < 1:
            raise ValueError("hold_confidence must be in [0, 1)")
        if self.withdraw_odds != 0 and self.withdraw_odds <= 1:
            raise ValueError("withdraw_odds must be 0 (off) or > 1")


# A plan's lead time covers this share of the start-to-routable latencies measured.
LEAD_QUANTILE = 0.9

# Dead worker ids remembered to ignore repeated DEAD events; ids are unique per process, so old ones can go.
_REMEMBERED_DEAD = 1024


class DecisionMachine:
    """The rules of the module docstring. `targets` is what the last decision asked for; `in_flight` the
    scaling decision being carried out, `restorations` the restoration decisions being carried out."""

    def __init__(self, config: DecisionConfig, workers: int, *, first_id: int = 1, prefill: int | None = None) -> None:
        self.config = config
        self.targets = Targets(workers=workers, spares=config.hot_spares, prefill=prefill,
                               prefill_spares=config.prefill_hot_spares if prefill is not None else 0)
        self.next_id = first_id
        self.in_flight: Decision | None = None
        self.restorations: dict[int, Decision] = {}
        self.spares: list[str] = []  # of the routed pool (aggregated or decode workers)
        self.prefill_spares: list[str] = []  # of a disaggregated fleet's prefill pool
        self._next_tick_at: float | None = None
        self._latencies: deque[float] = deque(maxlen=config.latency_window)
        self._start_latencies: deque[float] = deque(maxlen=config.lead_window)  # of completed decisions that started workers
        self._history: deque[FinishedDecision] = deque(maxlen=config.history)
        self._handled_dead: dict[str, None] = {}
        self._wanted: deque[tuple[float, int]] = deque()  # (when, desired workers) of recent ticks and surges
        self._wanted_prefill: deque[tuple[float, int]] = deque()  # (when, desired prefill workers) of recent ticks
        self.pending_down: PendingScaleDown | None = None
        self.scale_downs_held = 0  # scale-downs not issued because arrivals rose (at the tick, or while pending)
        self.provisional: ProvisionalSurge | None = None  # with withdraw_odds: a surge still on trial
        self.surges_withdrawn = 0

    # Schedule.

    @property
    def interval_s(self) -> float:
        slowest = max(self._latencies, default=0.0)
        return min(self.config.max_interval_s, max(self.config.interval_s, self.config.latency_multiple * slowest))

    @property
    def lead_time_s(self) -> float | None:
        """How long new workers take to become routable: the LEAD_QUANTILE (nearest rank) of the completed decisions that
        started workers, issue to acknowledgement; None before the first. A plan sizes the fleet for the load this far past
        the interval it is made for (docs/planner.md, "Lead time")."""
        if not self._start_latencies:
            return None
        ranked = sorted(self._start_latencies)
        return ranked[min(len(ranked) - 1, math.ceil(LEAD_QUANTILE * len(ranked)) - 1)]

    @property
    def next_tick_at(self) -> float | None:
        """When the next tick may decide; None until the first ready tick."""
        return self._next_tick_at

    def decide_at_next_tick(self) -> None:
        """Let the next ready tick decide without waiting for the interval, unheld (an operator changed the target).

        The scale-down window forgets what earlier ticks wanted: an operator's count is applied as given.
        """
        self._next_tick_at = None
        self._wanted.clear()
        self._wanted_prefill.clear()
        self.pending_down = None

    def plan_pools(self, prefill: int) -> None:
        """The fleet turned out disaggregated (a prefill worker registered): from now on the targets carry a prefill pool,
        of `prefill` workers until a tick plans it. Nothing is issued: the fleet is as it is."""
        if self.targets.prefill is None:
            self.targets = self._targets(self.targets.workers, prefill)

    def tick_due(self, now: float) -> bool:
        """Whether a tick at `now` may decide (schedule and in-flight rules), so the caller can skip computing
        the desired count (and feeding its predictors) when it may not."""
        if self._next_tick_at is not None and now < self._next_tick_at:
            return False
        return self.in_flight is None or now >= self.in_flight.deadline

    @property
    def history(self) -> list[FinishedDecision]:
        return list(self._history)

    # Events.

    def tick(self, now: float, readiness: Readiness, desired_workers: int, *, arrivals: Arrivals | None = None,
             planned_rate: float | None = None, desired_prefill: int | None = None) -> Decision | None:
        """An interval tick with the replica maths' answer; a SCALE decision or None.

        `arrivals` (the last seconds) and `planned_rate` (the requests/s `desired_workers` was planned for) gate a scale-down:
        none while arrivals rise, and a pending one for `scale_down_confirm_s` otherwise. Without `arrivals` (no signal, an
        operator's target) a scale-down is issued at once.

        A disaggregated fleet's `desired_prefill` (its prefill pool; `desired_workers` is then the decode pool) is held by
        the scale-down window like the decode count and otherwise goes with the decision: at once when it rises, with a
        pending decode scale-down when it falls (`_prefill_at_tick`)."""
        self._expire(now)
        if not readiness.ready:
            self.pending_down = None
            return None
        if self._next_tick_at is not None and now < self._next_tick_at:
            return None
        self._remember(now, desired_workers)
        prefill = self._prefill_at_tick(now, desired_prefill)
        if self.in_flight is not None:
            # Not yet past its deadline (_expire would have cleared it): decide when it completes.
            return None
        self._next_tick_at = now + self.interval_s
        workers = max(desired_workers, 0)
        if workers < self.targets.workers:
            workers = min(self.targets.workers, max(d for _, d in self._wanted))  # hold what the window wanted
        if workers < self.targets.workers and arrivals is not None:
            decision = self._plan_scale_down(now, workers, arrivals, planned_rate, prefill)
            current = self.targets.prefill
            if decision is not None or prefill is None or current is None or prefill == current:
                return decision
            if self.pending_down is not None and prefill < current:
                return None  # the prefill pool's fall goes with the pending scale-down
            # The decode pool's scale-down is held or pending; the prefill pool's rise (or fall, when held) goes now.
            self.pending_down = None
            return self._issue_scale(now, self._targets(self.targets.workers, prefill))
        self.pending_down = None  # the plan no longer scales down: a pending scale-down goes
        wanted = self._targets(workers, prefill)
        if wanted == self.targets:
            return None
        return self._issue_scale(now, wanted)

    def _prefill_at_tick(self, now: float, desired_prefill: int | None) -> int | None:
        """The prefill pool's count a tick asks for: the plan's, held by the scale-down window like the decode count; the
        target in force for an aggregated fleet or no plan."""
        current = self.targets.prefill
        if desired_prefill is None or current is None:
            return current
        self._wanted_prefill.append((now, max(desired_prefill, 0)))
        while self._wanted_prefill and now - self._wanted_prefill[0][0] > self.config.scale_down_window_s:
            self._wanted_prefill.popleft()
        wanted = max(desired_prefill, 0)
        return wanted if wanted >= current else min(current, max(d for _, d in self._wanted_prefill))

    def arrivals(self, now: float, readiness: Readiness, arrivals: Arrivals | None) -> Decision | None:
        """Every poll between ticks: a pending scale-down is cancelled if arrivals rose (or the fleet is not ready), and
        issued once it is due with arrivals still down (also when they can no longer be measured). None otherwise."""
        self._expire(now)
        pending = self.pending_down
        if pending is None:
            return None
        if not readiness.ready or self.in_flight is not None or pending.workers >= self.targets.workers:
            self.pending_down = None
            return None
        if arrivals is not None and _rising(arrivals, pending.planned_rate, pending.workers, self.config.hold_confidence):
            self.pending_down = None
            self.scale_downs_held += 1
            return None
        if now < pending.due_at:
            return None
        self.pending_down = None
        return self._issue_scale(now, self._targets(pending.workers, pending.prefill if pending.prefill is not None else self.targets.prefill))

    def surge(self, now: float, readiness: Readiness, desired_workers: int, *, base_rate: float | None = None,
              surge_rate: float | None = None) -> Decision | None:
        """Arrivals between ticks already need `desired_workers`: a SURGE decision at once if that is more than the
        target, superseding a scaling decision in flight; None otherwise (it never scales down). With `withdraw_odds`, a
        `base_rate` (requests/s the fleet was planned for) and the `surge_rate` it was sized for, the surge is on trial
        (`surge_evidence`)."""
        self._expire(now)
        if not readiness.ready or desired_workers <= self.targets.workers:
            return None
        if self.config.withdraw_odds and base_rate is not None and surge_rate is not None and surge_rate > base_rate > 0:
            trial = self.provisional
            self.provisional = (ProvisionalSurge(since=now, workers_before=self.targets.workers, base_rate=base_rate, surge_rate=surge_rate)
                                if trial is None else replace(trial, surge_rate=max(trial.surge_rate, surge_rate)))
        self._remember(now, desired_workers)
        self.pending_down = None
        if self.in_flight is not None:
            self._finish(self.in_flight, Outcome.SUPERSEDED, now)
        # A ready spare serves now; the rest of the surge, and a spare in its place, start meanwhile.
        promote = {"promote": self.spares.pop(0)} if self.spares else {}
        decision = self._issue(now, self._targets(desired_workers, self.targets.prefill), DecisionReason.SURGE,
                               self.config.scale_deadline_s, **promote)
        self.in_flight = decision
        return decision

    def surge_evidence(self, now: float, readiness: Readiness, arrivals: float, seconds: float) -> Decision | None:
        """The surge on trial, given the `arrivals` of the `seconds` since it: a SCALE decision back to the count before it
        once they favour the planned rate by `withdraw_odds` (superseding the surge, and forgetting what it wanted in the
        scale-down window); None otherwise (it stands once they favour the surge's rate by those odds)."""
        self._expire(now)
        trial = self.provisional
        if trial is None:
            return None
        if not readiness.ready or self.targets.workers <= trial.workers_before:
            self.provisional = None  # the fleet is no longer what the surge made it: nothing left to withdraw
            return None
        odds = math.log(self.config.withdraw_odds)
        evidence = surge_log_odds(arrivals, seconds, trial.base_rate, trial.surge_rate)
        if evidence <= -odds:
            self.provisional = None
            return None
        if evidence < odds:
            return None
        self.surges_withdrawn += 1
        self._wanted = deque((at, wanted) for at, wanted in self._wanted if at < trial.since)
        self.pending_down = None
        if self.in_flight is not None:
            self._finish(self.in_flight, Outcome.SUPERSEDED, now)
            self.in_flight = None
        return self._issue_scale(now, self._targets(trial.workers_before, self.targets.prefill))

    def worker_dead(self, now: float, worker_id: str, *, role: str = "") -> Decision | None:
        """Health marked a worker DEAD: a restoration decision at once (None for a repeat, or a dead spare
        when spares are not wanted). A prefill worker (`role`) is restored from the prefill pool's spares."""
        self._expire(now)
        if worker_id in self._handled_dead:
            return None
        self._handled_dead[worker_id] = None
        if len(self._handled_dead) > _REMEMBERED_DEAD:
            del self._handled_dead[next(iter(self._handled_dead))]
        if worker_id in self.spares or worker_id in self.prefill_spares:
            # A spare died: the targets already ask for `hot_spares`, so only record the loss; the next
            # reconcile of the connector starts another one.
            self.spare_lost(worker_id)
            return None
        spares = self.prefill_spares if role == PREFILL else self.spares
        if spares:
            spare = spares.pop(0)
            decision = self._issue(
                now, self.targets, DecisionReason.PROMOTE_SPARE, self.config.promote_deadline_s, replaces=worker_id, promote=spare
            )
        else:
            decision = self._issue(now, self.targets, DecisionReason.REPLACE_DEAD, self.config.replace_deadline_s, replaces=worker_id)
        self.restorations[decision.id] = decision
        return decision

    def spare_ready(self, worker_id: str, *, role: str = "") -> None:
        """A hot spare registered and is warm; promotions take spares (of the dead worker's pool: a prefill spare for a
        prefill worker, `role`) in the order they became ready."""
        spares = self.prefill_spares if role == PREFILL else self.spares
        if worker_id not in spares:
            spares.append(worker_id)

    def spare_lost(self, worker_id: str) -> None:
        """A spare left without dying (drained, or promoted by someone else)."""
        for spares in (self.spares, self.prefill_spares):
            if worker_id in spares:
                spares.remove(worker_id)

    def complete(self, decision_id: int, now: float) -> bool:
        """A connector carried the decision out. False for an unknown id or a decision already timed out (a
        late acknowledgement changes nothing). Scaling and replacement latencies feed the interval;
        promotions do not (they say nothing about how fast a new worker starts)."""
        if self.in_flight is not None and self.in_flight.id == decision_id:
            decision = self.in_flight
            self.in_flight = None
        elif decision_id in self.restorations:
            decision = self.restorations.pop(decision_id)
        else:
            return False
        self._finish(decision, Outcome.COMPLETED, now)
        return True

    # Internals.

    def _plan_scale_down(self, now: float, workers: int, arrivals: Arrivals, planned_rate: float | None,
                         prefill: int | None = None) -> Decision | None:
        """A tick wants fewer workers: none while arrivals rise; else pending until due (at once without a confirm time)."""
        if _rising(arrivals, planned_rate, workers, self.config.hold_confidence):
            self.pending_down = None
            self.scale_downs_held += 1
            return None
        if self.config.scale_down_confirm_s <= 0:
            self.pending_down = None
            return self._issue_scale(now, self._targets(workers, prefill))
        # A later tick updates the count but not the due time: ticks must not postpone a scale-down for ever.
        due = self.pending_down.due_at if self.pending_down is not None else now + self.config.scale_down_confirm_s
        self.pending_down = PendingScaleDown(workers=workers, planned_rate=planned_rate, decided_at=now, due_at=due, prefill=prefill)
        return None

    def _targets(self, workers: int, prefill: int | None) -> Targets:
        """Targets of `workers` (and, in a disaggregated fleet, `prefill` prefill workers) with the configured spares."""
        if prefill is None:
            return Targets(workers=workers, spares=self.config.hot_spares)
        return Targets(workers=workers, spares=self.config.hot_spares, prefill=prefill, prefill_spares=self.config.prefill_hot_spares)

    def _issue_scale(self, now: float, targets: Targets) -> Decision:
        self.provisional = None  # a plan (or a withdrawal) decides the count from here
        decision = self._issue(now, targets, DecisionReason.SCALE, self.config.scale_deadline_s)
        self.in_flight = decision
        return decision

    def _issue(self, now: float, targets: Targets, reason: DecisionReason, deadline_s: float, **fields: str) -> Decision:
        before = self.targets
        starts = (max(0, targets.workers - before.workers) + max(0, (targets.prefill or 0) - (before.prefill or 0))
                  if reason in (DecisionReason.SCALE, DecisionReason.SURGE) else int(reason is DecisionReason.REPLACE_DEAD))
        decision = Decision(id=self.next_id, targets=targets, reason=reason, issued_at=now, deadline=now + deadline_s, starts=starts,
                            **fields)
        self.next_id += 1
        self.targets = targets
        return decision

    def _remember(self, now: float, desired_workers: int) -> None:
        self._wanted.append((now, max(desired_workers, 0)))
        while self._wanted and now - self._wanted[0][0] > self.config.scale_down_window_s:
            self._wanted.popleft()

    def _expire(self, now: float) -> None:
        if self.in_flight is not None and now >= self.in_flight.deadline:
            self._finish(self.in_flight, Outcome.TIMED_OUT, now)
            self.in_flight = None
        for decision_id, decision in list(self.restorations.items()):
            if now >= decision.deadline:
                del self.restorations[decision_id]
                self._finish(decision, Outcome.TIMED_OUT, now)

    def _finish(self, decision: Decision, outcome: Outcome, now: float) -> None:
        finished = FinishedDecision(decision, outcome, now)
        self._history.append(finished)
        # A promotion says nothing about how fast a new worker starts, nor a superseded decision about how long one takes.
        if decision.reason is not DecisionReason.PROMOTE_SPARE and outcome is not Outcome.SUPERSEDED:
            self._latencies.append(finished.latency_s)
        if decision.starts and outcome is Outcome.COMPLETED:
            self._start_latencies.append(finished.latency_s)


def _poisson_cdf(count: int, mean: float) -> float:
    """P(X <= count) for X Poisson with `mean`, the pmf summed term by term (the planner's counts are small: a few dozen
    terms); 0 for a negative count."""
    if count < 0:
        return 0.0
    pmf = cdf = math.exp(-mean)
    for k in range(1, count + 1):
        pmf *= mean / k
        cdf += pmf
    return cdf


def beyond_noise(arrivals: float, expected: float, confidence: float) -> bool:
    """Whether `arrivals` in a window are a rise beyond the noise of a Poisson process expected to bring `expected` there:
    as many or more had less than `1 - confidence` chance (0 confidence: any count is a rise)."""
    if confidence <= 0 or expected <= 0:
        return arrivals > expected
    tail = 1.0 - _poisson_cdf(math.ceil(arrivals - 1e-9) - 1, expected)  # P(X >= arrivals)
    return tail < 1.0 - confidence


def poisson_lower_bound(arrivals: float, confidence: float) -> float:
    """The lowest mean count a Poisson process may have brought `arrivals` with, at `confidence`: any lower mean makes them
    a rise beyond its noise (`beyond_noise`), the one-sided lower confidence bound of the mean. `arrivals` itself at 0
    confidence; 0 for no arrivals."""
    if arrivals <= 0 or confidence <= 0:
        return max(arrivals, 0.0)
    low, high = 0.0, float(arrivals)
    for _ in range(40):  # bisection to a 1e-12 fraction of the count: beyond_noise holds below the bound, fails above
        middle = (low + high) / 2
        low, high = (middle, high) if beyond_noise(arrivals, middle, confidence) else (low, middle)
    return low


def poisson_upper_bound(arrivals: float, confidence: float) -> float:
    """The highest mean count a Poisson process may have brought as few as `arrivals` with, at `confidence`: any higher mean
    makes them a fall beyond its noise (as few had less than `1 - confidence` chance), the one-sided upper confidence
    bound of the mean. `arrivals` itself at 0 confidence."""
    arrivals = max(arrivals, 0.0)
    if confidence <= 0:
        return arrivals
    at_most = math.floor(arrivals + 1e-9)
    low, high = arrivals, arrivals + 10 * math.sqrt(arrivals + 1) + 10
    for _ in range(40):  # bisection: P(X <= arrivals) falls with the mean, and is 1 - confidence at the bound
        middle = (low + high) / 2
        low, high = (middle, high) if _poisson_cdf(at_most, middle) >= 1 - confidence else (low, middle)
    return low


def surge_log_odds(arrivals: float, seconds: float, base_rate: float, surge_rate: float) -> float:
    """The log-likelihood ratio of a Poisson process at `base_rate` over one at `surge_rate` (both requests/s) for `arrivals`
    in `seconds`: positive favours the base rate. Each second adds (surge - base) - arrivals/s x ln(surge / base): about 1
    a second for a base rate of 1/s against a surge of 3/s with arrivals at the base rate, about -1.3 with arrivals at 3/s."""
    return (surge_rate - base_rate) * seconds - arrivals * math.log(surge_rate / base_rate)


def surge_workers(windows: Sequence[Arrivals], planned_rate: float | None, *, min_requests: int, confidence: float,
                  workers_for: Callable[[float], int], size_confidence: float | None = None) -> int | None:
    """The workers the last seconds' arrivals need when they are a surge; None otherwise. `windows`: the arrivals over
    spans of the last seconds, shortest first.

    Without a `confidence` (or without a plan yet: `planned_rate` None): the shortest window, when it holds at least
    `min_requests`, and the workers its own rate needs. With one, every window that holds at least `min_requests` and is a
    rise beyond the noise of `planned_rate` (requests/s the last plan was made for) counts, and the surge asks for the
    workers (`workers_for`) of the highest rate the arrivals show beyond noise: their Poisson lower bound
    (`poisson_lower_bound`) over the window, at `size_confidence` when given (whether the arrivals are a rise and how large
    it is are separate questions: a lower confidence sizes a real burst nearer its rate). A window's own rate is a rise's
    upper tail as often as not: noise that just passed the gate asked for what its luckiest 2 s needed (docs/results/,
    the seventh planner pass). Longer windows let a real burst ask for more as its arrivals add up, where the first 2 s cannot tell it
    from noise by much."""
    rate = surge_rate(windows, planned_rate, min_requests=min_requests, confidence=confidence, size_confidence=size_confidence)
    if rate is None:
        return None
    if confidence <= 0 or planned_rate is None:
        return windows[0].workers
    return workers_for(rate)


def surge_rate(windows: Sequence[Arrivals], planned_rate: float | None, *, min_requests: int, confidence: float,
               size_confidence: float | None = None) -> float | None:
    """The rate (requests/s) a surge is sized for, as `surge_workers` decides it; None for no surge."""
    if not windows:
        return None
    shortest = windows[0]
    if confidence <= 0 or planned_rate is None:
        return shortest.rate if shortest.requests >= min_requests else None
    size = confidence if size_confidence is None else size_confidence
    rates = [poisson_lower_bound(w.requests, size) * w.rate / w.requests for w in windows
             if w.requests >= min_requests and w.rate > 0
             and beyond_noise(w.requests, planned_rate * w.requests / w.rate, confidence)]  # expected over the window's span
    return max(rates) if rates else None


def _rising(arrivals: Arrivals, planned_rate: float | None, workers: int, confidence: float = 0.0) -> bool:
    """Arrivals run above the rate a scale-down to `workers` was planned for, or need more workers than it leaves; with
    `confidence` > 0 and a planned rate, only a rise beyond that rate's Poisson noise counts (`beyond_noise`)."""
    if confidence > 0 and planned_rate is not None:
        if arrivals.rate <= 0:
            return False
        expected = planned_rate * arrivals.requests / arrivals.rate  # over the window the arrivals were counted in
        return beyond_noise(arrivals.requests, expected, confidence)
    return arrivals.workers > workers or (planned_rate is not None and arrivals.rate > planned_rate)
