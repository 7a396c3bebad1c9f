"""The decision state machine with a fake clock: readiness gating, one scaling decision at a time, deadlines,
the adaptive interval, and capacity restoration (replacement, hot-spare promotion)."""

from __future__ import annotations

import math

import pytest

from phalanx.planner.decisions import (
    Arrivals,
    Decision,
    DecisionConfig,
    DecisionMachine,
    DecisionReason,
    Outcome,
    Readiness,
    Targets,
    beyond_noise,
    poisson_lower_bound,
    surge_log_odds,
    surge_rate,
    surge_workers,
)

pytestmark = pytest.mark.unit

READY = Readiness(routers_serving=True, serving_workers=1, metrics_flowing=True)


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def machine(workers: int = 2, **overrides) -> DecisionMachine:
    defaults = {"interval_s": 30.0, "latency_multiple": 2.0, "scale_deadline_s": 120.0}
    return DecisionMachine(DecisionConfig(**{**defaults, **overrides}), workers)


@pytest.mark.parametrize(
    "readiness",
    [
        Readiness(routers_serving=False, serving_workers=2, metrics_flowing=True),
        Readiness(routers_serving=True, serving_workers=0, metrics_flowing=True),
        Readiness(routers_serving=True, serving_workers=2, metrics_flowing=False),
    ],
)
def test_no_load_decision_until_routers_a_worker_and_metrics_are_ready(readiness: Readiness) -> None:
    clock, planner = Clock(), machine()
    for _ in range(5):
        assert planner.tick(clock.advance(60.0), readiness, desired_workers=5) is None
    assert planner.next_tick_at is None


def test_first_decision_comes_as_soon_as_ready_with_no_start_delay() -> None:
    clock, planner = Clock(), machine()
    assert planner.tick(clock.now, Readiness(True, 0, False), 5) is None
    decision = planner.tick(clock.advance(0.5), READY, 5)
    assert decision is not None
    assert (decision.reason, decision.targets, decision.issued_at) == (DecisionReason.SCALE, Targets(5, 0), clock.now)


def test_ticks_decide_once_per_interval() -> None:
    clock, planner = Clock(), machine()
    first = planner.tick(clock.now, READY, 3)
    assert first is not None
    planner.complete(first.id, clock.advance(1.0))
    assert planner.tick(clock.advance(10.0), READY, 4) is None  # 11 s into a 30 s interval
    assert planner.tick(clock.advance(18.9), READY, 4) is None
    second = planner.tick(clock.advance(0.1), READY, 4)  # 30 s after the first tick
    assert second is not None and second.targets.workers == 4 and second.id == first.id + 1


def test_an_unchanged_target_issues_nothing() -> None:
    clock, planner = Clock(), machine(workers=3)
    assert planner.tick(clock.now, READY, 3) is None
    assert planner.next_tick_at == clock.now + 30.0  # the tick still counts: next look in one interval
    assert planner.history == []


def test_no_new_decision_while_one_is_being_carried_out() -> None:
    clock, planner = Clock(), machine()
    first = planner.tick(clock.now, READY, 4)
    assert first is not None
    # Scaling takes long: ticks past the interval but before the deadline issue nothing, whatever the load says.
    for _ in range(3):
        assert planner.tick(clock.advance(30.0), READY, 8) is None
    assert planner.in_flight == first
    assert planner.complete(first.id, clock.advance(5.0))
    second = planner.tick(clock.now, READY, 8)  # the tick was due: decide at once after completion
    assert second is not None and second.targets.workers == 8


def test_a_decision_past_its_deadline_times_out_and_a_new_one_may_go() -> None:
    clock, planner = Clock(), machine(scale_deadline_s=100.0)
    first = planner.tick(clock.now, READY, 4)
    assert first is not None
    assert planner.tick(clock.advance(99.0), READY, 6) is None
    second = planner.tick(clock.advance(1.0), READY, 6)
    assert second is not None and second.targets.workers == 6
    [finished] = planner.history
    assert (finished.decision.id, finished.outcome, finished.latency_s) == (first.id, Outcome.TIMED_OUT, 100.0)
    assert not planner.complete(first.id, clock.advance(1.0))  # its late acknowledgement changes nothing
    assert planner.in_flight == second


