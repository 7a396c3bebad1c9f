"""Busy is not broken: the canary latency allowance a worker's load and its host's earn (health/load.py), as the tracker
and a round of checks apply it. Events in (load reports, canary outcomes, a clock), verdicts out."""

from dataclasses import replace

import pytest

from phalanx.health.load import FleetLoad, LoadPolicy, StepModel, load_level
from phalanx.health.schedule import (
    CanaryDone,
    CheckRound,
    Deadline,
    EngineSample,
    Pause,
    Paused,
    Record,
    SchedulePolicy,
    SendCanary,
    StatsTaken,
    TakeStats,
)
from phalanx.health.state import CheckOutcome, CheckResult, FailureReason, Health, TrackerPolicy, WorkerTracker

pytestmark = pytest.mark.unit

IDLE_STEP = 0.005
BASELINE = 0.05  # an idle canary: about 10 steps of 5 ms
POLICY = SchedulePolicy(interval_s=1.0, jitter=0.1, timeout_s=5.0, min_timeout_s=0.25, failure_recheck_s=0.25)


class Fleet:
    """Load reports every 100 ms on an injected clock."""

    def __init__(self, workers=("a", "b", "c"), policy: LoadPolicy | None = None) -> None:
        self.load = FleetLoad(policy or LoadPolicy())
        self.workers = workers
        self.now = 0.0

    def report(self, worker: str, step_s: float, held: int, jitter: float = 0.0) -> None:
        self.load.on_report(worker, "v1", step_s=step_s + jitter, held=held, now=self.now)

    def run(self, seconds: float, steps: dict[str, tuple[float, int]]) -> None:
        """Every worker reports (step time, held) every 100 ms for ``seconds``; the step time wobbles as a real one does."""
        for i in range(int(seconds * 10)):
            self.now += 0.1
            for worker in self.workers:
                step_s, held = steps.get(worker, (IDLE_STEP, 1))
                self.report(worker, step_s, held, jitter=step_s * 0.01 * (i % 3))

    def stretch(self, worker: str) -> float:
        return self.load.verdict(worker, self.now).stretch


def tracker() -> WorkerTracker:
    t = WorkerTracker("a", TrackerPolicy())
    t.baseline_s = BASELINE
    return t


def settled(fleet: Fleet | None = None) -> Fleet:
    """A fleet that learned its usual steps: idle (5 ms) and with batches of 8 (12 ms)."""
    fleet = fleet or Fleet()
    fleet.run(2, {})
    fleet.run(8, {w: (0.012, 8) for w in fleet.workers})  # a new level starts at its bound, learned once the load held
    fleet.run(3, {})
    return fleet


def test_load_levels_are_powers_of_two_of_the_held_requests():
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 7, 8, 100)] == [0, 0, 1, 1, 2, 2, 3, 6]


def test_an_unseen_load_level_is_bounded_by_the_batch_growth_from_a_lower_one_or_by_a_higher_one():
    model = StepModel({1: 0.01})
    assert model.expected_s(1) == 0.01
    assert model.expected_s(3) == pytest.approx(0.04)  # 4x the sequences cost at most 4x the step
    assert model.expected_s(0) == 0.01  # a lighter load is no slower
    assert StepModel().expected_s(0) is None


def test_a_worker_slowed_by_its_own_big_batch_gets_the_slowdown_its_batch_brings_and_stays_healthy():
    fleet = settled()
    fleet.run(1, {"a": (0.06, 64)})  # 64 sequences: 12x slower steps, peers idle
    stretch = fleet.stretch("a")
    assert 10 < stretch < 13
    t = tracker()
    for n in range(5):  # every canary 11x its idle baseline, as its steps are
        assert t.observe(CheckOutcome.passed(11 * BASELINE), now=float(n), load_factor=stretch) is None
    assert t.health is Health.HEALTHY and t.consecutive_failures == 0
    assert t.baseline_s == pytest.approx(BASELINE, rel=0.1)  # the baseline stays the idle pace
    # Without the allowance the same canaries would have failed: that is what the allowance is for.
    assert t.judge_latency(CheckOutcome.passed(11 * BASELINE)).reason is FailureReason.LATENCY


