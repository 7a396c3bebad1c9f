"""Load predictors on synthetic series (trend, seasonality, bursts, leading zeros, NaN), their safety rules,
warm start and the trace format."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from phalanx.planner.errors import TraceError
from phalanx.planner.predictors import (
    PREDICTOR_KINDS,
    ArimaPredictor,
    KalmanPredictor,
    PredictorConfig,
    ProphetPredictor,
    TraceInterval,
    _SafePredictor,
    load_trace,
    make_predictor,
    parse_trace,
    save_trace,
    warm_start,
)

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(7)
STEPS = np.arange(48)
TREND = 10.0 + 3.0 * STEPS + RNG.normal(0.0, 1.0, STEPS.size)
SEASON = 100.0 + 40.0 * np.sin(2 * np.pi * STEPS / 12) + RNG.normal(0.0, 2.0, STEPS.size)
BURST = np.where((STEPS >= 30) & (STEPS < 40), 300.0, 100.0) + RNG.normal(0.0, 3.0, STEPS.size)


def one_step_errors(kind: str, series: np.ndarray, start: int = 16, config: PredictorConfig | None = None) -> tuple[np.ndarray, list[float]]:
    """Absolute one-step-ahead errors from `start` on, and every prediction made."""
    predictor = make_predictor(kind, config)  # type: ignore[arg-type]
    errors, predictions = [], []
    for i, value in enumerate(series):
        if i >= start:
            predicted = predictor.predict_next()
            predictions.append(predicted)
            errors.append(abs(predicted - value))
        predictor.observe(float(value))
    return np.asarray(errors), predictions


def test_unknown_predictor_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="constant, arima, kalman, prophet"):
        make_predictor("lstm")  # type: ignore[arg-type]


def test_constant_predicts_the_last_observation() -> None:
    predictor = warm_start(make_predictor("constant"), [5.0, 7.0, 9.0, 11.0, 13.0, 4.0])
    assert predictor.predict_next() == 4.0


@pytest.mark.parametrize("kind", ["arima", "kalman"])
def test_trend_models_follow_a_linear_trend_that_constant_lags(kind: str) -> None:
    constant, _ = one_step_errors("constant", TREND)
    model, _ = one_step_errors(kind, TREND)
    # The constant predictor is one step (3 requests) behind; a trend model sees the slope.
    assert constant.mean() > 2.5
    assert model.mean() < 0.5 * constant.mean()


def test_arima_follows_a_seasonal_cycle_better_than_constant() -> None:
    constant, _ = one_step_errors("constant", SEASON)
    arima, _ = one_step_errors("arima", SEASON)
    assert arima.mean() < 0.6 * constant.mean()


@pytest.mark.parametrize("kind", ["constant", "arima", "kalman"])
def test_a_burst_is_caught_within_a_few_intervals_and_released_after(kind: str) -> None:
    _, predictions = one_step_errors(kind, BURST, start=16)
    at = {16 + i: p for i, p in enumerate(predictions)}
    # Nobody foresees the step at 30; within three intervals every model predicts the new level (within 15 %) ...
    assert all(abs(at[step] - 300.0) < 45.0 for step in range(33, 40)), [round(at[s]) for s in range(30, 40)]
    # ... and three intervals after it ends, predictions are back near 100 (a trend model may dip a little).
    assert all(abs(at[step] - 100.0) < 40.0 for step in range(43, 48)), [round(at[s]) for s in range(40, 48)]
    assert min(predictions) >= 0.0


@pytest.mark.parametrize("kind", PREDICTOR_KINDS)
def test_leading_zeros_are_skipped(kind: str) -> None:
    predictor = make_predictor(kind)
    for _ in range(20):
        predictor.observe(0.0)
    assert predictor.predict_next() == 0.0
    for value in (50.0, 52.0, 54.0):
        predictor.observe(value)
    # Still warming up on the three non-zero values: the twenty zeros did not count towards the warm-up.
    assert predictor.predict_next() == 54.0


@pytest.mark.parametrize("kind", ["constant", "arima", "kalman"])
def test_nan_inf_and_negative_observations_are_ignored(kind: str) -> None:
    clean = make_predictor(kind)
    dirty = make_predictor(kind)
    for value in TREND[:24]:
        clean.observe(float(value))
        dirty.observe(float(value))
        dirty.observe(math.nan)
        dirty.observe(math.inf)
        dirty.observe(-5.0)
    assert dirty.predict_next() == pytest.approx(clean.predict_next())
    assert math.isfinite(dirty.predict_next())


def test_a_zero_after_traffic_started_is_kept_as_real_idleness() -> None:
    predictor = warm_start(make_predictor("constant"), [0.0, 10.0, 0.0])
    assert predictor.predict_next() == 0.0


def test_constant_during_warm_up() -> None:
    config = PredictorConfig(warmup_points=6, arima_min_points=6)
    for kind in ("arima", "kalman"):
        predictor = warm_start(make_predictor(kind, config), [10.0, 20.0, 30.0, 40.0, 50.0])  # type: ignore[arg-type]
        assert predictor.predict_next() == 50.0, kind
        predictor.observe(60.0)
        assert predictor.predict_next() > 60.0, kind  # warmed up: the trend shows


@pytest.mark.parametrize("kind", ["arima", "kalman"])
def test_predictions_are_never_negative_on_a_falling_series(kind: str) -> None:
    falling = [100.0 - 9.0 * i + (1.0 if i % 2 else -1.0) for i in range(12)]  # 99, 92, ... 2: falling fast
    predictor = warm_start(make_predictor(kind), falling)
    assert predictor.predict_next() == 0.0


def test_arima_that_fails_to_fit_falls_back_to_the_last_value() -> None:
    # An order that cannot be estimated from the window: statsmodels raises, the predictor answers constant.
    predictor = ArimaPredictor(PredictorConfig(window=8, warmup_points=8, arima_min_points=8, arima_order=(9, 2, 9)))
    warm_start(predictor, [3.0, 5.0, 4.0, 6.0, 5.0, 7.0, 6.0, 8.0])
    assert predictor.predict_next() == 8.0
    assert predictor.fallbacks == 1


def test_arima_refits_every_refit_every_observations_and_on_surprise() -> None:
    predictor = warm_start(ArimaPredictor(PredictorConfig(refit_every=10)), BURST[:20])
    predictor.predict_next()
    predictor.predict_next()
    assert predictor.fits == 1  # one fit for the whole warm start; asking again does not refit
    for value in BURST[20:29]:
        predictor.observe(float(value))
        predictor.predict_next()
    assert predictor.fits == 1  # nine calm observations reuse the parameters
    predictor.observe(float(BURST[29]))
    predictor.predict_next()
    assert predictor.fits == 2  # the tenth refits
    predictor.observe(300.0)  # far outside the forecast band: refit at once rather than ten observations on
    predictor.predict_next()
    assert predictor.fits == 3


def test_arima_waits_for_enough_points_and_skips_fitting_a_degenerate_window() -> None:
    short = warm_start(ArimaPredictor(), [5.0, 9.0, 7.0, 11.0, 9.0, 13.0])  # past warm-up, short of arima_min_points
    assert short.predict_next() == 13.0
    assert short.fits == 0
    linear = warm_start(ArimaPredictor(), [3.0 * i + 1.0 for i in range(1, 15)])  # a line: nothing to estimate
    assert linear.predict_next() == pytest.approx(46.0)
    assert linear.fits == 0


def test_kalman_noise_is_scaled_to_the_series() -> None:
    # The same shape at two scales gives the same relative prediction: noise variances come from the data.
    small = warm_start(KalmanPredictor(), SEASON[:30] / 100.0)
    large = warm_start(KalmanPredictor(), SEASON[:30] * 100.0)
    assert small.predict_next() * 10_000.0 == pytest.approx(large.predict_next(), rel=1e-6)


def test_window_bounds_the_history() -> None:
    predictor = KalmanPredictor(PredictorConfig(window=10))
    warm_start(predictor, range(1, 50))
    assert predictor.history == [float(v) for v in range(40, 50)]


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError):
        PredictorConfig(warmup_points=0)
    with pytest.raises(ValueError):
        PredictorConfig(window=4, warmup_points=5)


def test_prophet_follows_a_trend() -> None:
    """Prophet installs here (wheel with a bundled cmdstan); fits cost ~0.3 s, so one short series."""
    predictor = ProphetPredictor(PredictorConfig(refit_every=50))
    warm_start(predictor, TREND[:30])
    assert predictor.predict_next() == pytest.approx(10.0 + 3.0 * 30, abs=4.0)
    assert predictor.fits == 1


def test_warm_start_from_a_trace_file(tmp_path: Path) -> None:
    trace = [TraceInterval(timestamp=60.0 * i, requests=float(v), isl=512.0, osl=128.0) for i, v in enumerate(TREND[:20])]
    path = tmp_path / "trace.jsonl"
    save_trace(path, trace)
    predictor = warm_start(make_predictor("kalman"), (row.requests for row in load_trace(path)))
    assert predictor.predict_next() == pytest.approx(10.0 + 3.0 * 20, abs=4.0)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_trace_round_trips(tmp_path: Path, suffix: str) -> None:
    trace = [TraceInterval(timestamp=1.5 * i, requests=3.0 + i, isl=100.25 * i, osl=7.0) for i in range(5)]
    path = tmp_path / f"trace{suffix}"
    save_trace(path, trace)
    assert load_trace(path) == trace


def test_trace_parser_skips_comments_and_blank_lines() -> None:
    text = "# a recorded day\n\ntimestamp,requests,isl,osl\n0,5,100,20\n# pause\n10,6,110,21\n"
    assert [row.requests for row in parse_trace(text, fmt="csv")] == [5.0, 6.0]
    jsonl = '# header\n{"timestamp": 0, "requests": 1, "isl": 2, "osl": 3}\n\n'
    assert parse_trace(jsonl, fmt="jsonl") == [TraceInterval(0.0, 1.0, 2.0, 3.0)]


@pytest.mark.parametrize(
    ("text", "fmt", "message"),
    [
        ('{"timestamp": 0, "requests": 1, "isl": 2}\n', "jsonl", "t.jsonl:1: missing osl"),
        ("not json\n", "jsonl", "t.jsonl:1: not JSON"),
        ("[1, 2]\n", "jsonl", "expected an object"),
        ('{"timestamp": 0, "requests": -1, "isl": 2, "osl": 3}\n', "jsonl", "must be finite and >= 0"),
        ('{"timestamp": 0, "requests": "many", "isl": 2, "osl": 3}\n', "jsonl", "t.jsonl:1: could not convert"),
        ('{"timestamp": 5, "requests": 1, "isl": 2, "osl": 3}\n{"timestamp": 5, "requests": 1, "isl": 2, "osl": 3}\n', "jsonl", "must increase"),
        ("time,requests,isl,osl\n0,1,2,3\n", "csv", "header must name"),
        ("timestamp,requests,isl,osl\n0,1,2,\n", "csv", "t.jsonl:row 2: missing osl"),
    ],
)
def test_bad_traces_are_refused_with_where_and_what(text: str, fmt: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(text, fmt=fmt, source="t.jsonl")  # type: ignore[arg-type]


class AlwaysHigh(_SafePredictor):
    """A model that is always 50 too high: what the guard exists for."""

    def _model_forecast(self, values: np.ndarray, steps: int) -> list[float] | None:
        return [float(values[-1]) + 50.0 * k for k in range(1, steps + 1)]


def test_a_model_worse_than_constant_yields_to_it_until_it_does_better() -> None:
    guarded = AlwaysHigh(PredictorConfig(guard_window=4))
    unguarded = AlwaysHigh(PredictorConfig(guard_window=0))
    series = [100.0, 101.0, 99.0, 100.0, 102.0, 101.0, 100.0, 99.0, 100.0, 101.0, 100.0, 100.0]
    predictions = []
    for value in series:
        predictions.append((guarded.predict_next(), unguarded.predict_next()))
        guarded.observe(value)
        unguarded.observe(value)
    # Warm-up (5 points), then 4 model predictions to judge by, all worse than constant; from then on, constant.
    assert [g for g, _ in predictions[5:9]] == [u for _, u in predictions[5:9]] == [v + 50.0 for v in series[4:8]]
    assert [g for g, _ in predictions[9:]] == series[8:11]
    assert [u for _, u in predictions[9:]] == [v + 50.0 for v in series[8:11]]
    assert guarded.guarded == 3


def test_arima_does_not_zig_zag_after_a_burst_leaves_its_window() -> None:
    # A burst, then a slow smooth decline: parameters fitted across the burst oscillate; the guard keeps
    # predictions within a few percent of the smooth series.
    series = [100.0 + i for i in range(20)] + [400.0] * 4 + [120.0 - 0.5 * i for i in range(30)]
    predictor = make_predictor("arima")
    errors = []
    for i, value in enumerate(series):
        if i >= 34:
            errors.append(abs(predictor.predict_next() - value))
        else:
            predictor.predict_next()
        predictor.observe(value)
    assert max(errors) < 6.0, [round(e, 1) for e in errors]


@pytest.mark.parametrize("kind", ["arima", "kalman"])
def test_looking_further_ahead_on_a_rise_asks_for_the_later_higher_forecast(kind: str) -> None:
    predictor = make_predictor(kind)  # type: ignore[arg-type]
    for i in range(30):
        predictor.observe(100.0 + 10.0 * i)  # next: 400, then 410, 420
    assert predictor.predict_next() == pytest.approx(400.0, rel=0.02)
    assert predictor.predict_peak(3) == pytest.approx(420.0, rel=0.02)
    assert predictor.predict_peak(1.5) == pytest.approx(405.0, rel=0.02)  # half-way into the interval after the next
    assert predictor.predict_peak(1) == predictor.predict_peak(0.2) == predictor.predict_next()


@pytest.mark.parametrize("kind", ["constant", "arima", "kalman"])
def test_on_a_fall_the_peak_ahead_is_the_next_interval(kind: str) -> None:
    predictor = make_predictor(kind)  # type: ignore[arg-type]
    for i in range(30):
        predictor.observe(400.0 - 10.0 * i)
    assert predictor.predict_peak(4) == predictor.predict_peak(2.5) == predictor.predict_next()


def test_the_peak_ahead_keeps_the_safety_rules() -> None:
    warming = make_predictor("kalman")
    for value in (10.0, 20.0, 30.0):
        warming.observe(value)
    assert warming.predict_peak(5) == 30.0  # warming up: the last value, however far ahead
    guarded = AlwaysHigh(PredictorConfig(guard_window=2))
    for value in [100.0] * 8:
        guarded.predict_next()
        guarded.predict_peak(3)
        guarded.observe(value)
    # Judged from the 8th interval on (5 warming, 2 to judge by): counted once an interval, however often it is asked.
    assert guarded.predict_peak(3) == 100.0 and guarded.guarded == 2
    assert AlwaysHigh(PredictorConfig(guard_window=0)).predict_peak(3) == 0.0  # nothing observed