def test_the_interval_adapts_to_the_measured_scaling_latency() -> None:
    clock, planner = Clock(), machine(latency_window=3, max_interval_s=200.0)
    decision = planner.tick(clock.now, READY, 4)
    assert decision is not None
    planner.complete(decision.id, clock.advance(40.0))  # scaling took 40 s: interval max(30, 2 x 40) = 80
    assert planner.interval_s == 80.0
    issued = planner.tick(clock.now, READY, 5)
    assert issued is not None and planner.next_tick_at == clock.now + 80.0
    # Three quick ones push the slow one out of the window.
    for workers in (6, 7, 8):
        planner.complete(issued.id, clock.advance(2.0))
        issued = planner.tick(clock.advance(200.0), READY, workers)
        assert issued is not None
    planner.complete(issued.id, clock.advance(2.0))
    assert planner.interval_s == 30.0
    # A timed-out decision counts with its whole wait, capped by max_interval_s.
    issued = planner.tick(clock.advance(200.0), READY, 9)
    assert issued is not None
    assert planner.tick(clock.advance(120.0), READY, 10) is not None
    assert planner.interval_s == 200.0  # 2 x 120 = 240, capped at 200


def test_the_lead_time_is_the_p90_of_how_long_decisions_that_start_workers_took() -> None:
    clock, planner = Clock(), machine(workers=2, interval_s=10.0, hot_spares=1)
    assert planner.lead_time_s is None  # nothing measured: plans look one interval ahead
    up = planner.tick(clock.now, READY, 4)
    assert up is not None and up.starts == 2
    planner.complete(up.id, clock.advance(12.0))
    down = planner.tick(clock.advance(30.0), READY, 3)
    assert down is not None and down.starts == 0
    planner.complete(down.id, clock.advance(1.0))  # a scale-down says nothing of how long a start takes
    assert planner.lead_time_s == 12.0
    planner.spare_ready("spare-1")
    replace = planner.worker_dead(clock.advance(1.0), "w1")
    assert replace is not None and replace.reason is DecisionReason.PROMOTE_SPARE and replace.starts == 0  # promotions neither
    planner.complete(replace.id, clock.advance(0.1))
    assert planner.lead_time_s == 12.0
    for latency in (3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0):  # replacements start one worker each
        dead = planner.worker_dead(clock.advance(1.0), f"dead-{latency}")
        assert dead is not None and dead.reason is DecisionReason.REPLACE_DEAD and dead.starts == 1
        planner.complete(dead.id, clock.advance(latency))
    # Ten latencies, 3 to 12 s: the 9th of them sorted (nearest rank) covers 90 % of the starts.
    assert planner.lead_time_s == 11.0
    timed_out = planner.worker_dead(clock.advance(1.0), "slow")
    assert timed_out is not None
    planner.tick(clock.advance(61.0), READY, 3)  # its deadline passed: a start that never finished measures nothing
    assert planner.lead_time_s == 11.0


def test_a_dead_worker_is_replaced_at_once() -> None:
    clock, planner = Clock(), machine(workers=3, replace_deadline_s=60.0)
    tick = planner.tick(clock.now, READY, 3)
    assert tick is None
    decision = planner.worker_dead(clock.advance(1.0), "w1")  # mid-interval
    assert decision is not None
    assert (decision.reason, decision.replaces, decision.targets) == (DecisionReason.REPLACE_DEAD, "w1", Targets(3, 0))
    assert decision.deadline == clock.now + 60.0
    assert planner.worker_dead(clock.advance(0.5), "w1") is None  # the same death reported again


def test_replacement_is_not_gated_on_readiness_or_a_scaling_decision_in_flight() -> None:
    clock, planner = Clock(), machine(workers=1)
    scaling = planner.tick(clock.now, READY, 2)
    assert scaling is not None
    # The only serving worker died: the fleet is not ready, a scaling decision is in flight; replace anyway.
    decision = planner.worker_dead(clock.advance(1.0), "w0")
    assert decision is not None and decision.reason is DecisionReason.REPLACE_DEAD
    assert decision.targets == Targets(2, 0)  # the targets of the scaling in flight stand
    assert planner.in_flight == scaling
    assert planner.complete(decision.id, clock.advance(4.0))
    assert planner.in_flight == scaling  # completing the replacement does not complete the scaling


def test_a_hot_spare_is_promoted_instead_and_another_spare_is_still_wanted() -> None:
    clock, planner = Clock(), machine(workers=4, hot_spares=1, promote_deadline_s=5.0)
    planner.spare_ready("spare-a")
    decision = planner.worker_dead(clock.now, "w2")
    assert decision is not None
    assert (decision.reason, decision.replaces, decision.promote) == (DecisionReason.PROMOTE_SPARE, "w2", "spare-a")
    assert decision.targets == Targets(workers=4, spares=1)  # the connector starts a new spare in the background
    assert planner.spares == []
    assert planner.complete(decision.id, clock.advance(0.2))
    assert planner.interval_s == 30.0  # a promotion says nothing about how long starting a worker takes
    # The next death finds no spare ready yet: a plain replacement.
    second = planner.worker_dead(clock.advance(1.0), "w3")
    assert second is not None and second.reason is DecisionReason.REPLACE_DEAD


