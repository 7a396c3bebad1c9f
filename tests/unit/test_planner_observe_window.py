"""Which scrapes a tick's observation starts from with `observe_window_s`: the rates a plan reads span at least the window."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import pytest

from phalanx.planner.config import PlannerConfig
from phalanx.planner.observations import Scrape
from phalanx.planner.service import Planner

pytestmark = pytest.mark.unit


def _planner_state(window_s: float, tick_age_s: float, round_ages_s: list[float]) -> SimpleNamespace:
    now = time.monotonic()
    rounds = deque({"router-0": Scrape(at=now - age)} for age in round_ages_s)
    return SimpleNamespace(config=PlannerConfig(observe_window_s=window_s), _tick_scrapes={"router-0": Scrape(at=now - tick_age_s)},
                           _recent_scrapes=rounds)


def _age(scrapes: dict[str, Scrape]) -> float:
    return round(time.monotonic() - scrapes["router-0"].at)


def test_without_a_window_or_with_a_tick_older_than_it_the_observation_starts_at_the_last_tick() -> None:
    assert _age(Planner._window_start(_planner_state(0.0, 2.0, [12.0, 10.0, 8.0]))) == 2  # type: ignore[arg-type]
    assert _age(Planner._window_start(_planner_state(10.0, 15.0, [12.0, 10.0, 8.0]))) == 15  # type: ignore[arg-type]


def test_with_a_window_the_observation_starts_at_the_newest_round_at_least_that_old() -> None:
    assert _age(Planner._window_start(_planner_state(10.0, 2.0, [14.0, 12.0, 11.0, 9.0, 4.0]))) == 11  # type: ignore[arg-type]
    # Up for less than the window: the oldest round kept.
    assert _age(Planner._window_start(_planner_state(10.0, 2.0, [6.0, 4.0]))) == 6  # type: ignore[arg-type]


def test_the_arrivals_after_a_surge_are_counted_from_the_first_round_after_it() -> None:
    from phalanx.planner.observations import ARRIVALS

    now = time.monotonic()
    # Rounds 4, 3, 2, 1 s ago and now, with 10, 12, 13, 13 and 15 arrivals counted so far.
    rounds = deque({"router-0": Scrape(at=now - age, counters={ARRIVALS: count})} for age, count in ((4, 10), (3, 12), (2, 13), (1, 13), (0, 15)))
    state = SimpleNamespace(_recent_scrapes=rounds, _scrapes=rounds[-1])
    # A surge 2.5 s ago: counted from the round 2 s ago, 2 arrivals in 2 s (the 3 that fired it before are not evidence).
    assert Planner._arrivals_since(state, now - 2.5) == pytest.approx((2.0, 2.0))  # type: ignore[arg-type]
    # A surge after the last round but one: no span after it yet.
    assert Planner._arrivals_since(state, now - 0.5) is None  # type: ignore[arg-type]
