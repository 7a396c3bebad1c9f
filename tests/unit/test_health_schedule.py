"""The health check schedule: rounds of checks as effects, deadlines, delays."""

import pytest

from phalanx.health.schedule import (
    CanaryDone,
    CheckPurpose,
    CheckRound,
    CheckSchedule,
    Deadline,
    EngineSample,
    Pause,
    Paused,
    Record,
    SchedulePolicy,
    SendCanary,
    StatsTaken,
    TakeStats,
    stuck_with_work,
)
from phalanx.health.state import CheckOutcome, CheckResult, Circuit, FailureReason, Health, TrackerPolicy, WorkerTracker

pytestmark = pytest.mark.unit

POLICY = SchedulePolicy(interval_s=1.0, jitter=0.1, timeout_s=5.0, min_timeout_s=0.25, failure_recheck_s=0.25)
IDLE = EngineSample(computed_tokens=100, held_requests=0)
HOLDING = EngineSample(computed_tokens=100, held_requests=1)
COMPUTED = EngineSample(computed_tokens=108, held_requests=1)
TIMEOUT = CheckOutcome.failed(FailureReason.TIMEOUT, "no answer", 1.0)


def tracker(baseline_s: float = 0.1, failures: int = 0) -> WorkerTracker:
    t = WorkerTracker("w", TrackerPolicy())
    t.baseline_s = baseline_s
    t.consecutive_failures = failures
    return t


def run(checks: CheckRound, *events) -> list:
    """The effects of a round fed `events` in order, the first effect included."""
    effects = [checks.start()]
    for event in events:
        effects.append(checks.on(event))
    return effects


def test_failure_reasons_keep_the_strings_etcd_metrics_and_alerts_use():
    assert [r.value for r in FailureReason] == [
        "timeout", "token_mismatch", "logit_out_of_range", "latency", "unreachable", "error", "probe_timeout", "inconclusive",
    ]
    outcome = CheckOutcome.failed("timeout", "no answer within 1.00 s")
    assert outcome.reason is FailureReason.TIMEOUT and outcome.reason == "timeout"
    t = tracker()
    t.observe(outcome, now=1.0)
    assert t.last_failure == "timeout: no answer within 1.00 s" and t.to_record().last_failure.startswith("timeout")
    t.observe(CheckOutcome.failed(FailureReason.ERROR), now=2.0)
    assert t.to_record().last_failure == "error"


def test_a_passing_canary_is_recorded_after_stats_and_the_next_round_comes_an_interval_later():
    t = tracker()
    checks = CheckSchedule(POLICY, t, uniform=lambda lo, hi: hi).begin()
    passed = CheckOutcome.passed(0.1)
    effects = run(checks, StatsTaken(IDLE), CanaryDone(passed))
    assert effects[0] == TakeStats()
    assert effects[1] == SendCanary(Deadline.ROUTINE, pytest.approx(0.9))  # 3x the 0.3 s limit
    assert effects[2] == Record(passed) and checks.done


def test_a_miss_while_the_engine_holds_work_and_computes_nothing_counts_at_once():
    checks = CheckSchedule(POLICY, tracker()).begin()
    effects = run(checks, StatsTaken(IDLE), CanaryDone(TIMEOUT), StatsTaken(HOLDING))
    assert effects[2] == TakeStats()  # the signature of a hang is read after the miss
    assert effects[3] == Record(TIMEOUT)


@pytest.mark.parametrize(
    "before, after",
    [(IDLE, COMPUTED), (IDLE, IDLE), (None, HOLDING), (IDLE, None)],
    ids=["engine computed", "engine holds nothing", "no stats before", "no stats after"],
)
def test_a_miss_that_is_not_the_signature_of_a_hang_gets_one_confirming_check(before, after):
    checks = CheckSchedule(POLICY, tracker()).begin()
    effects = run(checks, StatsTaken(before), CanaryDone(TIMEOUT), StatsTaken(after, fleet_slowdown=2.0))
    # The latency limit stretched by the peers' slowdown: 2 x 2 x 0.1 s.
    assert effects[3] == SendCanary(Deadline.CONFIRMING, pytest.approx(0.4), CheckPurpose.TIMEOUT_RECHECK)
    passed = CheckOutcome.passed(0.1)
    assert checks.on(CanaryDone(passed)) == Record(passed)


def test_a_worker_that_already_failed_gets_no_stats_and_no_second_chance():
    checks = CheckSchedule(POLICY, tracker(failures=1)).begin()
    effects = run(checks, CanaryDone(TIMEOUT))
    assert isinstance(effects[0], SendCanary) and effects[1] == Record(TIMEOUT)


