"""`scale_down_confidence`: a tick scales down no further than the workers for the upper Poisson bound of what it observed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from scipy.stats import poisson

from phalanx.planner.config import PlannerConfig
from phalanx.planner.decisions import Arrivals, floor_rate, poisson_upper_bound
from phalanx.planner.observations import Observation
from phalanx.planner.service import Planner

pytestmark = pytest.mark.unit


def _planner(confidence: float, operator_target: int | None = None, recent: dict[float, float] | None = None) -> SimpleNamespace:
    """Half a request/s per worker; `recent`: arrivals over the longer windows (seconds: count), none by default."""
    def recent_arrivals(window: float) -> Arrivals | None:
        count = (recent or {}).get(window)
        return None if count is None else Arrivals(requests=count, rate=count / window, workers=0)

    return SimpleNamespace(config=PlannerConfig(scale_down_confidence=confidence, max_workers=16, observe_window_s=10),
                           _operator_target=operator_target, _replan=lambda rate: math.ceil(rate / 0.5), _degradation_level=0,
                           _recent_arrivals=recent_arrivals)


def _window(arrivals: int, seconds: float = 10.0) -> Observation:
    return Observation(interval_s=seconds, requests=arrivals, request_rate=arrivals / seconds, ttft=None, itl=None, isl=None, osl=None,
                       arrival_rate=arrivals / seconds)


def test_the_upper_bound_is_the_chi_square_one_and_where_a_count_stops_being_a_fall_beyond_noise() -> None:
    # scipy.stats.chi2.ppf(confidence, 2 k + 2) / 2.
    assert poisson_upper_bound(11, 0.95) == pytest.approx(18.2075, abs=1e-3)
    assert poisson_upper_bound(30, 0.8) == pytest.approx(35.5627, abs=1e-3)
    assert poisson_upper_bound(0, 0.95) == pytest.approx(-math.log(0.05), rel=1e-6)  # P(X = 0) = e^-mean
    assert poisson_upper_bound(7, 0.0) == 7.0
    # Above the bound, as few arrivals had less than 1 - confidence chance (a fall beyond noise); below it, more.
    for count in (0, 3, 12, 40):
        bound = poisson_upper_bound(count, 0.9)
        assert poisson.cdf(count, bound * 1.001) < 0.1 <= poisson.cdf(count, bound * 0.999)


def test_a_dip_within_the_noise_of_a_burst_keeps_its_workers_and_a_real_fall_does_not() -> None:
    planner = _planner(0.8)
    # A burst of 3.5 requests/s seen as 30 in 10 s (its plan: 6 workers): the bound 35.6 -> 3.56/s, 8 workers' worth.
    assert Planner._scale_down_floor(planner, _window(30)) == 8  # type: ignore[arg-type]
    # After it, 11 in 10 s: the bound 14.8 -> 1.48/s, 3 workers (the plan's 1.1/s: also 3).
    assert Planner._scale_down_floor(planner, _window(11)) == 3  # type: ignore[arg-type]
    # Nothing for 10 s: 1.6/10 s -> one worker.
    assert Planner._scale_down_floor(planner, _window(0)) == 1  # type: ignore[arg-type]


def test_without_a_confidence_or_with_an_operators_target_there_is_no_floor() -> None:
    assert Planner._scale_down_floor(_planner(0.0), _window(30)) == 0  # type: ignore[arg-type]
    assert Planner._scale_down_floor(_planner(0.8, operator_target=2), _window(30)) == 0  # type: ignore[arg-type]


def test_the_floor_rate_tightens_with_longer_windows_only_while_the_shorter_ones_are_within_their_noise() -> None:
    # A steady 1.2 requests/s: 30 s bound the rate closer than 10 s.
    steady = [(12.0, 10.0), (24.0, 20.0), (36.0, 30.0)]
    assert floor_rate(steady[:1], 0.8) == pytest.approx(poisson_upper_bound(12, 0.8) / 10)
    assert floor_rate(steady, 0.8) == pytest.approx(poisson_upper_bound(36, 0.8) / 30)
    assert floor_rate(steady, 0.8) < 1.2 * 1.2 < floor_rate(steady[:1], 0.8)
    # A burst that ended 10 s ago: the last 10 s fell beyond the noise of 20 s's rate; their own bound stands.
    assert floor_rate([(12.0, 10.0), (60.0, 20.0), (90.0, 30.0)], 0.8) == pytest.approx(poisson_upper_bound(12, 0.8) / 10)
    # A burst that began: a rise beyond noise ends the search as well (and a longer window never raises the bound).
    assert floor_rate([(36.0, 10.0), (48.0, 20.0), (60.0, 30.0)], 0.8) == pytest.approx(poisson_upper_bound(36, 0.8) / 10)
    # The 20 s window agrees with the 10 s one, the 30 s one does not (the 20 s before a quiet start).
    windows = [(12.0, 10.0), (26.0, 20.0), (70.0, 30.0)]
    assert floor_rate(windows, 0.8) == pytest.approx(poisson_upper_bound(26, 0.8) / 20)


def test_a_steady_rate_seen_over_30_s_sheds_the_worker_10_s_of_noise_kept() -> None:
    # 1.2 requests/s: 12 in 10 s allow 1.58/s (4 workers), 36 in 30 s only 1.40/s (3 workers, what 1.2/s needs).
    assert Planner._scale_down_floor(_planner(0.8), _window(12)) == 4  # type: ignore[arg-type]
    assert Planner._scale_down_floor(_planner(0.8, recent={20.0: 24, 30.0: 36}), _window(12)) == 3  # type: ignore[arg-type]
    # While the routers shed, demand is not the arrivals alone: the observed interval's bound stands.
    shedding = _planner(0.8, recent={20.0: 24, 30.0: 36})
    shedding._degradation_level = 2
    assert Planner._scale_down_floor(shedding, _window(12)) == 4  # type: ignore[arg-type]
