"""The soak's trend maths (bench/soak.py) on synthetic series: a flat series with noise has no trend, a leak has one,
and the warm-up's climb is left out."""

import random

import pytest

from phalanx.bench.soak import GOALS, judge, latency_trend_ratio, slope_per_minute

pytestmark = pytest.mark.unit

TIMES = [5.0 * i for i in range(72)]  # 6 minutes, a sample every 5 s


def _noisy(base: float, per_min: float, *, seed: int = 1, noise: float = 3.0) -> list[float]:
    rng = random.Random(seed)
    return [base + per_min * t / 60 + rng.uniform(-noise, noise) for t in TIMES]


def test_a_flat_noisy_series_has_no_trend():
    trend = slope_per_minute(TIMES, _noisy(400, 0.0))
    assert abs(trend["slope_per_min"]) < 1.0 and trend["mean"] == pytest.approx(400, abs=2) and trend["samples"] == 72


def test_a_steady_leak_is_measured_per_minute():
    trend = slope_per_minute(TIMES, _noisy(400, 8.0, noise=1.0))
    assert trend["slope_per_min"] == pytest.approx(8.0, abs=0.3) and trend["r2"] > 0.95


def test_the_warm_up_climb_is_left_out():
    # 1 minute of climbing (imports, caches, the first compiled shapes), flat afterwards.
    values = [min(t, 60.0) * 2 + 300 for t in TIMES]
    assert slope_per_minute(TIMES, values)["slope_per_min"] > GOALS["rss_slope_mib_per_min"]  # the climb alone reads as a leak
    assert slope_per_minute(TIMES, values, after_s=60.0)["slope_per_min"] == pytest.approx(0.0, abs=1e-6)


def test_too_few_samples_give_no_slope():
    assert slope_per_minute([0.0, 5.0, 70.0], [1.0, 2.0, 3.0], after_s=60.0) == {"slope_per_min": None, "r2": None, "mean": 3.0, "samples": 1}
    assert slope_per_minute([], [], after_s=0.0)["mean"] is None


def _trend(rss_slopes: dict[str, float], fds_slope: float = 0.0) -> dict:
    return {k: {"rss_mib": {"slope_per_min": s}, "fds": {"slope_per_min": fds_slope}} for k, s in rss_slopes.items()}


ZERO = {"lost": 0, "repeated": 0, "changed": 0}


def test_judge_meets_every_goal_on_a_steady_run():
    met = judge(_trend({"worker": 0.4, "router": -0.2}), [0.9, 1.0, 1.1, 1.2], first_minute=1, counts=ZERO)
    assert met == {"rss_slope_mib_per_min": True, "fds_slope_per_min": True, "latency_p99_ratio": True, "lost": True,
                   "repeated": True, "changed": True}


def test_judge_flags_the_kind_that_grows_an_fd_leak_slower_latency_and_a_lost_token():
    met = judge(_trend({"worker": 0.4, "router": GOALS["rss_slope_mib_per_min"] + 1}, fds_slope=2.0), [1.0, 1.0, 2.0], first_minute=1,
                counts={**ZERO, "lost": 3})
    assert met["rss_slope_mib_per_min"] is False and met["fds_slope_per_min"] is False
    assert met["latency_p99_ratio"] is False and met["lost"] is False and met["repeated"] is True


def test_judge_has_no_latency_verdict_with_one_minute_after_the_warm_up():
    met = judge(_trend({"worker": 0.0}), [1.0, None], first_minute=0, counts=ZERO)
    assert met["latency_p99_ratio"] is None


def test_the_latency_verdict_reads_the_trend_not_one_busy_minute_at_either_end():
    flat_with_a_busy_last_minute = [1.0] * 14 + [2.0]
    flat_with_a_busy_first_minute = [2.0] + [1.0] * 14
    assert latency_trend_ratio(flat_with_a_busy_last_minute) == pytest.approx(1.39, abs=0.01)  # two minutes: 2.0
    assert latency_trend_ratio(flat_with_a_busy_first_minute) < 1.0  # two minutes: 0.5
    assert judge(_trend({"worker": 0.0}), flat_with_a_busy_last_minute, first_minute=0, counts=ZERO)["latency_p99_ratio"] is True
    growing = [1.0 + 0.05 * minute for minute in range(15)]  # +70 % over the run
    assert latency_trend_ratio(growing) == pytest.approx(1.7)
    assert judge(_trend({"worker": 0.0}), growing, first_minute=0, counts=ZERO)["latency_p99_ratio"] is False
    assert latency_trend_ratio([1.0, None, 1.2]) == pytest.approx(1.2) and latency_trend_ratio([None, 1.0]) is None