def test_spares_are_promoted_in_the_order_they_became_ready() -> None:
    clock, planner = Clock(), machine(hot_spares=2)
    for spare in ("s1", "s2", "s1"):
        planner.spare_ready(spare)
    assert planner.spares == ["s1", "s2"]
    first, second = planner.worker_dead(clock.now, "a"), planner.worker_dead(clock.now, "b")
    assert first is not None and second is not None
    assert (first.promote, second.promote) == ("s1", "s2")


def test_a_dead_or_departed_spare_is_only_forgotten() -> None:
    clock, planner = Clock(), machine(hot_spares=2)
    planner.spare_ready("s1")
    planner.spare_ready("s2")
    assert planner.worker_dead(clock.now, "s1") is None  # the targets already ask for 2 spares
    planner.spare_lost("s2")
    assert planner.spares == []
    decision = planner.worker_dead(clock.now, "w0")
    assert decision is not None and decision.reason is DecisionReason.REPLACE_DEAD


def test_a_restoration_past_its_deadline_times_out() -> None:
    clock, planner = Clock(), machine(replace_deadline_s=60.0)
    decision = planner.worker_dead(clock.now, "w0")
    assert decision is not None
    planner.tick(clock.advance(60.0), Readiness(True, 0, True), 2)
    assert decision.id not in planner.restorations
    [finished] = planner.history
    assert finished.outcome is Outcome.TIMED_OUT
    assert not planner.complete(decision.id, clock.now)
    # A slow replacement is a slow scaling: it lengthens the interval too.
    assert planner.interval_s == 120.0


def test_decision_ids_are_unique_and_start_where_told() -> None:
    clock = Clock()
    planner = DecisionMachine(DecisionConfig(interval_s=1.0), workers=1, first_id=41)
    ids = []
    for workers in (2, 3):
        decision = planner.tick(clock.advance(2.0), READY, workers)
        assert decision is not None
        ids.append(decision.id)
        planner.complete(decision.id, clock.now)
    restoration = planner.worker_dead(clock.now, "w9")
    assert restoration is not None
    assert ids + [restoration.id] == [41, 42, 43]


def test_unknown_completions_are_refused() -> None:
    assert not machine().complete(7, 0.0)


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError):
        DecisionConfig(interval_s=0.0)
    with pytest.raises(ValueError):
        DecisionConfig(interval_s=700.0, max_interval_s=600.0)
    with pytest.raises(ValueError):
        DecisionConfig(hot_spares=-1)
    with pytest.raises(ValueError):
        DecisionConfig(promote_deadline_s=0.0)


def test_tick_due_follows_the_schedule_and_the_decision_in_flight_and_an_operator_can_skip_the_wait() -> None:
    clock = Clock()
    m = machine(workers=2, interval_s=30.0, scale_deadline_s=60.0)
    assert m.tick_due(clock.now)  # before the first ready tick
    first = m.tick(clock.now, READY, desired_workers=3)
    assert first is not None
    # In flight: not due, even past the interval, until completed or past its deadline.
    assert not m.tick_due(clock.advance(40))
    assert m.tick_due(clock.advance(20))  # 60 s: the deadline
    assert m.tick(clock.now, READY, desired_workers=3) is None  # expired, and 3 is already the target
    assert m.history[-1].outcome is Outcome.TIMED_OUT
    assert not m.tick_due(clock.advance(1))  # the interval grew with the 60 s wait
    m.decide_at_next_tick()
    assert m.tick_due(clock.now)
    second = m.tick(clock.now, READY, desired_workers=1)
    assert second is not None and second.targets == Targets(workers=1)


def test_a_surge_scales_up_at_once_between_ticks_and_supersedes_the_decision_in_flight() -> None:
    clock, planner = Clock(), machine(workers=2)
    first = planner.tick(clock.now, READY, desired_workers=3)
    assert first is not None and planner.in_flight == first
    # Before the next tick and before `first` completed: the arrivals already need 6.
    surge = planner.surge(clock.advance(1.0), READY, desired_workers=6)
    assert surge is not None and surge.reason is DecisionReason.SURGE and surge.targets == Targets(workers=6)
    assert planner.in_flight == surge
    assert [(f.decision.id, f.outcome) for f in planner.history] == [(first.id, Outcome.SUPERSEDED)]
    # A superseded decision says nothing about scaling latency: the interval stays as configured.
    assert planner.interval_s == 30.0
    # A surge never asks for fewer or as many, and waits for readiness.
    assert planner.surge(clock.advance(1.0), READY, desired_workers=6) is None
    assert planner.surge(clock.advance(1.0), READY, desired_workers=1) is None
    not_ready = Readiness(routers_serving=True, serving_workers=0, metrics_flowing=True)
    assert planner.surge(clock.advance(1.0), not_ready, desired_workers=9) is None
    assert planner.complete(surge.id, clock.advance(1.0))