def test_a_worker_that_steps_slowly_for_its_load_while_its_peers_do_not_gets_no_allowance_and_is_taken_out():
    fleet = settled()
    fleet.run(1, {"a": (0.055, 1)})  # a `slow` fault: +50 ms a step at its usual load
    assert fleet.stretch("a") == 1.0
    assert fleet.load.verdict("a", fleet.now).excess > 10
    t = tracker()
    for n in range(3):
        t.observe(CheckOutcome.passed(10 * BASELINE), now=float(n), load_factor=fleet.stretch("a"))
        fleet.run(1, {"a": (0.055, 1)})
    assert t.health is Health.UNHEALTHY
    assert fleet.load.verdict("a", fleet.now).excess > 10  # never learned as its usual


def test_a_slow_worker_with_a_batch_gets_only_what_its_batch_explains():
    fleet = settled()
    fleet.run(1, {"a": (0.1, 8)})  # 8 sequences usually step 12 ms; 100 ms is not the batch
    stretch = fleet.stretch("a")
    assert stretch == pytest.approx(0.012 / IDLE_STEP, rel=0.05)
    t = tracker()
    assert t.judge_latency(CheckOutcome.passed(20 * BASELINE), load_factor=stretch).reason is FailureReason.LATENCY


def test_a_slowed_worker_that_piles_up_requests_gets_no_credit_for_its_new_bigger_batch():
    fleet = settled()
    fleet.run(1, {"a": (0.055, 1)})  # slow at a load it knows
    fleet.run(1, {"a": (0.056, 32)})  # its requests pile up: a load level it never saw
    assert fleet.stretch("a") == pytest.approx(0.012 / IDLE_STEP, rel=0.05)  # what its biggest known batch explains
    # A worker that was fine gets the batch's growth at a level it never saw (bounded by its actual steps).
    fleet.run(1, {"b": (0.03, 32)})
    assert fleet.stretch("b") == pytest.approx(6.0, rel=0.05)


def test_one_slow_peer_of_two_does_not_make_the_host_busy_for_another_slow_worker():
    fleet = settled()
    slow = {"a": (0.055, 1), "b": (0.055, 1)}  # two slowed workers, one fine: not a busy host
    fleet.run(1, slow)
    assert fleet.stretch("a") == 1.0 and fleet.stretch("b") == 1.0


def test_when_the_whole_host_is_busy_every_worker_gets_the_slowdown_its_peers_share():
    fleet = settled()
    hogged = {w: (2.5 * IDLE_STEP, 1) for w in fleet.workers}  # CPU hogs: every worker's steps 2.5x, loads as usual
    fleet.run(0.2, hogged)  # each worker's peers report within a beat
    assert all(2.3 < fleet.stretch(w) < 2.7 for w in fleet.workers)
    fleet.run(30, hogged)  # and while the hogs stay
    assert all(2.3 < fleet.stretch(w) < 2.7 for w in fleet.workers)
    t = tracker()
    for n in range(5):
        assert t.observe(CheckOutcome.passed(3 * 2.5 * BASELINE), now=float(n), load_factor=fleet.stretch("a")) is None
    assert t.health is Health.HEALTHY


def test_a_lone_worker_on_a_busy_host_has_no_peers_to_explain_a_sudden_slowdown():
    fleet = settled(Fleet(workers=("a",)))
    fleet.run(1, {"a": (2.5 * IDLE_STEP, 1)})
    assert fleet.stretch("a") == 1.0  # the peers' canaries (fleet_slowdown) and the rechecks are all it has


def test_the_lagging_step_average_at_a_change_of_load_is_neither_learned_as_usual_nor_taken_for_slowness():
    fleet = settled()
    # 48 requests arrive: the reported average climbs from the idle pace to 40 ms over a couple of seconds.
    for i in range(30):
        fleet.run(0.1, {"a": (min(0.04, 0.006 + 0.002 * i) + 0.0001 * (i % 2), 48)})
    assert fleet.stretch("a") == pytest.approx(0.04 / IDLE_STEP, rel=0.05)
    # The requests end; the average still says 120 ms for a while, at the idle level.
    fleet.run(0.3, {"a": (0.04, 0)})
    fleet.run(0.5, {"a": (0.005, 1)})
    fleet.run(0.3, {"a": (0.038, 40)})
    assert fleet.stretch("a") > 6  # no suspicion left behind by the lagging average


