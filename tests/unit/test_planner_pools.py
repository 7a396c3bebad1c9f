"""A disaggregated fleet's two pools (planner/pools.py, docs/disagg.md "Planner"): the plan's prefill count (TTFT-driven)
and decode count (ITL-driven) become two targets, each within its own bounds, with the correction factor of its phase;
serving workers are counted per pool from their registered roles; the decision machine carries both targets, holds
each pool's scale-down and restores a dead worker from its own pool's spares."""

from __future__ import annotations

import pytest
from test_planner_decisions import READY, Clock
from test_planner_plan import INTERVAL_S, PROFILE, SLO

from phalanx.common.roles import DECODE, PREFILL
from phalanx.planner.correction import CorrectionFactors
from phalanx.planner.decisions import Arrivals, DecisionConfig, DecisionMachine, DecisionReason, Targets
from phalanx.planner.distribution import Summary
from phalanx.planner.observations import Observation
from phalanx.planner.plan import PlanInputs, PlanOutcome, plan_step
from phalanx.planner.pools import FleetPools, FleetShape, PoolBounds, count_serving
from phalanx.planner.replicas import ReplicaConfig

pytestmark = pytest.mark.unit


def _plan(rate: float, *, disaggregated: bool, factors: CorrectionFactors | None = None) -> PlanOutcome:
    """`rate` requests/s of 400-token prompts and 200-token outputs, with the hand-computable profile of
    test_planner_replicas (prefill: 10,000 tokens/s per worker at 400 tokens)."""
    observation = Observation(interval_s=INTERVAL_S, requests=rate * INTERVAL_S, request_rate=rate, ttft=None, itl=None,
                              isl=Summary.constant(400.0), osl=Summary.constant(200.0))
    return plan_step(PlanInputs(
        observation=observation, predicted_requests=rate * INTERVAL_S, predicted_isl=400.0, predicted_osl=200.0,
        factors=factors or CorrectionFactors(), slo=SLO, aim=SLO,
        replicas=ReplicaConfig(interval_s=INTERVAL_S, length_quantile=None, min_workers=0),
        serving_workers=4, current_target=4, degradation_level=0, disaggregated=disaggregated,
    ), PROFILE)


def test_a_disaggregated_plan_asks_for_the_prefill_and_decode_counts_and_surges_size_the_decode_pool() -> None:
    # 40 requests/s x 400 tokens = 16,000 prefill tokens/s: 1.6 prefill workers -> 2; 16.0 decode worker-equivalents -> 16.
    split = _plan(40.0, disaggregated=True)
    assert (split.prefill, split.workers) == (2, 16)
    assert split.replan(15.0) == split.plan.decode - 10 == 6  # the decode pool's count at another rate
    # The same load aggregated: one pool of ceil(1.6 + 16.0) workers, and no prefill target.
    together = _plan(40.0, disaggregated=False)
    assert (together.prefill, together.workers, together.replan(15.0)) == (None, 18, 7)


def test_each_pools_correction_factor_moves_only_its_own_pool() -> None:
    # The fleet prefills twice as fast as profiled: half the prefill workers, the decode pool unchanged.
    faster_prefill = _plan(40.0, disaggregated=True, factors=CorrectionFactors(prefill=0.5))
    assert (faster_prefill.prefill, faster_prefill.workers) == (1, 16)
    # ITL twice the profile's: the decode pool plans for half the ITL target; the prefill pool does not move.
    slower_decode = _plan(40.0, disaggregated=True, factors=CorrectionFactors(decode=2.0))
    assert slower_decode.prefill == 2 and slower_decode.workers > 16


def test_serving_workers_are_counted_per_pool_by_their_registered_role() -> None:
    roles = {"w0": DECODE, "w1": DECODE, "w2": PREFILL, "w3": "monolithic", "w4": PREFILL}
    assert count_serving(roles, ["w0", "w2", "w3", "w4"]).prefill == 2
    assert count_serving(roles, ["w0", "w2", "w3", "w4"]).routed == 2
    assert count_serving(roles, ["unknown"]).routed == 1  # a worker not (yet) listed serves requests by default