def test_a_surge_promotes_a_ready_hot_spare_so_that_one_worker_serves_at_once() -> None:
    clock, planner = Clock(), machine(workers=2, hot_spares=1)
    planner.spare_ready("spare-1")
    surge = planner.surge(clock.now, READY, desired_workers=4)
    assert surge is not None and surge.promote == "spare-1" and surge.targets == Targets(workers=4, spares=1)
    assert planner.spares == []
    # Until a new spare is ready, a death is replaced by a new worker.
    dead = planner.worker_dead(clock.advance(0.5), "worker-0")
    assert dead is not None and dead.reason is DecisionReason.REPLACE_DEAD


def test_scale_down_waits_for_the_window_and_scale_up_does_not() -> None:
    clock, planner = Clock(), machine(workers=2, interval_s=2.0, scale_down_window_s=6.0)
    up = planner.tick(clock.now, READY, desired_workers=6)
    assert up is not None and up.targets.workers == 6
    planner.complete(up.id, clock.advance(0.5))
    # The burst is over: the maths wants 2, but the window still remembers 6.
    assert planner.tick(clock.advance(2.0), READY, desired_workers=2) is None
    assert planner.tick(clock.advance(2.0), READY, desired_workers=3) is None
    # Once 6 left the window, the largest count still in it (3), not the newest (2).
    down = planner.tick(clock.advance(2.5), READY, desired_workers=2)
    assert down is not None and down.targets.workers == 3
    planner.complete(down.id, clock.advance(0.5))
    assert planner.tick(clock.advance(2.0), READY, desired_workers=5).targets.workers == 5  # type: ignore[union-attr]


def test_without_a_window_a_tick_scales_down_at_once() -> None:
    clock, planner = Clock(), machine(workers=6, interval_s=2.0)
    down = planner.tick(clock.now, READY, desired_workers=2)
    assert down is not None and down.targets.workers == 2


def test_an_operators_target_is_not_held_by_the_scale_down_window() -> None:
    clock, planner = Clock(), machine(workers=2, interval_s=2.0, scale_down_window_s=6.0)
    up = planner.tick(clock.now, READY, desired_workers=4)
    assert up is not None
    planner.complete(up.id, clock.advance(0.5))
    # An operator sets 1 right after: applied at the next tick, not after the window forgot the 4.
    planner.decide_at_next_tick()
    down = planner.tick(clock.advance(0.1), READY, desired_workers=1)
    assert down is not None and down.targets.workers == 1


# Scale-down timing against arrivals: hand-made arrival series, driven as the service drives the machine (a poll every
# 0.25 s: `arrivals()`, then, when the interval is due, `tick()` with the last 2 s of arrivals).
POLL_S, WINDOW_S, PER_WORKER_RPS = 0.25, 2.0, 0.5


def recent(times: list[float], now: float) -> Arrivals:
    """The arrivals of the last WINDOW_S before `now` (the shell's surge window) and the workers they need."""
    count = sum(1 for t in times if now - WINDOW_S < t <= now)
    rate = count / WINDOW_S
    return Arrivals(requests=count, rate=rate, workers=max(1, math.ceil(rate / PER_WORKER_RPS)))


def drive(planner: DecisionMachine, times: list[float], start: float, end: float, *, desired: int, planned_rate: float) -> list[Decision]:
    """Polls from `start` to `end`; every tick is told the interval before planned `desired` workers for `planned_rate`."""
    decisions = []
    for step in range(round((end - start) / POLL_S) + 1):
        now = start + step * POLL_S
        for decision in (planner.arrivals(now, READY, recent(times, now)),
                         planner.tick(now, READY, desired, arrivals=recent(times, now), planned_rate=planned_rate)):
            if decision is not None:
                decisions.append(decision)
    return decisions


def lull(start: float, end: float) -> list[float]:
    """1 request/s, evenly: every 2 s window holds 2 (the rate the 2-worker plan is for)."""
    return [start + 0.5 + i for i in range(int(end - start))]


def test_a_burst_starting_at_a_tick_gets_no_scale_down() -> None:
    planner = machine(workers=6, interval_s=2.0, scale_down_confirm_s=2.0)
    # A lull, then a burst (3 requests/s) starting just after the tick at 4.0; every tick's plan, from the interval before,
    # says 2 workers for 1 request/s, as a forecast that lags the burst does.
    times = lull(0.0, 4.0) + [4.0 + (i + 1) / 3 for i in range(12)]
    assert drive(planner, times, 4.0, 8.0, desired=2, planned_rate=1.0) == []
    assert planner.targets.workers == 6 and planner.pending_down is None
    # The tick at 4.0 saw 1 request/s and put the scale-down off; the burst's first arrivals (2 by 4.5, too few for a
    # surge) cancelled it before it was due, and the ticks at 6.0 and 8.0 saw the burst and held.
    assert planner.scale_downs_held == 3