def test_a_canary_sent_as_a_big_batch_begins_is_judged_by_the_load_its_answer_says_it_met():
    fleet = settled()
    fleet.run(0.2, {"a": (0.006, 48)})  # 48 requests just arrived: the reported average still says idle
    assert fleet.stretch("a") < 1.5
    # The canary ran beside them: 9 steps of 40 ms, as its answer says.
    met = fleet.load.canary_verdict("a", step_s=0.04, held=49, now=fleet.now)
    assert met.stretch == pytest.approx(0.04 / IDLE_STEP, rel=0.05) and met.level == load_level(49)
    t = tracker()
    slow = CheckOutcome.passed(8 * BASELINE)
    assert t.judge_latency(slow, load_factor=fleet.stretch("a")).reason is FailureReason.LATENCY  # by the reports alone
    judged = replace(slow, load_factor=met.stretch)
    assert t.judge_latency(judged, load_factor=fleet.stretch("a")).result is CheckResult.PASS
    assert t.observe(judged, now=1.0, load_factor=fleet.stretch("a")) is None
    assert t.baseline_s == pytest.approx(BASELINE, rel=0.1)  # learned as the idle pace it would have taken


def test_a_canary_answer_explains_only_what_its_load_and_the_peers_do():
    fleet = settled()
    fleet.run(1, {"a": (0.055, 1)})  # a `slow` fault at its usual load: the canary's own steps are slow too
    assert fleet.load.canary_verdict("a", step_s=0.055, held=1, now=fleet.now).stretch == 1.0
    # With a batch of 8 it knows (12 ms steps), 100 ms steps are not the batch.
    assert fleet.load.canary_verdict("a", step_s=0.1, held=8, now=fleet.now).stretch == pytest.approx(0.012 / IDLE_STEP, rel=0.05)
    # An answer that says nothing (an older worker), an unknown worker or a disabled policy grant nothing.
    assert fleet.load.canary_verdict("a", step_s=0.0, held=0, now=fleet.now).stretch == 1.0
    assert fleet.load.canary_verdict("x", step_s=0.04, held=48, now=fleet.now).stretch == 1.0
    off = settled(Fleet(policy=LoadPolicy(enabled=False)))
    assert off.load.canary_verdict("a", step_s=0.04, held=48, now=off.now).stretch == 1.0
    # Wrong tokens fail whatever load the canary met.
    wrong = CheckOutcome.failed(FailureReason.TOKEN_MISMATCH, "position 0", 0.5, load_factor=20.0)
    assert tracker().judge_latency(wrong).reason is FailureReason.TOKEN_MISMATCH


def test_gradual_and_faster_steps_are_learned_as_the_usual_pace():
    fleet = settled()
    fleet.run(3, {"a": (0.002, 1)})  # faster: always learned
    assert fleet.load.verdict("a", fleet.now).excess == pytest.approx(1.0, rel=0.1)
    for factor in (1.2, 1.4, 1.6, 1.8, 2.0):  # a slow drift within learn_factor at each step follows
        fleet.run(3, {"a": (0.002 * factor, 1)})
    assert fleet.load.verdict("a", fleet.now).excess == pytest.approx(1.0, rel=0.1)


def test_stale_reports_and_a_worker_that_holds_work_but_takes_no_step_get_no_allowance():
    fleet = settled()
    fleet.run(1, {"a": (0.06, 64)})
    assert fleet.stretch("a") > 10
    assert fleet.load.verdict("a", fleet.now + 2.5).stretch == 1.0  # no report for 2.5 s
    # A hang under load: reports go on, but the step-time average no longer moves.
    for _ in range(25):
        fleet.now += 0.1
        fleet.load.on_report("a", "v1", step_s=0.06, held=64, now=fleet.now)
    assert fleet.stretch("a") == 1.0


def test_a_worker_whose_reports_are_fresh_and_whose_steps_move_is_progressing_a_silent_or_stuck_one_is_not():
    fleet = settled()
    fleet.run(1, {"a": (0.06, 64)})
    assert fleet.load.progressing("a", fleet.now)
    assert not fleet.load.progressing("a", fleet.now + 2.5)  # no report: its process may be stuck
    for _ in range(25):  # reports go on, but no step is taken while it holds work
        fleet.now += 0.1
        fleet.load.on_report("a", "v1", step_s=0.06, held=64, now=fleet.now)
    assert not fleet.load.progressing("a", fleet.now)
    assert not fleet.load.progressing("nobody", fleet.now)


def test_a_forgotten_or_unknown_worker_and_a_disabled_policy_grant_nothing():
    fleet = settled()
    fleet.run(1, {"a": (0.06, 64)})
    fleet.load.forget("a")
    assert fleet.stretch("a") == 1.0 and fleet.stretch("nobody") == 1.0
    off = settled(Fleet(policy=LoadPolicy(enabled=False)))
    off.run(1, {"a": (0.06, 64)})
    assert off.stretch("a") == 1.0


