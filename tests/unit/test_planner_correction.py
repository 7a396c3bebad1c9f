"""Correction factors: ratio, clamping, log-space smoothing, a ramp that makes raw factors oscillate, disabling."""

from __future__ import annotations

import math

import pytest

from phalanx.planner.correction import (
    CorrectionConfig,
    CorrectionFactors,
    CorrectionTracker,
    decode_load,
    expected_itl_s,
    expected_ttft_s,
    fleet_concurrency,
)
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile

pytestmark = pytest.mark.unit


def update(tracker: CorrectionTracker, ttft_ratio: float, itl_ratio: float) -> CorrectionFactors:
    return tracker.update(observed_ttft_s=0.1 * ttft_ratio, expected_ttft_s=0.1, observed_itl_s=0.02 * itl_ratio, expected_itl_s=0.02)


def test_unsmoothed_factors_are_the_observed_over_expected_ratio() -> None:
    tracker = CorrectionTracker(CorrectionConfig(smoothing=1.0))
    assert update(tracker, 1.5, 0.8) == CorrectionFactors(prefill=pytest.approx(1.5), decode=pytest.approx(0.8))


def test_factors_start_at_one() -> None:
    assert CorrectionTracker().factors == CorrectionFactors(1.0, 1.0)


def test_factors_are_clamped() -> None:
    tracker = CorrectionTracker(CorrectionConfig(smoothing=1.0, min_factor=0.5, max_factor=3.0))
    assert update(tracker, 50.0, 0.01) == CorrectionFactors(prefill=pytest.approx(3.0), decode=pytest.approx(0.5))


def test_smoothing_moves_part_of_the_way_in_log_space() -> None:
    tracker = CorrectionTracker(CorrectionConfig(smoothing=0.5, max_factor=4.0))
    assert update(tracker, 4.0, 1.0).prefill == pytest.approx(2.0)  # exp(0.5 * log 4)
    assert update(tracker, 4.0, 1.0).prefill == pytest.approx(4.0**0.75)
    assert update(tracker, 0.5, 1.0).prefill == pytest.approx(math.exp(0.5 * math.log(4.0**0.75) + 0.5 * math.log(0.5)))


def test_alternating_doubling_and_halving_centre_on_one() -> None:
    """In log space 2x and 0.5x cancel; a linear average of the ratios would centre on 1.25 and over-provision."""
    tracker = CorrectionTracker(CorrectionConfig(smoothing=0.5))
    factors = [update(tracker, ratio, ratio).prefill for ratio in [2.0, 0.5] * 20]
    assert factors[-1] * factors[-2] == pytest.approx(1.0)
    assert math.prod(factors[-10:]) ** (1 / 10) == pytest.approx(1.0)


def test_one_stalled_interval_moves_the_factor_only_a_little() -> None:
    tracker = CorrectionTracker()  # smoothing 0.3, max 3
    for _ in range(10):
        update(tracker, 1.0, 1.0)
    stalled = update(tracker, 20.0, 20.0)  # a 2 s GC pause: ratio 20, clamped to 3 first
    assert stalled.decode == pytest.approx(3.0**0.3)
    assert stalled.decode < 1.4


def test_quiet_intervals_and_bad_values_leave_the_factors_alone() -> None:
    tracker = CorrectionTracker(CorrectionConfig(smoothing=1.0, min_samples=10))
    update(tracker, 2.0, 1.5)
    before = tracker.factors
    tracker.update(observed_ttft_s=0.5, expected_ttft_s=0.1, observed_itl_s=0.1, expected_itl_s=0.02, ttft_samples=3, itl_samples=9)
    tracker.update(observed_ttft_s=None, expected_ttft_s=0.1, observed_itl_s=math.nan, expected_itl_s=0.02)
    tracker.update(observed_ttft_s=0.1, expected_ttft_s=0.0, observed_itl_s=0.02, expected_itl_s=math.inf)
    assert tracker.factors == before


def test_disabled_correction_is_always_one() -> None:
    tracker = CorrectionTracker(CorrectionConfig(enabled=False))
    assert update(tracker, 2.5, 0.6) == CorrectionFactors(1.0, 1.0)
    assert tracker.factors == CorrectionFactors(1.0, 1.0)


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError, match="min_factor"):
        CorrectionConfig(min_factor=1.5)
    with pytest.raises(ValueError, match="smoothing"):
        CorrectionConfig(smoothing=0.0)
    with pytest.raises(ValueError, match="min_decode_load"):
        CorrectionConfig(min_decode_load=1.5)


def closed_loop(config: CorrectionConfig, steps: int = 30) -> list[float]:
    """A ramp with the planner in the loop. The fleet is truly 1.5x slower than profiled; the planner sizes
    the fleet for the profile's latency times the decode factor, so a factor above the truth over-provisions
    and the next interval's latency comes out low (and vice versa). With a loop gain of -2 (the latency
    ratio moves twice as far as the factor's error, in log terms) the raw factor overshoots further each
    interval. Load ramps up throughout, so each interval's true ratio also drifts up a little."""
    tracker = CorrectionTracker(config)
    factors = []
    for step in range(steps):
        truth = 1.5 * (1.0 + 0.01 * step)  # the ramp: heavier load per worker than last interval
        factor = tracker.factors.decode
        observed_ratio = truth * (truth / factor) ** 2
        tracker.update(observed_ttft_s=None, expected_ttft_s=None, observed_itl_s=0.02 * observed_ratio, expected_itl_s=0.02)
        factors.append(tracker.factors.decode)
    return factors


