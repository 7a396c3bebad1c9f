"""The supervisor's restart policy: capped exponential backoff, reset once stable, and a crash loop ends it."""

import pytest

from phalanx.launch.restarts import RestartPolicy, RestartTracker

pytestmark = pytest.mark.unit

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, stable_after_s=30.0, crash_loop_limit=5)


def test_backoff_doubles_for_failures_in_a_row_and_is_capped():
    tracker = RestartTracker(POLICY)
    tracker.ready(0.0)
    delays = [tracker.exited(1.0).delay_s]
    delays += [tracker.failed_to_start().delay_s for _ in range(3)]
    assert delays == [0.5, 1.0, 2.0, 4.0]
    assert tracker.restarts == 4


def test_a_process_that_ran_stably_starts_its_count_afresh():
    tracker = RestartTracker(POLICY)
    tracker.ready(0.0)
    tracker.exited(1.0)
    tracker.ready(2.0)
    tracker.exited(3.0)
    tracker.ready(4.0)
    decision = tracker.exited(4.0 + POLICY.stable_after_s)
    assert decision.delay_s == 0.5 and decision.failures_in_a_row == 1 and not decision.give_up


def test_dying_at_start_up_again_and_again_is_a_crash_loop():
    tracker = RestartTracker(POLICY)
    tracker.ready(0.0)
    decisions = [tracker.exited(0.1)] + [tracker.failed_to_start() for _ in range(4)]
    assert [d.give_up for d in decisions] == [False, False, False, False, True]
    assert decisions[-1].failures_in_a_row == 5
    assert tracker.restarts == 4


def test_killing_a_long_running_process_never_counts_as_a_crash_loop():
    tracker = RestartTracker(RestartPolicy(crash_loop_limit=1, stable_after_s=10.0))
    now = 0.0
    for _ in range(20):
        tracker.ready(now)
        now += 10.0
        assert not tracker.exited(now).give_up


@pytest.mark.parametrize("kwargs", [{"crash_loop_limit": 0}, {"initial_backoff_s": 5.0, "max_backoff_s": 1.0}])
def test_nonsense_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_the_policy_reads_its_environment(monkeypatch):
    monkeypatch.setenv("PHALANX_UP_RESTART_BACKOFF_S", "0.1")
    monkeypatch.setenv("PHALANX_UP_CRASH_LOOP_LIMIT", "2")
    policy = RestartPolicy.from_env()
    assert policy.initial_backoff_s == 0.1 and policy.crash_loop_limit == 2 and policy.max_backoff_s == RestartPolicy().max_backoff_s
    monkeypatch.setenv("PHALANX_UP_CRASH_LOOP_LIMIT", "many")
    with pytest.raises(ValueError, match="PHALANX_UP"):
        RestartPolicy.from_env()