def test_in_a_true_lull_the_scale_down_goes_once_the_confirm_time_has_passed() -> None:
    planner = machine(workers=6, interval_s=2.0, scale_down_confirm_s=2.0)
    decisions = drive(planner, lull(0.0, 12.0), 4.0, 8.0, desired=2, planned_rate=1.0)
    assert [(d.reason, d.targets.workers, d.issued_at) for d in decisions] == [(DecisionReason.SCALE, 2, 6.0)]
    assert planner.scale_downs_held == 0


def test_a_scale_down_waits_for_both_windows_and_a_later_tick_does_not_postpone_it() -> None:
    clock = Clock(0.0)
    planner = machine(workers=6, interval_s=2.0, scale_down_window_s=6.0, scale_down_confirm_s=3.0)
    calm = Arrivals(requests=2.0, rate=1.0, workers=2)
    up = planner.tick(clock.now, READY, desired_workers=6, arrivals=calm, planned_rate=3.0)
    assert up is None  # 6 already
    # The window holds 6 until 6 s have passed; then the scale-down is pending for 3 s, across the tick at 8.0.
    assert planner.tick(clock.advance(2.0), READY, 2, arrivals=calm, planned_rate=1.0) is None
    assert planner.tick(clock.advance(2.0), READY, 2, arrivals=calm, planned_rate=1.0) is None
    assert planner.pending_down is None
    assert planner.tick(clock.advance(2.5), READY, 2, arrivals=calm, planned_rate=1.0) is None
    assert planner.pending_down is not None and planner.pending_down.due_at == 9.5
    assert planner.tick(clock.advance(2.0), READY, 3, arrivals=calm, planned_rate=1.2) is None
    assert planner.arrivals(clock.advance(0.5), READY, calm) is None  # 9.0
    down = planner.arrivals(clock.advance(0.5), READY, calm)  # 9.5: due, the later tick's count
    assert down is not None and down.targets.workers == 3 and planner.in_flight == down


def test_a_surge_or_a_fleet_no_longer_ready_cancels_a_pending_scale_down() -> None:
    calm = Arrivals(requests=2.0, rate=1.0, workers=2)
    planner = machine(workers=6, interval_s=2.0, scale_down_confirm_s=2.0)
    assert planner.tick(0.0, READY, 2, arrivals=calm, planned_rate=1.0) is None and planner.pending_down is not None
    surge = planner.surge(0.5, READY, desired_workers=7)
    assert surge is not None and surge.targets.workers == 7 and planner.pending_down is None
    assert planner.arrivals(2.0, READY, calm) is None
    planner.complete(surge.id, 2.5)
    assert planner.tick(4.0, READY, 2, arrivals=calm, planned_rate=1.0) is None and planner.pending_down is not None
    not_ready = Readiness(routers_serving=True, serving_workers=0, metrics_flowing=True)
    assert planner.arrivals(4.5, not_ready, calm) is None and planner.pending_down is None
    assert planner.arrivals(6.0, READY, calm) is None


def test_without_a_confirm_time_or_an_arrivals_signal_a_scale_down_goes_at_once_unless_arrivals_rise() -> None:
    planner = machine(workers=6, interval_s=2.0)
    rising = Arrivals(requests=3.0, rate=1.5, workers=2)  # above the 1 request/s planned, though 2 workers would serve it
    assert planner.tick(0.0, READY, 2, arrivals=rising, planned_rate=1.0) is None and planner.scale_downs_held == 1
    down = planner.tick(2.0, READY, 2, arrivals=Arrivals(requests=2.0, rate=1.0, workers=2), planned_rate=1.0)
    assert down is not None and down.targets.workers == 2
    # No signal (Prometheus, an operator's target): the confirm time does not apply.
    other = machine(workers=6, interval_s=2.0, scale_down_confirm_s=2.0)
    down = other.tick(0.0, READY, 2)
    assert down is not None and down.targets.workers == 2