def direction_changes(values: list[float]) -> int:
    steps = [b - a for a, b in zip(values, values[1:], strict=False) if abs(b - a) > 1e-9]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if (a > 0) != (b > 0))


def test_a_ramp_makes_raw_factors_oscillate_and_smoothed_ones_settle() -> None:
    raw = closed_loop(CorrectionConfig(smoothing=1.0, min_factor=0.2, max_factor=5.0))
    smoothed = closed_loop(CorrectionConfig(smoothing=0.3, min_factor=0.2, max_factor=5.0))
    # Raw: flips direction nearly every interval and swings between the clamps.
    assert direction_changes(raw) >= 20
    assert max(raw[10:]) / min(raw[10:]) > 10.0
    # Smoothed: settles near the truth and then rises with the ramp without flipping.
    assert direction_changes(smoothed[5:]) == 0
    for step in range(10, 30):
        assert smoothed[step] == pytest.approx(1.5 * (1.0 + 0.01 * step), rel=0.05)


def test_expected_latencies_come_from_the_profile_at_the_carried_load() -> None:
    profile = build_profile(
        [PrefillSample(256.0, 0.03), PrefillSample(1024.0, 0.1)],
        [DecodeSample(512.0, k, 0.01 + 0.001 * k) for k in (1.0, 8.0, 32.0)] + [DecodeSample(2048.0, k, 0.02 + 0.002 * k) for k in (1.0, 8.0, 32.0)],
        model="m",
    )
    assert expected_ttft_s(profile, 1024.0) == pytest.approx(0.1)
    # 40 requests/s staying 2 s each over 10 workers: 8 running per worker.
    assert expected_itl_s(profile, fleet_concurrency(request_rate=40.0, request_duration_s=2.0, workers=10), context=512.0) == pytest.approx(0.018)
    # An idle fleet is compared with one sequence, the lightest batch measured.
    assert expected_itl_s(profile, 0.0, context=512.0) == pytest.approx(0.011)


def batch_growing_profile():
    """The planner bench's worker: ITL 150 ms + 75 ms per running sequence."""
    return build_profile(
        [PrefillSample(64.0, 0.05)], [DecodeSample(64.0, k, 0.15 + 0.075 * k) for k in (1.0, 2.0, 4.0, 8.0, 16.0)], model="m",
    )


def itl_tokens_see(profile, mean_concurrency: float) -> float:
    """The mean ITL over the tokens of workers that step exactly as profiled, with a Poisson number of sequences running
    (requests arriving at random): a step of c sequences is c gaps of ITL(c), so busy moments give more of the gaps."""
    pmf, gaps_per_s = math.exp(-mean_concurrency), 0.0
    for c in range(1, 200):
        pmf *= mean_concurrency / c
        gaps_per_s += pmf * c / profile.decode_itl(64.0, c)
    return mean_concurrency / gaps_per_s


def test_a_fleet_that_steps_as_profiled_looks_slow_at_low_load_and_that_does_not_move_the_decode_factor() -> None:
    profile = batch_growing_profile()
    operating = profile.best_decode(0.48, 64.0).concurrency
    assert operating == pytest.approx(4.4, abs=0.05)
    tracker = CorrectionTracker(CorrectionConfig(smoothing=1.0))
    for mean in (0.5, 1.0, 2.0):
        expected = expected_itl_s(profile, mean, context=64.0)
        observed = itl_tokens_see(profile, mean)
        if mean == 1.0:
            assert observed / expected > 1.2  # the artefact: no engine is slower here
        tracker.update(observed_ttft_s=None, expected_ttft_s=None, observed_itl_s=observed, expected_itl_s=expected,
                       decode_load=decode_load(profile, mean, itl_target_s=0.48, context=64.0))
    assert tracker.factors.decode == 1.0
    # Near the operating point the ratio is what tokens will see at the planned load, and it is learnt.
    expected = expected_itl_s(profile, operating, context=64.0)
    observed = 1.5 * itl_tokens_see(profile, operating)  # a fleet truly 1.5x slower than profiled
    tracker.update(observed_ttft_s=None, expected_ttft_s=None, observed_itl_s=observed, expected_itl_s=expected,
                   decode_load=decode_load(profile, operating, itl_target_s=0.48, context=64.0))
    assert tracker.factors.decode == pytest.approx(1.5 * 1.06, rel=0.02)
    # min_decode_load 0: every interval moves it (Dynamo's rule).
    every = CorrectionTracker(CorrectionConfig(smoothing=1.0, min_decode_load=0.0))
    every.update(observed_ttft_s=None, expected_ttft_s=None, observed_itl_s=itl_tokens_see(profile, 1.0),
                 expected_itl_s=expected_itl_s(profile, 1.0, context=64.0),
                 decode_load=decode_load(profile, 1.0, itl_target_s=0.48, context=64.0))
    assert every.factors.decode > 1.2