def test_a_busy_workers_slow_canary_passes_its_round_without_rechecks():
    t = tracker()
    checks = CheckRound(POLICY, t, after=None)
    assert checks.start(load_factor=10.0) == TakeStats()
    first = checks.on(StatsTaken(EngineSample(100, 64), load_factor=10.0))
    assert isinstance(first, SendCanary) and first.deadline_s == 1.0  # 3x the stretched limit, at most an interval
    done = checks.on(CanaryDone(CheckOutcome.passed(10 * BASELINE), load_factor=10.0))
    assert done == Record(CheckOutcome.passed(10 * BASELINE))


def test_a_busy_workers_missed_deadline_is_confirmed_with_its_load_but_a_hang_counts_at_once():
    missed = CheckOutcome.failed(FailureReason.TIMEOUT, "no answer", 1.0)
    busy = CheckRound(POLICY, tracker(), after=None)
    busy.start()
    busy.on(StatsTaken(EngineSample(100, 64), load_factor=4.0))
    assert busy.on(CanaryDone(missed, load_factor=4.0)) == TakeStats()
    confirm = busy.on(StatsTaken(EngineSample(400, 64), load_factor=4.0))
    assert isinstance(confirm, SendCanary) and confirm.deadline is Deadline.CONFIRMING
    assert confirm.deadline_s == pytest.approx(4 * 3 * BASELINE)
    hung = CheckRound(POLICY, tracker(), after=None)
    hung.start()
    hung.on(StatsTaken(EngineSample(100, 64), load_factor=4.0))
    hung.on(CanaryDone(missed, load_factor=4.0))
    assert hung.on(StatsTaken(EngineSample(100, 64), load_factor=4.0)) == Record(missed)
    # The follow-ups of a counted miss keep their short deadline whatever the load said.
    t = tracker()
    assert POLICY.deadline_s(Deadline.FOLLOW_UP, t, load_factor=10.0) == POLICY.deadline_s(Deadline.FOLLOW_UP, t)


def test_wrong_tokens_fail_whatever_the_load():
    t = tracker()
    wrong = CheckOutcome.failed(FailureReason.TOKEN_MISMATCH, "position 0", 0.5)
    for n in range(3):
        t.observe(wrong, now=float(n), load_factor=20.0)
    assert t.health is Health.UNHEALTHY and t.judge_latency(wrong, load_factor=20.0).result is CheckResult.FAIL


def test_a_starved_worker_whose_long_steps_still_move_is_progressing_within_three_of_its_steps():
    fleet = settled()
    fleet.run(1, {w: (0.4, 4) for w in fleet.workers})  # a starved host: 400 ms steps
    at = fleet.now
    for _ in range(10):  # one whole second on one step: the average does not move
        fleet.now += 0.1
        fleet.load.on_report("a", "v1", step_s=0.4 * 1.02, held=4, now=fleet.now)
    assert fleet.load.progressing("a", fleet.now)
    fleet.now = at + 1.5  # past 3 of its steps (and reports still come): no progress
    fleet.load.on_report("a", "v1", step_s=0.4 * 1.02, held=4, now=fleet.now)
    assert not fleet.load.progressing("a", fleet.now)


def test_a_miss_while_the_reports_show_steps_moving_is_confirmed_not_counted_a_hang_still_counts_at_once():
    missed = CheckOutcome.failed(FailureReason.TIMEOUT, "no answer", 1.0)
    starved = CheckRound(POLICY, tracker(), after=None)
    starved.start()
    starved.on(StatsTaken(EngineSample(100, 4)))
    starved.on(CanaryDone(missed))
    confirm = starved.on(StatsTaken(EngineSample(100, 4), load_factor=20.0, progressing=True))  # nothing computed, yet moving
    assert isinstance(confirm, SendCanary) and confirm.deadline is Deadline.CONFIRMING and confirm.deadline_s == POLICY.timeout_s
    # ... while its steps keep moving: once they stop, its confirming deadline (a hang that began within the round).
    assert confirm.while_progressing_from_s is not None and confirm.while_progressing_from_s < POLICY.timeout_s
    assert starved.on(CanaryDone(CheckOutcome.passed(0.5), load_factor=20.0)) == Record(CheckOutcome.passed(0.5))
    # After a counted miss: no second chance, unless its steps visibly move.
    t = tracker()
    t.consecutive_failures = 1
    follow_up = CheckRound(POLICY, t, after=FailureReason.TIMEOUT)
    assert isinstance(follow_up.start(), SendCanary)
    assert follow_up.on(CanaryDone(missed, progressing=True)) == TakeStats()
    assert isinstance(follow_up.on(StatsTaken(EngineSample(100, 4), progressing=True)), SendCanary)
    hung = CheckRound(POLICY, t, after=FailureReason.TIMEOUT)
    hung.start()
    assert hung.on(CanaryDone(missed, progressing=False)) == Record(missed)


