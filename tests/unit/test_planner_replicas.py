"""Replica maths against hand-computed cases: Dynamo's formulas, minimums, GPU budget, corrections,
degradation, quantile planning and the combined (aggregated) worker count."""

from __future__ import annotations

import numpy as np
import pytest

from phalanx.planner.correction import CorrectionFactors
from phalanx.planner.distribution import Summary
from phalanx.planner.profile import PerformanceProfile
from phalanx.planner.replicas import LoadForecast, ReplicaConfig, SloTargets, plan_replicas, planning_length

pytestmark = pytest.mark.unit

SLO = SloTargets(ttft_s=0.5, itl_s=0.02)
INTERVAL = 60.0


def hand_profile(gpus_per_worker: int = 1) -> PerformanceProfile:
    """Numbers chosen to be computed by hand (per worker; per GPU divides by gpus_per_worker):

    prefill  ISL      100     1000    10000
             TTFT     0.01    0.1     2.0       -> 10000, 10000, 5000 tokens/s
    decode   ITL at concurrency 1 / 10 / 100    -> tokens/s = concurrency / ITL
             context 500:   0.01 / 0.02 / 0.10  -> 100 / 500 / 1000
             context 5000:  0.02 / 0.05 / 0.40  ->  50 / 200 /  250
    """
    itl = np.array([[0.01, 0.02, 0.10], [0.02, 0.05, 0.40]])
    concurrency = np.array([1.0, 10.0, 100.0])
    ttft = np.array([0.01, 0.1, 2.0])
    isl = np.array([100.0, 1000.0, 10000.0])
    return PerformanceProfile(
        model="hand",
        gpus_per_worker=gpus_per_worker,
        prefill_isl=isl,
        prefill_ttft_s=ttft,
        prefill_tokens_per_s=isl / ttft,
        decode_context=np.array([500.0, 5000.0]),
        decode_concurrency=concurrency,
        decode_itl_s=itl,
        decode_tokens_per_s=concurrency / itl,
    )


PROFILE = hand_profile()


def forecast(requests_per_s: float = 10.0, isl: Summary | None = None, osl: Summary | None = None) -> LoadForecast:
    """10 requests/s of 400-token prompts and 200-token outputs: context 400 + 200 / 2 = 500, a grid row."""
    return LoadForecast(requests=requests_per_s * INTERVAL, isl=isl or Summary.constant(400.0), osl=osl or Summary.constant(200.0))


def config(**overrides) -> ReplicaConfig:
    return ReplicaConfig(**{"interval_s": INTERVAL, "length_quantile": None, **overrides})


def test_dynamo_formulas_by_hand() -> None:
    plan = plan_replicas(forecast(), PROFILE, SLO, config())
    # prefill: 10 req/s x 400 tokens = 4000 tokens/s over 10000 tokens/s per GPU = 0.4 -> 1
    assert plan.prefill_raw == pytest.approx(0.4)
    assert plan.prefill == 1
    # decode: 10 x 200 = 2000 tokens/s; best under ITL 20 ms at context 500 is concurrency 10, 500 tokens/s -> 4
    assert plan.decode_raw == pytest.approx(4.0)
    assert plan.decode == 4
    # aggregated: the same workers' time, 0.4 + 4.0 = 4.4 -> 5
    assert plan.combined == 5
    assert (plan.planning_isl, plan.planning_osl, plan.planning_context) == (400.0, 200.0, 500.0)
    assert plan.ttft_reachable and plan.itl_reachable and not plan.budget_limited


def test_gpus_per_worker_divide_the_per_gpu_throughput_once() -> None:
    # Two-GPU workers of the same per-worker speed: per-GPU throughput halves, the division by 2 restores it.
    plan = plan_replicas(forecast(), hand_profile(gpus_per_worker=2), SLO, config())
    assert (plan.prefill_raw, plan.decode_raw) == (pytest.approx(0.4), pytest.approx(4.0))
    assert (plan.prefill, plan.decode, plan.combined) == (1, 4, 5)


def test_prefill_correction_only_lowers_demand() -> None:
    slower = plan_replicas(forecast(), PROFILE, SLO, config(), CorrectionFactors(prefill=2.0))
    assert slower.prefill_raw == pytest.approx(0.4)  # min(1, 2): queueing is not fixed by more prefill
    faster = plan_replicas(forecast(), PROFILE, SLO, config(), CorrectionFactors(prefill=0.5))
    assert faster.prefill_raw == pytest.approx(0.2)


def test_decode_correction_tightens_the_itl_target() -> None:
    # d_corr 2: plan for 10 ms on the profile; at context 500 only concurrency 1 (100 tokens/s) -> 20 workers.
    plan = plan_replicas(forecast(), PROFILE, SLO, config(), CorrectionFactors(decode=2.0))
    assert plan.itl_target_s == pytest.approx(0.01)
    assert plan.decode_raw == pytest.approx(20.0)
    assert plan.decode == 20
    assert plan.combined == 21  # ceil(0.4 + 20)


