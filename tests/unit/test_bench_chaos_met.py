"""`phalanx bench chaos`'s verdict per scenario (phalanx.bench.chaos.met)."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.bench.chaos import GOALS, met
from phalanx.chaos import ScenarioResult

pytestmark = pytest.mark.unit

CLEAN = ScenarioResult(
    scenario="worker-kill", description="", requests=9, lost=0, tokens_lost=0, tokens_repeated=0, identical_fraction=1.0,
    stall_p99_s=0.3, baseline_stall_p99_s=0.2, recovery_s=3.0, http_retries=0, details={}, wall_s=30.0,
)


def test_a_clean_run_meets_every_goal_that_applies() -> None:
    verdict = met(CLEAN)
    assert verdict["fault_injected"] and verdict["stall_p99_s"] and verdict["recovered"]
    assert verdict["false_verdicts"] is None  # only etcd faults watch for healthy workers declared dead
    assert set(verdict) == set(GOALS)


def test_a_run_whose_fault_never_happened_fails_whatever_its_streams_saw() -> None:
    verdict = met(dataclasses.replace(CLEAN, details={"fault_not_injected": "the store failed no spill within 60 s"}))
    assert verdict["fault_injected"] is False
    assert verdict["lost"] and verdict["stall_p99_s"]  # the streams were fine: that is exactly what proves nothing


def test_the_stall_of_a_fault_that_stops_streams_by_design_is_reported_not_judged() -> None:
    verdict = met(dataclasses.replace(CLEAN, scenario="worker-sigstop", stall_p99_s=2.1))
    assert verdict["stall_p99_s"] is None
    assert not met(dataclasses.replace(CLEAN, stall_p99_s=0.7))["stall_p99_s"]