def test_a_fleet_is_disaggregated_by_setting_or_once_a_prefill_worker_registered_and_stays_so() -> None:
    assert not FleetShape.of(None, ["monolithic", "monolithic"]).disaggregated
    seen = FleetShape.of(None, [DECODE, PREFILL])
    assert seen.disaggregated
    # The last prefill worker gone (dead, its registration lapsed): still two pools, so it is replaced.
    assert FleetShape.of(None, [DECODE], before=seen).disaggregated
    assert not FleetShape.of(False, [PREFILL]).disaggregated and FleetShape.of(True, []).disaggregated


def test_fleet_pools_count_the_routed_workers_and_remember_the_roles_of_departed_workers() -> None:
    aggregated = FleetPools(None, PoolBounds(1, 3))
    assert aggregated.update({"w0": "monolithic", "w1": "monolithic"}, ["w0", "w1"]) == 2
    assert aggregated.prefill_target(5, None) is None  # one pool: no prefill target
    pools = FleetPools(None, PoolBounds(1, 3))
    assert pools.update({"w0": DECODE, "w1": DECODE, "p0": PREFILL}, ["w0", "w1", "p0"]) == 2  # the decode workers
    assert pools.disaggregated and pools.counts.prefill == 1
    # A dead prefill worker's registration lapses before health's DEAD record is handled: its role is still known.
    pools.update({"w0": DECODE, "w1": DECODE}, ["w0", "w1"])
    assert pools.role("p0") == PREFILL and pools.counts.prefill == 0
    # The plan's prefill count within the pool's bounds; without a plan, the target in force within them.
    assert [pools.prefill_target(n, 2) for n in (0, 2, 9)] == [1, 2, 3]
    assert pools.prefill_target(None, 2) == 2 and pools.prefill_target(None, None) == 1


def test_pool_bounds_must_be_ordered() -> None:
    with pytest.raises(ValueError):
        PoolBounds(3, 2)


def _machine(workers: int = 4, prefill: int = 2, **overrides) -> DecisionMachine:
    config = {"interval_s": 30.0, "scale_deadline_s": 120.0, **overrides}
    return DecisionMachine(DecisionConfig(**config), workers, prefill=prefill)


def test_a_tick_decides_both_pools_and_a_prefill_change_alone_is_a_decision() -> None:
    clock, planner = Clock(), _machine(hot_spares=1, prefill_hot_spares=2)
    assert planner.targets == Targets(workers=4, spares=1, prefill=2, prefill_spares=2)
    decision = planner.tick(clock.now, READY, 6, desired_prefill=3)
    assert decision is not None and decision.targets == Targets(workers=6, spares=1, prefill=3, prefill_spares=2)
    planner.complete(decision.id, clock.advance(1.0))
    decision = planner.tick(clock.advance(60.0), READY, 6, desired_prefill=5)
    assert decision is not None and decision.targets == Targets(workers=6, spares=1, prefill=5, prefill_spares=2)
    planner.complete(decision.id, clock.advance(1.0))
    assert planner.tick(clock.advance(60.0), READY, 6, desired_prefill=5) is None  # nothing changed, nothing issued


def test_the_scale_down_window_holds_the_prefill_pool_too() -> None:
    clock, planner = Clock(), _machine(prefill=2, scale_down_window_s=100.0)
    first = planner.tick(clock.now, READY, 4, desired_prefill=4)
    assert first is not None and first.targets.prefill == 4
    planner.complete(first.id, clock.advance(1.0))
    # 40 s later the plan wants 1 prefill worker: the window still remembers 4.
    assert planner.tick(clock.advance(40.0), READY, 4, desired_prefill=1) is None
    # Past the window, the fall goes.
    decision = planner.tick(clock.advance(101.0), READY, 4, desired_prefill=1)
    assert decision is not None and (decision.targets.workers, decision.targets.prefill) == (4, 1)