def test_a_rise_beyond_noise_is_a_poisson_tail_below_one_minus_the_confidence() -> None:
    # Poisson(2): P(X >= 6) = 0.0166, P(X >= 7) = 0.0045.
    assert not beyond_noise(6, 2.0, 0.99)
    assert beyond_noise(7, 2.0, 0.99)
    # P(X >= 8) = 0.0011, P(X >= 9) = 0.00024.
    assert not beyond_noise(8, 2.0, 0.999) and beyond_noise(9, 2.0, 0.999)
    assert not beyond_noise(0, 2.0, 0.99)
    # No confidence: any count above the expected one; nothing expected: any arrival.
    assert beyond_noise(3, 2.0, 0.0) and not beyond_noise(2, 2.0, 0.0)
    assert beyond_noise(1, 0.0, 0.99)


def test_a_surge_needs_its_minimum_count_and_a_rise_beyond_the_planned_rates_noise() -> None:
    def arrivals(requests: int, window_s: float = 2.0, workers: int = 5) -> list[Arrivals]:
        return [Arrivals(requests=requests, rate=requests / window_s, workers=workers)]

    def workers_for(rate: float) -> int:
        return math.ceil(rate)

    # The measured case: 4 arrivals in 2 s at a planned 1 request/s (P(X >= 4) = 0.14 for Poisson(2)) is no surge ...
    assert surge_workers(arrivals(4), 1.0, min_requests=4, confidence=0.99, workers_for=workers_for) is None
    # ... the same count was one before the gate (confidence 0, the default: the count alone, whatever the plan, and the
    # workers the window's own rate needs), and is one without a plan yet.
    assert surge_workers(arrivals(4), 1.0, min_requests=4, confidence=0.0, workers_for=workers_for) == 5
    assert surge_workers(arrivals(4), 5.0, min_requests=4, confidence=0.0, workers_for=workers_for) == 5
    assert surge_workers(arrivals(4), None, min_requests=4, confidence=0.99, workers_for=workers_for) == 5
    # A 3x burst's 2 s (6 expected) reaching 7: a surge, asking for the rate 7 arrivals show beyond noise at 0.99 (the lower
    # bound 2.33 over 2 s: 2 workers here), not for their own 3.5/s.
    assert surge_workers(arrivals(7), 1.0, min_requests=4, confidence=0.99, workers_for=workers_for) == 2
    # The expected count is over the window the arrivals were counted in: 7 in 4 s at 1 request/s is noise.
    assert surge_workers(arrivals(7, window_s=4.0), 1.0, min_requests=4, confidence=0.99, workers_for=workers_for) is None
    # Below the minimum count nothing surges, however low the plan.
    assert surge_workers(arrivals(3), 0.1, min_requests=4, confidence=0.99, workers_for=workers_for) is None
    assert surge_workers([], 1.0, min_requests=4, confidence=0.99, workers_for=workers_for) is None


def test_the_poisson_lower_bound_is_where_a_count_stops_being_beyond_noise() -> None:
    # The chi-square bound (scipy.stats.chi2.ppf(1 - confidence, 2 k) / 2): 6 arrivals at 0.95 -> 2.613, 10 -> 5.425.
    assert poisson_lower_bound(6, 0.95) == pytest.approx(2.613, abs=1e-3)
    assert poisson_lower_bound(10, 0.95) == pytest.approx(5.425, abs=1e-3)
    assert poisson_lower_bound(1, 0.99) == pytest.approx(-math.log(0.99), rel=1e-6)  # P(X >= 1) = 1 - e^-mean
    for count in (1, 4, 7, 20, 60):
        bound = poisson_lower_bound(count, 0.95)
        assert beyond_noise(count, bound * 0.999, 0.95) and not beyond_noise(count, bound * 1.001, 0.95)
    assert poisson_lower_bound(0, 0.95) == 0.0
    assert poisson_lower_bound(5, 0.0) == 5.0


def test_a_burst_asks_for_more_as_its_arrivals_add_up_over_the_longer_windows() -> None:
    """A 3x burst of a 1 request/s plan: 2 s, 4 s and 8 s windows, the last one reaching back before the burst."""

    def window(requests: int, window_s: float) -> Arrivals:
        return Arrivals(requests=requests, rate=requests / window_s, workers=99)  # the window's own count: never asked for

    def workers_for(rate: float) -> int:
        return math.ceil(rate / 0.5)  # half a request/s per worker

    two_seconds_in = [window(6, 2.0), window(8, 4.0), window(12, 8.0)]
    four_seconds_in = [window(7, 2.0), window(13, 4.0), window(17, 8.0)]
    early = surge_workers(two_seconds_in, 1.0, min_requests=4, confidence=0.95, workers_for=workers_for)
    later = surge_workers(four_seconds_in, 1.0, min_requests=4, confidence=0.95, workers_for=workers_for)
    # 6 in 2 s: bound 2.61 -> 1.31/s; 8 in 4 s is no rise beyond 4 expected at 0.95 (P(X >= 8) = 0.051).
    assert early == workers_for(poisson_lower_bound(6, 0.95) / 2.0) == 3
    # 13 in 4 s: bound 7.69 -> 1.92/s, more than the 2 s window's 3.29 / 2 and the 8 s window's 10.83 / 8.
    assert later == workers_for(poisson_lower_bound(13, 0.95) / 4.0) == 4
    # Gated at 0.95 and sized at 0.5 (about the median): 7 in 2 s asks for 6.67 / 2 = 3.34/s, where the 0.95 bound asks for 1.64/s.
    sized = surge_workers(four_seconds_in, 1.0, min_requests=4, confidence=0.95, workers_for=workers_for, size_confidence=0.5)
    assert sized == workers_for(poisson_lower_bound(7, 0.5) / 2.0) == 7
    # Noise of the plan's own rate, in every window: no surge.
    calm = [window(4, 2.0), window(6, 4.0), window(10, 8.0)]
    assert surge_workers(calm, 1.0, min_requests=4, confidence=0.95, workers_for=workers_for) is None


