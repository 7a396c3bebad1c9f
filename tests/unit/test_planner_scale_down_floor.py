"""`scale_down_confidence`: a tick scales down no further than the workers for the upper Poisson bound of what it observed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from scipy.stats import poisson

from phalanx.planner.config import PlannerConfig
from phalanx.planner.decisions import poisson_upper_bound
from phalanx.planner.observations import Observation
from phalanx.planner.service import Planner

pytestmark = pytest.mark.unit


def _planner(confidence: float, operator_target: int | None = None) -> SimpleNamespace:
    # Half a request/s per worker.
    return SimpleNamespace(config=PlannerConfig(scale_down_confidence=confidence, max_workers=16), _operator_target=operator_target,
                           _replan=lambda rate: math.ceil(rate / 0.5), _degradation_level=0)


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