def test_a_prefill_rise_goes_at_once_while_the_decode_scale_down_is_held_by_rising_arrivals() -> None:
    clock, planner = Clock(), _machine(workers=6, prefill=1)
    rising = Arrivals(requests=40.0, rate=20.0, workers=6)
    decision = planner.tick(clock.now, READY, 3, desired_prefill=2, arrivals=rising, planned_rate=5.0)
    assert decision is not None and (decision.targets.workers, decision.targets.prefill) == (6, 2)
    assert planner.scale_downs_held == 1


def test_a_pending_decode_scale_down_takes_the_prefill_fall_with_it() -> None:
    clock, planner = Clock(), _machine(workers=6, prefill=3, scale_down_confirm_s=2.0)
    calm = Arrivals(requests=4.0, rate=2.0, workers=2)
    assert planner.tick(clock.now, READY, 3, desired_prefill=1, arrivals=calm, planned_rate=5.0) is None
    assert planner.arrivals(clock.advance(1.0), READY, calm) is None
    decision = planner.arrivals(clock.advance(1.5), READY, calm)
    assert decision is not None and (decision.targets.workers, decision.targets.prefill) == (3, 1)


def test_surges_and_restorations_keep_the_prefill_target() -> None:
    clock, planner = Clock(), _machine(workers=2, prefill=2)
    surge = planner.surge(clock.now, READY, 5)
    assert surge is not None and (surge.reason, surge.targets.workers, surge.targets.prefill) == (DecisionReason.SURGE, 5, 2)
    restore = planner.worker_dead(clock.advance(1.0), "p0", role=PREFILL)
    assert restore is not None and restore.reason is DecisionReason.REPLACE_DEAD and restore.targets == surge.targets


def test_a_dead_worker_is_restored_from_its_own_pools_hot_spares() -> None:
    clock, planner = Clock(), _machine(hot_spares=1, prefill_hot_spares=1)
    planner.spare_ready("decode-spare", role=DECODE)
    planner.spare_ready("prefill-spare", role=PREFILL)
    assert (planner.spares, planner.prefill_spares) == (["decode-spare"], ["prefill-spare"])
    prefill_death = planner.worker_dead(clock.now, "p0", role=PREFILL)
    assert prefill_death is not None and (prefill_death.reason, prefill_death.promote) == (DecisionReason.PROMOTE_SPARE, "prefill-spare")
    decode_death = planner.worker_dead(clock.now, "w0", role=DECODE)
    assert decode_death is not None and decode_death.promote == "decode-spare"
    # No prefill spare left: the next prefill worker's death is a replacement, and the decode pool's spares are not touched.
    planner.spare_ready("decode-spare-2", role=DECODE)
    again = planner.worker_dead(clock.now, "p1", role=PREFILL)
    assert again is not None and again.reason is DecisionReason.REPLACE_DEAD and planner.spares == ["decode-spare-2"]
    # A spare of either pool that dies is only forgotten.
    assert planner.worker_dead(clock.now, "decode-spare-2") is None and planner.spares == []


def test_an_aggregated_machine_never_carries_a_prefill_target_until_the_fleet_turns_out_disaggregated() -> None:
    clock, planner = Clock(), DecisionMachine(DecisionConfig(interval_s=30.0, prefill_hot_spares=1), 2)
    decision = planner.tick(clock.now, READY, 3, desired_prefill=4)  # ignored: one pool
    assert decision is not None and decision.targets == Targets(workers=3)
    planner.plan_pools(1)
    assert planner.targets == Targets(workers=3, prefill=1, prefill_spares=1)
    planner.plan_pools(5)  # once only: the targets in force are the planner's from then on
    assert planner.targets.prefill == 1