def test_with_a_hold_confidence_only_a_rise_beyond_the_planned_rates_noise_holds_a_scale_down() -> None:
    # Planned for 1 request/s: Poisson(2) over a 2 s window, P(X >= 4) = 0.143, P(X >= 5) = 0.053, P(X >= 6) = 0.0166.
    def window(requests: int) -> Arrivals:
        return Arrivals(requests=requests, rate=requests / 2.0, workers=4)  # the noisy count's own plan: more than 2

    noisy = machine(workers=6, interval_s=2.0, hold_confidence=0.95)
    down = noisy.tick(0.0, READY, 2, arrivals=window(5), planned_rate=1.0)
    assert down is not None and down.targets.workers == 2 and noisy.scale_downs_held == 0
    risen = machine(workers=6, interval_s=2.0, hold_confidence=0.95)
    assert risen.tick(0.0, READY, 2, arrivals=window(6), planned_rate=1.0) is None and risen.scale_downs_held == 1
    # A pending scale-down is cancelled by the same test; no arrivals at all never hold.
    pending = machine(workers=6, interval_s=2.0, scale_down_confirm_s=2.0, hold_confidence=0.95)
    assert pending.tick(0.0, READY, 2, arrivals=window(0), planned_rate=1.0) is None and pending.pending_down is not None
    assert pending.arrivals(1.0, READY, window(5)) is None and pending.pending_down is not None
    assert pending.arrivals(1.5, READY, window(6)) is None and pending.pending_down is None and pending.scale_downs_held == 1
    # Without a confidence, the literal rule: 5 in 2 s is above 1 request/s, and needs more workers than 2.
    literal = machine(workers=6, interval_s=2.0)
    assert literal.tick(0.0, READY, 2, arrivals=window(5), planned_rate=1.0) is None and literal.scale_downs_held == 1
    with pytest.raises(ValueError):
        DecisionConfig(hold_confidence=1.0)


def test_surge_log_odds_weigh_the_planned_rate_against_the_surges() -> None:
    # 3 arrivals in 3 s at a planned 1/s against a surge sized for 3/s: 6 - 3 ln 3 in favour of the plan.
    assert surge_log_odds(3, 3.0, 1.0, 3.0) == pytest.approx(6 - 3 * math.log(3))
    assert surge_log_odds(9, 3.0, 1.0, 3.0) == pytest.approx(6 - 9 * math.log(3))  # the surge's own rate: against the plan
    assert 6 - 9 * math.log(3) < 0
    # The rate at which the evidence is even: (surge - base) / ln(surge / base), between the two.
    even = 2.0 / math.log(3.0)
    assert surge_log_odds(even * 4, 4.0, 1.0, 3.0) == pytest.approx(0.0, abs=1e-12)


def test_a_surge_the_arrivals_after_it_do_not_bear_out_is_withdrawn_and_the_window_forgets_it() -> None:
    clock, planner = Clock(), machine(workers=2, withdraw_odds=10.0, scale_down_window_s=30.0)
    surge = planner.surge(clock.now, READY, desired_workers=5, base_rate=1.0, surge_rate=3.0)
    assert surge is not None and planner.provisional is not None and planner.provisional.workers_before == 2
    # 1 arrival in the first second: 2 - ln 3 = 0.9 for the plan, under ln 10 = 2.3 either way.
    assert planner.surge_evidence(clock.advance(1.0), READY, arrivals=1, seconds=1.0) is None
    assert planner.provisional is not None
    # 3 in 3 s: 6 - 3 ln 3 = 2.7 for the plan: back to 2, the surge superseded (its starting workers are not needed).
    withdrawn = planner.surge_evidence(clock.advance(2.0), READY, arrivals=3, seconds=3.0)
    assert withdrawn is not None and withdrawn.reason is DecisionReason.SCALE and withdrawn.targets == Targets(workers=2)
    assert (surge.id, Outcome.SUPERSEDED) in [(f.decision.id, f.outcome) for f in planner.history]
    assert planner.provisional is None and planner.surges_withdrawn == 1 and planner.in_flight == withdrawn
    assert planner.complete(withdrawn.id, clock.advance(1.0))
    # The 30 s scale-down window no longer holds the surge's 5: a tick's 3 is issued as a scale-up from 2, not held at 5.
    assert planner.tick(clock.advance(1.0), READY, desired_workers=3) == Decision(
        id=withdrawn.id + 1, targets=Targets(workers=3), reason=DecisionReason.SCALE, issued_at=clock.now, deadline=clock.now + 120.0,
        starts=1)