def test_a_slow_answer_is_rechecked_twice_a_moment_apart_and_only_the_last_counts():
    checks = CheckSchedule(POLICY, tracker()).begin()
    slow = CheckOutcome.passed(0.5)  # over the 0.3 s limit
    effects = run(checks, StatsTaken(IDLE), CanaryDone(slow), Paused(), CanaryDone(slow), Paused(), CanaryDone(slow))
    assert effects[2] == Pause(0.2) and effects[4] == Pause(0.2)
    assert effects[3] == SendCanary(Deadline.ROUTINE, pytest.approx(0.9), CheckPurpose.LATENCY_RECHECK)
    assert effects[6] == Record(slow)


def test_a_slow_answer_followed_by_a_quick_one_records_the_quick_one():
    checks = CheckSchedule(POLICY, tracker()).begin()
    quick = CheckOutcome.passed(0.1)
    effects = run(checks, StatsTaken(IDLE), CanaryDone(CheckOutcome.passed(0.5)), Paused(), CanaryDone(quick))
    assert effects[-1] == Record(quick)


def test_an_event_that_does_not_fit_the_round_is_refused():
    checks = CheckSchedule(POLICY, tracker()).begin()
    checks.start()
    with pytest.raises(ValueError, match="phase stats_before"):
        checks.on(CanaryDone(TIMEOUT))


def test_deadlines_follow_the_baseline_within_the_interval_and_the_timeout():
    assert POLICY.deadline_s(Deadline.ROUTINE, tracker(baseline_s=0.0)) == 5.0  # no baseline yet
    assert POLICY.deadline_s(Deadline.ROUTINE, tracker(baseline_s=0.01)) == 0.25  # never tighter than the minimum
    assert POLICY.deadline_s(Deadline.ROUTINE, tracker(baseline_s=1.0)) == 1.0  # never past one interval
    # Not stretched by the peers: a hang must not hide behind a busy fleet.
    assert POLICY.deadline_s(Deadline.ROUTINE, tracker(), fleet_slowdown=5.0) == pytest.approx(0.9)
    assert POLICY.deadline_s(Deadline.CONFIRMING, tracker(), fleet_slowdown=5.0) == pytest.approx(1.0)
    assert POLICY.deadline_s(Deadline.CONFIRMING, tracker(baseline_s=2.0)) == 5.0
    # After a counted miss: the same limit, but at most half an interval.
    assert POLICY.deadline_s(Deadline.FOLLOW_UP, tracker(), fleet_slowdown=1.0) == pytest.approx(0.3)
    assert POLICY.deadline_s(Deadline.FOLLOW_UP, tracker(), fleet_slowdown=5.0) == 0.5
    assert POLICY.deadline_s(Deadline.FOLLOW_UP, tracker(baseline_s=2.0)) == 0.5


def test_the_delay_after_a_round_depends_on_how_it_ended():
    schedule = CheckSchedule(POLICY, tracker(failures=1), uniform=lambda lo, hi: lo)
    assert schedule.finish(CheckOutcome.passed(0.1)) == pytest.approx(0.9)  # interval minus the jitter
    assert schedule.last_failure is None
    assert schedule.finish(CheckOutcome.failed(FailureReason.LATENCY)) == 0.25
    assert schedule.finish(CheckOutcome.failed(FailureReason.TOKEN_MISMATCH)) == 0.0  # wrong answers do not clear by waiting
    assert schedule.finish(TIMEOUT) == 0.0  # the deadline already waited
    assert schedule.last_failure is FailureReason.TIMEOUT
    assert schedule.begin().start() == SendCanary(Deadline.FOLLOW_UP, pytest.approx(0.3))


def test_after_a_wrong_answer_the_failures_that_make_a_worker_unhealthy_go_out_together():
    t = tracker()
    schedule = CheckSchedule(POLICY, t)
    assert schedule.rounds_due() == 1
    wrong = CheckOutcome.failed(FailureReason.TOKEN_MISMATCH, "position 0", 0.5)
    t.observe(wrong, now=1.0)
    schedule.finish(wrong)
    assert schedule.rounds_due() == 2  # 3 wrong answers make it UNHEALTHY: the other 2 at once, each its own canary
    rounds = [schedule.begin() for _ in range(schedule.rounds_due())]
    assert [r.start() for r in rounds] == [SendCanary(Deadline.ROUTINE, pytest.approx(0.9))] * 2  # no stats: it failed already
    for checks in rounds:
        t.observe(checks.on(CanaryDone(wrong)).outcome, now=2.0)
    assert t.health is Health.UNHEALTHY
    # Anything else that failed is rechecked one round at a time, as is a worker that is out already.
    for reason in (FailureReason.LATENCY, FailureReason.TIMEOUT, FailureReason.UNREACHABLE):
        schedule.finish(CheckOutcome.failed(reason))
        assert schedule.rounds_due() == 1
    schedule.finish(wrong)
    assert schedule.rounds_due() == 1


