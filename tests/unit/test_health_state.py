"""The per-worker health state machine and circuit breaker, driven directly."""

from __future__ import annotations

from phalanx.health.state import CheckOutcome, CheckResult, Circuit, Health, TrackerPolicy, WorkerTracker

POLICY = TrackerPolicy(unhealthy_after=3, failure_threshold=3, recovery_s=60.0, latency_factor=3.0, latency_slack_s=0.05, ema_alpha=0.1)


def tracker() -> WorkerTracker:
    return WorkerTracker("w1", POLICY, worker_started_at=100.0)


def fail(reason: str = "timeout") -> CheckOutcome:
    return CheckOutcome.failed(reason, "x")


def test_one_failure_makes_a_worker_suspicious_with_half_weight():
    t = tracker()
    change = t.observe(fail(), now=1.0)
    assert (change.old, change.new) == (Health.HEALTHY, Health.SUSPICIOUS)
    assert t.weight == 0.5 and t.circuit is Circuit.CLOSED
    assert t.last_failure == "timeout: x" and t.last_failure_at == 1.0


def test_a_passing_check_brings_a_suspicious_worker_back():
    t = tracker()
    t.observe(fail(), now=1.0)
    change = t.observe(CheckOutcome.passed(0.02), now=2.0)
    assert (change.old, change.new) == (Health.SUSPICIOUS, Health.HEALTHY)
    assert t.weight == 1.0 and t.consecutive_failures == 0


def test_three_consecutive_failures_make_it_unhealthy_open_its_circuit_and_ask_for_a_drain():
    t = tracker()
    t.observe(fail(), now=1.0)
    t.observe(fail(), now=2.0)
    change = t.observe(fail("token_mismatch"), now=3.0)
    assert change.new is Health.UNHEALTHY and change.drain
    assert t.weight == 0.0 and t.circuit is Circuit.OPEN and t.circuit_opened_at == 3.0
    assert t.draining(now=4.0).new is Health.DRAINING
    assert t.weight == 0.0


def test_failures_that_are_not_consecutive_do_not_add_up():
    t = tracker()
    for now in range(10):
        t.observe(fail(), now=now * 2.0)
        t.observe(CheckOutcome.passed(0.02), now=now * 2.0 + 1)
    assert t.health is Health.HEALTHY and t.circuit is Circuit.CLOSED


def test_inconclusive_checks_change_nothing():
    t = tracker()
    for _ in range(10):
        assert t.observe(CheckOutcome.inconclusive("RESOURCE_EXHAUSTED: queue full"), now=1.0) is None
    assert t.health is Health.HEALTHY and t.consecutive_failures == 0 and t.version == 0


def test_open_circuit_allows_one_half_open_check_after_recovery_and_closes_on_a_pass():
    t = tracker()
    for now in (1.0, 2.0, 3.0):
        t.observe(fail(), now=now)
    t.draining(now=3.5)
    assert not t.may_check(30.0)
    assert t.next_half_open_at() == 63.0
    assert t.may_check(63.0) and t.circuit is Circuit.HALF_OPEN
    assert not t.may_check(63.1)  # only one call while half open
    change = t.observe(CheckOutcome.passed(0.02), now=64.0)
    assert change.new is Health.HEALTHY and change.undrain
    assert t.circuit is Circuit.CLOSED and t.weight == 1.0


def test_failed_half_open_check_reopens_the_circuit_for_another_period():
    t = tracker()
    for now in (1.0, 2.0, 3.0):
        t.observe(fail(), now=now)
    assert t.may_check(63.0)
    t.observe(fail(), now=63.5)
    assert t.circuit is Circuit.OPEN and t.circuit_opened_at == 63.5
    assert not t.may_check(100.0) and t.may_check(123.5)


def test_latency_over_three_times_the_baseline_fails():
    t = tracker()
    for i in range(5):
        t.observe(CheckOutcome.passed(0.1), now=float(i))
    assert abs(t.baseline_s - 0.1) < 1e-9
    assert abs(t.latency_limit_s() - 0.3) < 1e-9
    change = t.observe(CheckOutcome.passed(0.35), now=10.0)
    assert change.new is Health.SUSPICIOUS and t.last_failure.startswith("latency")
    assert abs(t.baseline_s - 0.1) < 1e-9  # a failing latency does not drag the baseline up