def test_minimum_floors_every_count() -> None:
    plan = plan_replicas(forecast(requests_per_s=0.0), PROFILE, SLO, config(min_workers=2))
    assert (plan.prefill, plan.decode, plan.combined) == (2, 2, 2)
    plan = plan_replicas(forecast(requests_per_s=0.0), PROFILE, SLO, config(min_workers=0))
    assert (plan.prefill, plan.decode, plan.combined) == (0, 0, 0)


def test_a_failure_reserve_adds_k_serving_workers_to_every_pool_above_the_minimum() -> None:
    # N+k with k = 2: the SLOs still hold after any two workers are lost, whichever pool they serve in.
    plan = plan_replicas(forecast(), PROFILE, SLO, config(failure_reserve=2))
    assert (plan.prefill, plan.decode, plan.combined) == (1 + 2, 4 + 2, 5 + 2)
    # An idle interval needs no worker: k of them, or the floor where it is more.
    idle = plan_replicas(forecast(requests_per_s=0.0), PROFILE, SLO, config(min_workers=1, failure_reserve=2))
    assert (idle.prefill, idle.decode, idle.combined) == (2, 2, 2)
    # The GPU budget still bounds the whole: N+k beyond it is cut like any plan.
    capped = plan_replicas(forecast(), PROFILE, SLO, config(max_gpus=5, failure_reserve=2))
    assert capped.combined == 5 and capped.budget_limited
    with pytest.raises(ValueError):
        config(failure_reserve=-1)


def test_gpu_budget_scales_both_down_proportionally() -> None:
    # prefill 1 + decode 20 = 21 GPUs over a budget of 10: x 10/21 -> floor(0.48) = 0 -> minimum 1; floor(9.52) = 9.
    plan = plan_replicas(forecast(), PROFILE, SLO, config(max_gpus=10), CorrectionFactors(decode=2.0))
    assert (plan.prefill, plan.decode) == (1, 9)
    assert plan.combined == 10  # ceil(20.4) = 21 -> the 10 the budget allows
    assert plan.budget_limited


def test_gpu_budget_counts_gpus_not_workers() -> None:
    # Two-GPU workers: 1 + 20 workers are 42 GPUs over 20: x 20/42 -> prefill max(1, 0) = 1, decode floor(9.52) = 9.
    plan = plan_replicas(forecast(), hand_profile(2), SLO, config(max_gpus=20), CorrectionFactors(decode=2.0))
    assert (plan.prefill, plan.decode, plan.combined) == (1, 9, 10)
    # 21 GPUs: combined 10 workers (20 GPUs), an odd GPU cannot host a 2-GPU worker.
    assert plan_replicas(forecast(), hand_profile(2), SLO, config(max_gpus=21), CorrectionFactors(decode=2.0)).combined == 10


def test_minimums_win_over_the_budget() -> None:
    # min 6: 6 + 20 = 26 over 10 -> x 0.385: prefill max(6, 2) = 6, decode max(6, 7) = 7: 13 GPUs, the minimums rule.
    plan = plan_replicas(forecast(), PROFILE, SLO, config(max_gpus=10, min_workers=6), CorrectionFactors(decode=2.0))
    assert (plan.prefill, plan.decode, plan.combined) == (6, 7, 10)
    tight = plan_replicas(forecast(), PROFILE, SLO, config(max_gpus=4, min_workers=6), CorrectionFactors(decode=2.0))
    assert tight.combined == 6


def test_within_budget_nothing_changes() -> None:
    plan = plan_replicas(forecast(), PROFILE, SLO, config(max_gpus=5))
    assert (plan.prefill, plan.decode, plan.combined, plan.budget_limited) == (1, 4, 5, False)


def test_from_degradation_level_3_the_plan_targets_doubled_slos() -> None:
    assert plan_replicas(forecast(), PROFILE, SLO, config(), degradation_level=2).decode == 4
    plan = plan_replicas(forecast(), PROFILE, SLO, config(), degradation_level=3)
    # ITL 40 ms at context 500: between 10 (20 ms) and 100 (100 ms) sequences, ITL = 40 ms at 32.5 sequences,
    # 32.5 / 0.04 = 812.5 tokens/s (the search grid lands just below) -> 2000 / 812.5 = 2.46 -> 3.
    assert plan.itl_target_s == pytest.approx(0.04)
    assert plan.ttft_target_s == pytest.approx(1.0)
    assert plan.decode_raw == pytest.approx(2000.0 / 812.5, rel=0.01)
    assert plan.decode == 3
    custom = config(relaxed_slo_level=4, relaxed_slo_factor=3.0)
    assert plan_replicas(forecast(), PROFILE, SLO, custom, degradation_level=3).itl_target_s == pytest.approx(0.02)
    assert plan_replicas(forecast(), PROFILE, SLO, custom, degradation_level=4).itl_target_s == pytest.approx(0.06)