def test_a_stall_of_the_whole_host_is_no_hang_one_worker_stuck_while_its_peers_move_is():
    fleet = settled()
    fleet.run(1, {w: (0.05, 4) for w in fleet.workers})
    at = fleet.now
    fleet.now += 0.8  # the host stalls: no worker steps (nor reports) for 0.8 s
    assert fleet.load.host_stalled("a", fleet.now)
    fleet.now = at
    for _ in range(8):  # only "a" is stuck; its peers step on
        fleet.now += 0.1
        fleet.load.on_report("a", "v1", step_s=0.05, held=4, now=fleet.now)
        for peer in ("b", "c"):
            fleet.report(peer, 0.05, 4, jitter=0.001 * (fleet.now % 0.3))
    assert not fleet.load.progressing("a", fleet.now) and not fleet.load.host_stalled("a", fleet.now)
    assert not settled(Fleet(workers=("a",))).load.host_stalled("a", 100.0)  # a lone worker cannot tell
    # A miss that looks like a hang while the host stalled is confirmed; the same miss beside moving peers counts at once.
    missed = CheckOutcome.failed(FailureReason.TIMEOUT, "no answer", 1.0)
    for host_stalled, counted in ((True, False), (False, True)):
        checks = CheckRound(POLICY, tracker(), after=None)
        checks.start()
        checks.on(StatsTaken(EngineSample(100, 4)))
        checks.on(CanaryDone(missed))
        effect = checks.on(StatsTaken(EngineSample(100, 4), host_stalled=host_stalled))
        assert (effect == Record(missed)) is counted
        assert isinstance(effect, SendCanary) is not counted


def test_a_latency_recheck_of_a_worker_whose_steps_move_waits_for_its_answer():
    slow = CheckOutcome.passed(5 * BASELINE)
    for progressing, deadline_s in ((True, POLICY.timeout_s), (False, pytest.approx(9 * BASELINE))):
        checks = CheckRound(POLICY, tracker(), after=None)
        checks.start()
        checks.on(StatsTaken(EngineSample(100, 4)))
        assert checks.on(CanaryDone(slow)) == Pause(POLICY.latency_pause_s())
        recheck = checks.on(Paused(progressing=progressing))
        assert isinstance(recheck, SendCanary) and recheck.deadline_s == deadline_s
        # The whole timeout holds only while the steps keep moving: once they stop, the routine deadline again (a hang).
        assert recheck.while_progressing_from_s == (pytest.approx(9 * BASELINE) if progressing else None)


def test_a_successor_seeded_with_the_usual_steps_gives_a_busy_worker_its_allowance_from_the_first_report():
    learned = settled()
    usual = learned.load.usual_steps("a")
    assert set(usual) == {0, 3}  # idle and batches of 8, as learned
    busy = {w: (0.06, 64) for w in learned.workers}

    # A successor that starts while every worker is busy (64 sequences, 12x slower steps than idle).
    blank = Fleet()
    blank.run(0.3, busy)
    seeded = Fleet()
    for worker in seeded.workers:
        seeded.load.seed(worker, "v1", learned.load.usual_steps(worker))
    seeded.run(0.3, busy)
    # Without the usual steps the successor takes the busy pace for the idle one: no allowance, and the persisted idle
    # baseline would fail a busy worker's canaries. With them, the batch's slowdown is allowed at once.
    assert blank.stretch("a") < 1.1
    assert seeded.stretch("a") > 10
    # A seed never replaces what the successor has learned itself, and an empty one changes nothing.
    seeded.load.seed("a", "v1", {0: 1.0})
    assert seeded.load.usual_steps("a")[0] == usual[0]
    seeded.load.seed("z", "v1", {})
    assert seeded.load.usual_steps("z") == {}