def test_an_open_circuit_holds_checks_off_until_its_half_open_time():
    t = tracker()
    t.circuit, t.circuit_opened_at = Circuit.OPEN, 100.0
    schedule = CheckSchedule(POLICY, t)
    assert schedule.hold_off(130.0, stopping=False) == pytest.approx(30.0)
    assert schedule.hold_off(160.0, stopping=False) is None and t.circuit is Circuit.HALF_OPEN
    assert schedule.hold_off(160.5, stopping=False) == POLICY.interval_s  # its one canary is out


def test_a_stopping_worker_is_not_checked():
    schedule = CheckSchedule(POLICY, tracker())
    assert schedule.hold_off(1.0, stopping=True) == POLICY.interval_s
    assert schedule.hold_off(1.0, stopping=False) is None


def test_stuck_with_work_needs_both_samples_no_progress_and_held_requests():
    assert stuck_with_work(IDLE, HOLDING)
    assert not stuck_with_work(IDLE, COMPUTED)
    assert not stuck_with_work(IDLE, IDLE)
    assert not stuck_with_work(None, HOLDING) and not stuck_with_work(IDLE, None)


def test_the_first_round_starts_within_a_second_to_spread_many_workers():
    assert CheckSchedule(SchedulePolicy(interval_s=30.0), tracker(), uniform=lambda lo, hi: hi).first_delay() == 1.0
    assert CheckSchedule(SchedulePolicy(interval_s=0.5), tracker(), uniform=lambda lo, hi: hi).first_delay() == 0.5


def test_inconclusive_outcomes_fail_nothing():
    outcome = CheckOutcome.inconclusive("RESOURCE_EXHAUSTED: queue full")
    assert outcome.result is CheckResult.INCONCLUSIVE and outcome.reason is FailureReason.INCONCLUSIVE
    schedule = CheckSchedule(POLICY, tracker(), uniform=lambda lo, hi: 1.0)
    assert schedule.finish(outcome) == 1.0 and schedule.last_failure is None


def test_the_half_open_canary_after_a_timeout_keeps_the_confirming_deadline():
    t = tracker(failures=3)
    t.circuit, t.circuit_opened_at = Circuit.OPEN, 0.0
    schedule = CheckSchedule(POLICY, t)
    schedule.finish(TIMEOUT)
    assert schedule.hold_off(100.0, stopping=False) is None
    assert schedule.begin().start(fleet_slowdown=5.0) == SendCanary(Deadline.CONFIRMING, pytest.approx(1.0))


def hang_detection_s(baseline_s: float, fleet_slowdown: float, policy: SchedulePolicy = POLICY) -> float:
    """Seconds from a hang that begins just after a passing check until the worker is UNHEALTHY, the checks'
    effects taking no time but their deadlines."""
    t = tracker(baseline_s=baseline_s)
    schedule = CheckSchedule(policy, t, uniform=lambda lo, hi: hi)  # the longest jitter
    now = schedule.finish(CheckOutcome.passed(baseline_s))
    while t.health is not Health.UNHEALTHY:
        assert schedule.hold_off(now, stopping=False) is None
        checks = schedule.begin()
        effect = checks.start(fleet_slowdown)
        while not isinstance(effect, Record):
            if isinstance(effect, TakeStats):
                effect = checks.on(StatsTaken(HOLDING, fleet_slowdown))  # hung: holds the canary, computes nothing
            else:
                now += effect.deadline_s
                effect = checks.on(CanaryDone(CheckOutcome.failed(FailureReason.TIMEOUT, latency_s=effect.deadline_s), fleet_slowdown))
        t.observe(effect.outcome, now=now, fleet_slowdown=fleet_slowdown)
        now += schedule.finish(effect.outcome)
    return now


@pytest.mark.parametrize("baseline_s", [0.005, 0.05, 0.15, 0.25, 0.5, 1.2])
@pytest.mark.parametrize("fleet_slowdown", [1.0, 2.0, 10.0])
def test_a_hang_is_unhealthy_within_three_intervals_whatever_the_latency_baseline(baseline_s, fleet_slowdown):
    # At most one interval (and its jitter) until the next check, one for the first miss, one for the two after it.
    assert hang_detection_s(baseline_s, fleet_slowdown) <= (1 + POLICY.jitter) * POLICY.interval_s + 2 * POLICY.interval_s


def test_the_misses_after_the_first_one_of_a_hang_take_no_more_than_one_interval():
    # A loaded host: a 0.25 s baseline makes the latency limit 0.75 s, the peers' slowdown 1.0 s. Waiting out the
    # limit after each counted miss took 2 s for the two after the first, and the hang ~4.1 s to reach UNHEALTHY.
    first_miss = (1 + POLICY.jitter) * POLICY.interval_s + POLICY.interval_s
    assert hang_detection_s(0.25, fleet_slowdown=2.0) == pytest.approx(first_miss + POLICY.interval_s)