def test_quantile_planning_sizes_decode_for_the_long_outputs_of_a_bimodal_mix() -> None:
    # Mostly short answers and a tail of long ones: the mean is 200 tokens, p90 9200 (context 400 + 4600 = 5000).
    osl = Summary(mean=200.0, quantiles={0.5: 50.0, 0.9: 9200.0})
    by_mean = plan_replicas(forecast(osl=osl), PROFILE, SLO, config(length_quantile=None))
    by_p90 = plan_replicas(forecast(osl=osl), PROFILE, SLO, config(length_quantile=0.9))
    # Same volume (2000 tokens/s) in both; the mean plan reads context 500 (500 tokens/s per worker) -> 4.
    assert by_mean.decode == 4
    # At context 5000 only one sequence stays within 20 ms: 50 tokens/s per worker -> 2000 / 50 = 40.
    assert by_p90.planning_context == 5000.0
    assert by_p90.decode_raw == pytest.approx(40.0)
    assert by_p90.decode == 40


def test_quantile_planning_reads_prefill_throughput_at_the_long_prompts() -> None:
    # 10 req/s, mean prompt 1000 tokens (10000 tokens/s of prefill), p90 10000 tokens.
    isl = Summary(mean=1000.0, quantiles={0.9: 10000.0})
    by_mean = plan_replicas(forecast(isl=isl), PROFILE, SloTargets(ttft_s=5.0, itl_s=0.1), config(length_quantile=None))
    by_p90 = plan_replicas(forecast(isl=isl), PROFILE, SloTargets(ttft_s=5.0, itl_s=0.1), config(length_quantile=0.9))
    assert by_mean.prefill_raw == pytest.approx(1.0)  # 10000 / 10000 per worker
    assert by_p90.prefill_raw == pytest.approx(2.0)  # 10000 / 5000: long prompts prefill at half the rate
    assert (by_mean.prefill, by_p90.prefill) == (1, 2)


def test_planning_length_is_never_below_the_mean() -> None:
    heavy_tail = Summary(mean=1000.0, quantiles={0.9: 500.0})  # a few huge prompts pull the mean above p90
    assert planning_length(heavy_tail, 0.9) == 1000.0
    assert planning_length(heavy_tail, None) == 1000.0
    assert planning_length(Summary(mean=10.0, quantiles={0.5: 5.0, 0.99: 105.0}), 0.9) == pytest.approx(5.0 + 100.0 * 0.4 / 0.49)


def test_unreachable_slos_are_reported_and_the_volume_still_planned() -> None:
    plan = plan_replicas(forecast(), PROFILE, SloTargets(ttft_s=0.01, itl_s=0.005), config())
    assert not plan.ttft_reachable  # a 400-token prompt alone takes 40 ms
    assert not plan.itl_reachable  # even one sequence steps in 10 ms
    assert plan.decode == 20  # planned at the fastest point, 100 tokens/s: 2000 / 100


def test_whole_numbers_are_not_rounded_up_by_float_noise() -> None:
    # 3 workers' worth plus the last-bit error of a few float operations stays 3, not 4.
    plan = plan_replicas(forecast(requests_per_s=7.5 * (1 + 1e-13)), PROFILE, SLO, config())
    assert plan.decode_raw > 3.0
    assert plan.decode == 3
    assert plan_replicas(forecast(requests_per_s=7.5 * (1 + 1e-6)), PROFILE, SLO, config()).decode == 4


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError):
        ReplicaConfig(interval_s=0)
    with pytest.raises(ValueError):
        ReplicaConfig(interval_s=10, max_gpus=0)
    with pytest.raises(ValueError):
        ReplicaConfig(interval_s=10, length_quantile=1.0)


def test_the_capacity_view_is_predicted_need_over_the_serving_fleet() -> None:
    from phalanx.planner.capacity import MAX_PRESSURE, capacity_view

    plan = plan_replicas(forecast(), PROFILE, SLO, config())  # 0.4 + 4.0 = 4.4 worker-equivalents (by hand, above)
    view = capacity_view(plan, serving_workers=2, predicted_requests_per_s=10.0)
    assert view.needed_workers == pytest.approx(4.4)
    assert view.pressure == pytest.approx(2.2)  # 4.4 over 2: health's level 4 territory
    assert capacity_view(plan, serving_workers=8, predicted_requests_per_s=10.0).pressure == pytest.approx(0.55)
    assert capacity_view(plan, serving_workers=0, predicted_requests_per_s=10.0).pressure == MAX_PRESSURE
    idle = plan_replicas(forecast(requests_per_s=0.0), PROFILE, SLO, config())
    assert capacity_view(idle, serving_workers=0, predicted_requests_per_s=0.0).pressure == 0.0
