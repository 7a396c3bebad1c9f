"""The planner's pure plan step (planner/plan.py), and the health <-> planner loop its clamp keeps from scaling an overloaded
fleet down (docs/components.md, "The degradation level")."""

from __future__ import annotations

import pytest
from test_planner_replicas import SLO, hand_profile

from phalanx.health.config import DegradationConfig
from phalanx.health.degradation import DegradationPolicy, PlannerView, WorkerCapacity
from phalanx.planner.correction import CorrectionFactors
from phalanx.planner.distribution import Summary
from phalanx.planner.observations import Observation
from phalanx.planner.plan import PlanInputs, PlanOutcome, plan_step
from phalanx.planner.replicas import ReplicaConfig, SloTargets

pytestmark = pytest.mark.unit

PROFILE = hand_profile()
INTERVAL_S = 10.0


def _plan(rate: float, *, serving: int, target: int, level: int, aim: SloTargets = SLO) -> PlanOutcome:
    """`rate` requests/s of 400-token prompts and 200-token outputs, observed and predicted alike."""
    observation = Observation(interval_s=INTERVAL_S, requests=rate * INTERVAL_S, request_rate=rate, ttft=None, itl=None,
                              isl=Summary.constant(400.0), osl=Summary.constant(200.0))
    return plan_step(PlanInputs(
        observation=observation, predicted_requests=rate * INTERVAL_S, predicted_isl=400.0, predicted_osl=200.0,
        factors=CorrectionFactors(), slo=SLO, aim=aim, replicas=ReplicaConfig(interval_s=INTERVAL_S, length_quantile=None),
        serving_workers=serving, current_target=target, degradation_level=level,
    ), PROFILE)


def test_the_plan_is_the_replica_maths_and_the_capacity_view_reads_the_configured_slos() -> None:
    at_0 = _plan(15.0, serving=4, target=4, level=0)
    assert (at_0.workers, at_0.held_at_target, at_0.planned_rate) == (7, False, pytest.approx(15.0))
    # 6.6 worker-equivalents needed at the SLOs, over the 4 serving.
    assert at_0.capacity.needed_workers == pytest.approx(6.6) and at_0.capacity.pressure == pytest.approx(1.65)
    assert at_0.replan(10.0) == 5 and at_0.replan(15.0) == 7
    # Level 3 relaxes the SLOs the plan targets, never those of the view (feeding them back would make the level flap).
    at_3 = _plan(15.0, serving=4, target=4, level=3)
    assert at_3.plan.combined == 5 and at_3.capacity == at_0.capacity


def test_at_a_relaxed_level_the_plan_holds_the_target_in_force() -> None:
    held = _plan(15.0, serving=4, target=7, level=3)
    assert (held.plan.combined, held.workers, held.held_at_target) == (5, 7, True)
    # Above the target the relaxed plan is followed; below level 3 the plan is the plan.
    assert _plan(30.0, serving=4, target=7, level=3).workers == 9
    assert _plan(10.0, serving=7, target=7, level=0).workers == 5


def _health_level(policy: DegradationPolicy, now: float, serving: int, outcome: PlanOutcome) -> int:
    """Health's level with the planner's view as its one input (the serving workers report no load of their own)."""
    workers = [WorkerCapacity(f"w{i}", True, 1.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0) for i in range(serving)]
    view = outcome.capacity
    planner = PlannerView(pressure=view.pressure, needed_workers=view.needed_workers, serving_workers=view.serving_workers,
                          age_s=0.0, valid_for_s=2 * INTERVAL_S)
    return policy.evaluate(now, workers, planner).level


def test_the_loop_through_health_does_not_scale_an_overloaded_fleet_down() -> None:
    """A fleet of 4 planned up to 7 for 15 requests/s (3 workers starting). The planner's view over the 4 serving makes the
    level 3; planned at level 3's relaxed SLOs the fleet needs 5. Were the plan followed, the target would fall to 5, the
    view over 5 (pressure 1.32) would keep level 3, and the fleet would stay at 5, short, shedding. Held at the target in
    force, the fleet reaches 7, the view's pressure falls below 1 (0.94) and the level below the relaxed one."""
    policy = DegradationPolicy(DegradationConfig(raise_after_s=0.0, lower_after_s=0.0))
    serving, target, level = 4, 7, 0
    levels, targets = [], []
    for step in range(8):
        outcome = _plan(15.0, serving=serving, target=target, level=level)
        level = _health_level(policy, float(step), serving, outcome)
        target = outcome.workers
        serving = min(serving + 1, target) if serving < target else target  # a worker starts per interval
        levels.append(level)
        targets.append(target)
    assert min(targets) == 7, f"the targets went {targets} at levels {levels}"
    assert levels[0] == 3 and serving == 7 and levels[-1] < 3, f"levels {levels}"