def test_relaxed_latency_slos_stretch_the_canary_latency_limit():
    # Degradation level 3 relaxes the latency SLOs x2: a canary at 5x its baseline is slow, not faulty, there.
    t = tracker()
    t.observe(CheckOutcome.passed(0.1), now=0.0)
    assert abs(t.latency_limit_s(slo_factor=2.0) - 0.6) < 1e-9
    slow = CheckOutcome.passed(0.5)
    assert t.judge_latency(slow).reason == "latency"
    assert t.judge_latency(slow, slo_factor=2.0).result is CheckResult.PASS
    failed = t.judge_latency(CheckOutcome.passed(0.7), slo_factor=2.0)
    assert failed.reason == "latency" and failed.detail.endswith("over 600 ms (3x the 100 ms baseline, SLOs relaxed x2)")
    assert t.observe(slow, now=1.0, slo_factor=2.0) is None and t.health is Health.HEALTHY
    assert t.observe(slow, now=2.0).new is Health.SUSPICIOUS  # back at level 0, the same answer fails


def test_latency_slack_forgives_jitter_of_a_very_fast_canary():
    t = tracker()
    t.observe(CheckOutcome.passed(0.004), now=0.0)
    assert t.observe(CheckOutcome.passed(0.03), now=1.0) is None  # 7x, but only 26 ms over
    assert t.health is Health.HEALTHY


def test_baseline_is_an_ema_with_alpha_one_tenth():
    t = tracker()
    t.observe(CheckOutcome.passed(0.1), now=0.0)
    t.observe(CheckOutcome.passed(0.2), now=1.0)
    assert abs(t.baseline_s - 0.11) < 1e-9


def test_dead_is_final_for_this_incarnation():
    t = tracker()
    change = t.mark_dead("lease expired", now=5.0)
    assert change.new is Health.DEAD and t.weight == 0.0
    assert t.mark_dead("again") is None
    assert t.observe(CheckOutcome.passed(0.01), now=6.0) is None
    assert not t.may_check(1e9)


def test_a_worker_shutting_down_drains_without_a_fault_and_comes_back_if_it_serves_again():
    t = tracker()
    assert t.worker_stopping(now=1.0).new is Health.DRAINING
    assert t.circuit is Circuit.CLOSED and t.consecutive_failures == 0
    assert t.worker_serving(now=2.0).new is Health.HEALTHY


def test_record_round_trip_resumes_counters_circuit_and_baseline():
    t = tracker()
    t.observe(CheckOutcome.passed(0.05), now=0.0)
    t.observe(fail(), now=1.0)
    t.observe(fail(), now=2.0)
    restored = WorkerTracker.from_record(t.to_record(), POLICY)
    assert restored.health is Health.SUSPICIOUS and restored.consecutive_failures == 2
    assert restored.baseline_s == t.baseline_s and restored.version == t.version
    change = restored.observe(fail(), now=3.0)  # the third failure counts across the handover
    assert change.new is Health.UNHEALTHY


def test_half_open_in_progress_at_handover_is_retried_by_the_successor():
    t = tracker()
    for now in (1.0, 2.0, 3.0):
        t.observe(fail(), now=now)
    assert t.may_check(63.0)
    restored = WorkerTracker.from_record(t.to_record(), POLICY)
    assert restored.circuit is Circuit.OPEN
    assert restored.may_check(63.1)


def test_every_change_bumps_the_version():
    t = tracker()
    versions = [t.version]
    t.observe(fail(), now=1.0)
    versions.append(t.version)
    t.observe(fail(), now=2.0)
    versions.append(t.version)
    t.observe(CheckOutcome.passed(0.01), now=3.0)
    versions.append(t.version)
    assert versions == sorted(set(versions))


def test_a_fleet_wide_slowdown_is_no_fault_but_a_worker_slower_than_its_peers_is():
    t = tracker()
    t.observe(CheckOutcome.passed(0.1), now=0.0)
    spike = CheckOutcome.passed(0.35)
    assert t.judge_latency(spike, fleet_slowdown=1.0).reason == "latency"  # peers as usual: 3.5x fails
    assert t.judge_latency(spike, fleet_slowdown=3.0).result is CheckResult.PASS  # everyone 3x slower: up to 6x allowed
    assert t.judge_latency(CheckOutcome.passed(0.65), fleet_slowdown=3.0).reason == "latency"  # over 2x its peers
    assert t.observe(spike, now=1.0, fleet_slowdown=3.0) is None and t.health is Health.HEALTHY
    assert abs(t.last_ratio - 3.5) < 1e-9 and t.last_ratio_at == 1.0  # what its peers will see