def test_a_surge_the_arrivals_after_it_bear_out_stands_and_is_no_longer_on_trial() -> None:
    clock, planner = Clock(), machine(workers=2, withdraw_odds=10.0)
    assert planner.surge(clock.now, READY, desired_workers=5, base_rate=1.0, surge_rate=3.0) is not None
    # 8 in 2 s: 4 - 8 ln 3 = -4.8, beyond -ln 10: the burst is real.
    assert planner.surge_evidence(clock.advance(2.0), READY, arrivals=8, seconds=2.0) is None
    assert planner.provisional is None
    # Later quiet seconds withdraw nothing: the ticks scale down as usual.
    assert planner.surge_evidence(clock.advance(5.0), READY, arrivals=8, seconds=7.0) is None
    assert planner.targets == Targets(workers=5)


def test_a_chain_of_surges_is_judged_from_the_first_against_the_highest_rate() -> None:
    clock, planner = Clock(), machine(workers=2, withdraw_odds=10.0)
    planner.surge(clock.now, READY, desired_workers=4, base_rate=1.0, surge_rate=2.0)
    planner.surge(clock.advance(0.5), READY, desired_workers=6, base_rate=1.0, surge_rate=3.5)
    trial = planner.provisional
    assert trial is not None and (trial.since, trial.workers_before, trial.base_rate, trial.surge_rate) == (1000.0, 2, 1.0, 3.5)
    withdrawn = planner.surge_evidence(clock.advance(2.5), READY, arrivals=2, seconds=3.0)
    assert withdrawn is not None and withdrawn.targets == Targets(workers=2)


def test_without_withdraw_odds_or_rates_no_surge_is_on_trial() -> None:
    clock, planner = Clock(), machine(workers=2)
    assert planner.surge(clock.now, READY, desired_workers=5, base_rate=1.0, surge_rate=3.0) is not None
    assert planner.provisional is None
    assert planner.surge_evidence(clock.advance(5.0), READY, arrivals=0, seconds=5.0) is None
    assert planner.targets == Targets(workers=5)
    trial_less = machine(workers=2, withdraw_odds=10.0)
    assert trial_less.surge(clock.now, READY, desired_workers=5) is not None and trial_less.provisional is None
    with pytest.raises(ValueError, match="withdraw_odds"):
        DecisionConfig(withdraw_odds=0.5)


def test_a_tick_that_decides_ends_the_trial() -> None:
    clock, planner = Clock(), machine(workers=2, withdraw_odds=10.0)
    surge = planner.surge(clock.now, READY, desired_workers=4, base_rate=1.0, surge_rate=3.0)
    assert surge is not None and planner.complete(surge.id, clock.advance(0.5))
    assert planner.tick(clock.advance(0.5), READY, desired_workers=6) is not None  # the plan wants more: it owns the count
    assert planner.provisional is None
    assert planner.surge_evidence(clock.advance(3.0), READY, arrivals=0, seconds=4.0) is None


def test_surge_rate_is_the_rate_surge_workers_sizes_for() -> None:
    windows = [Arrivals(requests=8, rate=4.0, workers=5), Arrivals(requests=10, rate=2.5, workers=3)]
    rate = surge_rate(windows, 1.0, min_requests=4, confidence=0.95, size_confidence=0.5)
    assert rate is not None and rate == pytest.approx(poisson_lower_bound(8, 0.5) / 2.0)
    assert surge_workers(windows, 1.0, min_requests=4, confidence=0.95, workers_for=lambda r: math.ceil(r), size_confidence=0.5) == math.ceil(rate)
    assert surge_rate(windows, None, min_requests=4, confidence=0.95) == 4.0  # no plan yet: the shortest window's own rate
    assert surge_rate([Arrivals(requests=3, rate=1.5, workers=2)], 1.0, min_requests=4, confidence=0.95) is None
