"""Load predictors: what the next interval's requests (or ISL, or OSL) will be. Pure, no I/O but the trace loader.

Every predictor follows Dynamo's safety rules, enforced once in `_SafePredictor`:

- observations that are NaN, infinite or negative are ignored (a failed scrape is no load reading);
- leading zeros are skipped: an idle stretch before traffic starts would drag a trend model towards zero
  (a zero after the first non-zero value is real idleness and is kept);
- while warming up (fewer than `warmup_points` observations) the prediction is the last value: no model
  fits three points;
- a model that fails to fit, or predicts NaN, falls back to the last value, and no prediction is negative;
- a model that has recently done worse than the constant predictor yields to it: when its one-step errors
  over the last `guard_window` intervals add up to more than the constant predictor's, the prediction is
  the last value until the model's own (still computed) predictions beat it again. Parameters fitted on a
  window holding a burst can make ARIMA zig-zag for a whole window afterwards; the planner should not
  scale the fleet up and down with it.

Models (`make_predictor`):

- constant: next = last. The baseline, and what every other model falls back to.
- arima: statsmodels ARIMA (default order (2,1,0) with drift: an AR(2) on the differences follows both a
  trend and a sinusoidal cycle; an MA term made fits 5-10x slower here for no better forecasts on these
  shapes). The maximum-likelihood fit costs ~0.1 s, so it runs every `refit_every`
  observations (warm-started from the previous parameters); in between, the fitted parameters are
  re-applied to the current window (a Kalman filter pass, milliseconds).
- kalman: a local-linear-trend Kalman filter (filterpy): state (level, slope), next = level + slope. Its
  noise variances are set from the warm-up window (measurement noise from the spread of first differences,
  process noise a configurable fraction of it), so one configuration works for requests (tens) and ISL
  (thousands) alike.
- prophet: Meta's Prophet (installs here with a bundled cmdstan), refit every `refit_every` observations
  on the window; optional extra seasonality with a period in intervals. The slowest (0.3 s a fit).

Looking further ahead (`predict_peak(intervals)`): the highest of the model's forecasts up to `intervals` ahead, from
each model's own multi-step forecast (ARIMA's, the Kalman state's level + k * slope, Prophet's next dates; the constant's
is flat). The planner uses it to size the fleet for the intervals its workers take to become routable (lead time,
docs/planner.md). The same rules hold: a warming, failed or guarded model's path is flat at the last value.

Warm start: feed past values (`warm_start`) or a trace file (`load_trace`) before the first live interval,
so the model does not start cold.

Trace format, one row per planner interval: `timestamp` (seconds, any epoch, increasing), `requests`
(requests that arrived in the interval), `isl` and `osl` (mean input and output tokens of those
requests). As JSON lines, one object per line with those keys; or as CSV with that header row. Empty lines
and lines starting with `#` are skipped.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from phalanx.planner.errors import TraceError

PredictorKind = Literal["constant", "arima", "kalman", "prophet"]
PREDICTOR_KINDS: tuple[PredictorKind, ...] = ("constant", "arima", "kalman", "prophet")


class Predictor(Protocol):
    """Observes one value per interval and predicts the next interval's value, or the highest up to some intervals ahead."""

    def observe(self, value: float) -> None: ...

    def predict_next(self) -> float: ...

    def predict_peak(self, intervals: float) -> float: ...


@dataclass(frozen=True)
class PredictorConfig:
    """Knobs shared by the models; defaults suit a 10-60 s planner interval."""

    # Fewer usable observations than this: predict the last one.
    warmup_points: int = 5
    # Observations a model sees (older ones are dropped): bounds fit cost and lets the model forget old regimes.
    window: int = 128
    # ARIMA and Prophet refit every this many observations; between refits they reuse their parameters.
    refit_every: int = 10
    arima_order: tuple[int, int, int] = (2, 1, 0)
    # ARIMA fits from this many points on (constant before): maximum likelihood on five points is
    # ill-posed and took seconds here; bounded iterations keep any one fit cheap.
    arima_min_points: int = 10
    arima_max_iterations: int = 50
    # Kalman process noise as a fraction of the measurement noise: larger follows changes faster, smoother when smaller.
    kalman_level_noise: float = 1.0
    kalman_slope_noise: float = 0.01
    # ARIMA refits early when an observation lands this many residual standard deviations from its forecast:
    # parameters fitted on a calm window read the start of a burst as noise.
    arima_surprise_sigmas: float = 4.0
    # Prophet: an extra seasonality with this period in intervals (a compressed diurnal cycle, say); None: trend only.
    prophet_period_points: int | None = None
    # Guard: when the model's one-step errors over the last this many intervals add up to more than the
    # constant predictor's would have, predict constant until the model does better again (0: no guard).
    guard_window: int = 8

    def __post_init__(self) -> None:
        if self.warmup_points < 1 or self.window < max(self.warmup_points, 3) or self.refit_every < 1:
            raise ValueError("warmup_points >= 1, window >= max(warmup_points, 3) and refit_every >= 1 are required")


class _SafePredictor:
    """The safety rules of the module docstring; subclasses implement `_model_forecast` over the accepted window."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self._values: deque[float] = deque(maxlen=self.config.window)
        # Accepted observations since the model last fitted (ARIMA, Prophet) or ever (Kalman).
        self._observed = 0
        self._accepted = 0
        # Predictions may be asked for more than once per interval (metrics, status): the model runs once per observation
        # (and again only to look further ahead). (accepted count, path, whether the path is flat whatever its length)
        self._cached: tuple[int, list[float], bool] | None = None
        # (model error, constant error) of the intervals whose prediction was asked for, for the guard.
        self._errors: deque[tuple[float, float]] = deque(maxlen=max(self.config.guard_window, 1))
        self._model_prediction: tuple[int, float] | None = None
        self.fallbacks = 0
        self.guarded = 0

    @property
    def history(self) -> list[float]:
        """The accepted observations in the window, oldest first."""
        return list(self._values)

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        if value == 0 and not self._values:
            return
        if self._model_prediction is not None and self._model_prediction[0] == self._accepted:
            self._errors.append((abs(self._model_prediction[1] - value), abs(self._values[-1] - value)))
        self._values.append(float(value))
        self._observed += 1
        self._accepted += 1
        self._on_observation(float(value))

    def predict_next(self) -> float:
        return self._path(1)[0]

    def predict_peak(self, intervals: float) -> float:
        """The highest forecast from the next interval to `intervals` ahead (at least 1), the last fraction of an interval
        interpolated: 1.25 is the next interval's and a quarter of the way to the one after."""
        intervals = max(1.0, intervals)
        whole = math.floor(intervals)
        path = self._path(math.ceil(intervals))
        path += [path[-1]] * (math.ceil(intervals) - len(path))  # a flat path, shorter than asked
        peak = max(path[:whole])
        if intervals > whole:
            peak = max(peak, path[whole - 1] + (intervals - whole) * (path[whole] - path[whole - 1]))
        return peak

    def _path(self, steps: int) -> list[float]:
        """Forecasts of the next `steps` intervals (fewer: flat at the last value), with the module's safety rules."""
        if not self._values:
            return [0.0]
        last = self._values[-1]
        if len(self._values) < self.config.warmup_points:
            return [last]
        cached = self._cached
        if cached is not None and cached[0] == self._accepted and (len(cached[1]) >= steps or cached[2]):
            return cached[1][:steps]
        path = self._model_forecast(np.asarray(self._values, dtype=np.float64), steps)
        fresh = cached is None or cached[0] != self._accepted  # count a fallback once per interval, however far it looks
        if not path or not all(math.isfinite(v) for v in path):
            self.fallbacks += fresh
            path, flat = [last], True
        else:
            flat = steps > 1 and len(path) == 1
        self._model_prediction = (self._accepted, path[0])
        if self._worse_than_constant():
            self.guarded += fresh
            path, flat = [last], True
        result = [max(0.0, v) for v in path]
        self._cached = (self._accepted, result, flat)
        return result

    def _worse_than_constant(self) -> bool:
        if self.config.guard_window == 0 or len(self._errors) < self.config.guard_window:
            return False
        return sum(model for model, _ in self._errors) > sum(constant for _, constant in self._errors)

    def _on_observation(self, value: float) -> None:
        """Hook for models that update incrementally (Kalman)."""

    def _model_forecast(self, values: np.ndarray, steps: int) -> list[float] | None:
        """The model's forecasts of the next `steps` intervals (a single value: flat from there); None: it failed."""
        raise NotImplementedError


class ConstantPredictor(_SafePredictor):
    """Next interval = this interval: no model, never wrong about the level for long, always late on changes."""

    def _model_forecast(self, values: np.ndarray, steps: int) -> list[float] | None:
        return [float(values[-1])]


class ArimaPredictor(_SafePredictor):
    """statsmodels ARIMA, refit every `refit_every` observations (see the module docstring)."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        super().__init__(config)
        self._results: Any = None
        self._last_forecast: float | None = None  # the one-step forecast of the latest observation, for `_surprised`
        self._forecast_at = -1  # the accepted count `_last_forecast` was made at
        self.fits = 0

    def _surprised(self, latest: float) -> bool:
        if self._results is None or self._last_forecast is None:
            return False
        sigma = math.sqrt(max(float(self._results.params[-1]), 0.0))  # sigma2, the innovation variance, is the last parameter
        return abs(latest - self._last_forecast) > self.config.arima_surprise_sigmas * max(sigma, 1e-9)

    def _model_forecast(self, values: np.ndarray, steps: int) -> list[float] | None:
        # Asked again in the same interval (to look further ahead): the same parameters, and no surprise check against a
        # forecast that is already the next interval's.
        again = self._forecast_at == self._accepted
        path = self._forecast(values, steps, may_refit=not again)
        if not again:
            self._last_forecast, self._forecast_at = (path[0] if path else None), self._accepted
        return path

    def _forecast(self, values: np.ndarray, steps: int, *, may_refit: bool) -> list[float] | None:
        if values.size < self.config.arima_min_points:
            return [float(values[-1])]
        diffs = np.diff(values)
        if np.ptp(diffs) <= 1e-9 * max(float(np.max(np.abs(values))), 1.0):
            # An exactly flat or linear window: the likelihood is degenerate (zero innovation variance) and the
            # optimiser crawls; the forecast is the line itself.
            self._results = None
            return [float(values[-1] + k * diffs[-1]) for k in range(1, steps + 1)]
        from statsmodels.tsa.arima.model import ARIMA
        from threadpoolctl import threadpool_limits

        # The matrices are tiny: OpenBLAS threads only contend (a 20-point fit took 0.9 s with its default
        # threads on a busy 2-core box, 0.03 s with one).
        with warnings.catch_warnings(), threadpool_limits(limits=1, user_api="blas"):
            # Convergence and starting-parameter warnings on short or flat windows: the forecast is checked below anyway.
            warnings.simplefilter("ignore")
            try:
                refit = may_refit and (self._observed >= self.config.refit_every or self._surprised(float(values[-1])))
                if self._results is None or refit:
                    start = self._results.params if self._results is not None else None
                    model = ARIMA(values, order=self.config.arima_order, trend="t" if self.config.arima_order[1] >= 1 else "c")
                    # No standard errors needed: cov_type none skips a numerical Hessian, the costliest part.
                    self._results = model.fit(start_params=start, cov_type="none", method_kwargs={"maxiter": self.config.arima_max_iterations})
                    self._observed = 0
                    self.fits += 1
                    results = self._results
                else:
                    results = self._results.apply(values)
                return [float(v) for v in results.forecast(steps)]
            except Exception:  # noqa: BLE001 - statsmodels raises many kinds (LinAlgError, ValueError, ...): fall back to constant
                self._results = None
                return None


class KalmanPredictor(_SafePredictor):
    """Local-linear-trend Kalman filter (filterpy), initialised from the warm-up window."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        super().__init__(config)
        self._filter: Any = None

    def _on_observation(self, value: float) -> None:
        if self._filter is None:
            if len(self._values) >= self.config.warmup_points:
                self._filter = self._initial_filter(np.asarray(self._values, dtype=np.float64))
            return
        self._filter.predict()
        self._filter.update(np.array([[value]]))

    def _initial_filter(self, values: np.ndarray) -> Any:
        from filterpy.kalman import KalmanFilter

        diffs = np.diff(values)
        # First differences of level + white noise have variance 2 sigma^2; a floor keeps a flat warm-up from
        # making the filter certain (and deaf to the first change).
        scale = max(float(np.mean(np.abs(values))), 1.0)
        measurement_var = max(float(np.var(diffs)) / 2.0, (0.01 * scale) ** 2)
        kf = KalmanFilter(dim_x=2, dim_z=1)
        kf.F = np.array([[1.0, 1.0], [0.0, 1.0]])
        kf.H = np.array([[1.0, 0.0]])
        kf.x = np.array([[values[-1]], [float(np.mean(diffs))]])
        kf.P = np.diag([measurement_var, measurement_var]) * 10.0
        kf.R = np.array([[measurement_var]])
        kf.Q = np.diag([self.config.kalman_level_noise, self.config.kalman_slope_noise]) * measurement_var
        return kf

    def _model_forecast(self, values: np.ndarray, steps: int) -> list[float] | None:
        if self._filter is None:
            return None
        level, slope = (float(v) for v in self._filter.x[:, 0])
        return [level + k * slope for k in range(1, steps + 1)]


class ProphetPredictor(_SafePredictor):
    """Prophet on the window, the intervals placed one minute apart (Prophet wants dates; only their order
    and spacing matter here), refit every `refit_every` observations."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        super().__init__(config)
        self._model: Any = None
        self.fits = 0

    def _model_forecast(self, values: np.ndarray, steps: int) -> list[float] | None:
        # Prophet reports its missing optional plotly at import, and cmdstanpy logs at INFO on every fit,
        # through a stderr handler of its own that it adds unless the logger already has a handler.
        logging.getLogger("prophet.plot").setLevel(logging.CRITICAL)
        cmdstanpy_logger = logging.getLogger("cmdstanpy")
        if not cmdstanpy_logger.handlers:
            cmdstanpy_logger.addHandler(logging.NullHandler())
        cmdstanpy_logger.setLevel(logging.WARNING)
        import pandas as pd
        from prophet import Prophet

        with warnings.catch_warnings():
            # Prophet uses pandas APIs that pandas 3 deprecates.
            warnings.simplefilter("ignore")
            try:
                dates = pd.date_range("2000-01-01", periods=len(values), freq="min")
                if self._model is None or self._observed >= self.config.refit_every:
                    model = Prophet(yearly_seasonality=False, weekly_seasonality=False, daily_seasonality=False)
                    if self.config.prophet_period_points:
                        model.add_seasonality(name="cycle", period=self.config.prophet_period_points / (24 * 60), fourier_order=3)
                    model.fit(pd.DataFrame({"ds": dates, "y": values}))
                    self._model = model
                    self._observed = 0
                    self.fits += 1
                # The fitted model's dates end at its own window; the next interval is one minute past the current one.
                ahead = [dates[-1] + pd.Timedelta(minutes=k) for k in range(1, steps + 1)]
                forecast = self._model.predict(pd.DataFrame({"ds": ahead}))
                return [float(v) for v in forecast["yhat"]]
            except Exception:  # noqa: BLE001 - Prophet and cmdstan raise many kinds: fall back to constant
                self._model = None
                return None


_KINDS: dict[str, type[_SafePredictor]] = {
    "constant": ConstantPredictor,
    "arima": ArimaPredictor,
    "kalman": KalmanPredictor,
    "prophet": ProphetPredictor,
}


def make_predictor(kind: PredictorKind, config: PredictorConfig | None = None) -> Predictor:
    """A predictor by name (`PREDICTOR_KINDS`)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown predictor {kind!r}; choose one of {', '.join(PREDICTOR_KINDS)}")
    return _KINDS[kind](config)


def warm_start(predictor: Predictor, values: Iterable[float]) -> Predictor:
    """Feed past values (oldest first) so the model starts with history; returns the predictor."""
    for value in values:
        predictor.observe(value)
    return predictor


@dataclass(frozen=True)
class TraceInterval:
    """One planner interval of a load trace: when it started, how many requests arrived, their mean ISL and OSL."""

    timestamp: float
    requests: float
    isl: float
    osl: float


TRACE_FIELDS = ("timestamp", "requests", "isl", "osl")


def _interval(row: dict[str, Any], where: str) -> TraceInterval:
    missing = [name for name in TRACE_FIELDS if name not in row or row[name] in (None, "")]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)} (a trace row needs {', '.join(TRACE_FIELDS)})")
    try:
        values = {name: float(row[name]) for name in TRACE_FIELDS}
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None
    if not all(math.isfinite(v) for v in values.values()) or min(values["requests"], values["isl"], values["osl"]) < 0:
        raise TraceError(f"{where}: requests, isl and osl must be finite and >= 0, timestamp finite; got {values}")
    return TraceInterval(**values)


def parse_trace(text: str, *, fmt: Literal["jsonl", "csv"], source: str = "trace") -> list[TraceInterval]:
    """Trace rows from text in either format (module docstring); timestamps must increase."""
    rows: list[TraceInterval] = []
    if fmt == "jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{source}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{source}:{number}: expected an object with {', '.join(TRACE_FIELDS)}")
            rows.append(_interval(obj, f"{source}:{number}"))
    else:
        lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        reader = csv.DictReader(io.StringIO("\n".join(lines)))
        if reader.fieldnames is None or not set(TRACE_FIELDS) <= {name.strip() for name in reader.fieldnames}:
            raise TraceError(f"{source}: the CSV header must name {', '.join(TRACE_FIELDS)}; got {reader.fieldnames}")
        for number, row in enumerate(reader, start=2):
            rows.append(_interval({k.strip(): v for k, v in row.items() if k is not None}, f"{source}:row {number}"))
    for earlier, later in zip(rows, rows[1:], strict=False):
        if later.timestamp <= earlier.timestamp:
            raise TraceError(f"{source}: timestamps must increase ({earlier.timestamp} then {later.timestamp})")
    return rows


def load_trace(path: str | Path) -> list[TraceInterval]:
    """A trace file: `.csv` as CSV, anything else as JSON lines."""
    path = Path(path)
    fmt: Literal["jsonl", "csv"] = "csv" if path.suffix.lower() == ".csv" else "jsonl"
    return parse_trace(path.read_text(), fmt=fmt, source=str(path))


def save_trace(path: str | Path, intervals: Sequence[TraceInterval]) -> None:
    """Write a trace as JSON lines (`.csv` paths as CSV), loadable with `load_trace`."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        lines = [",".join(TRACE_FIELDS)] + [f"{i.timestamp!r},{i.requests!r},{i.isl!r},{i.osl!r}" for i in intervals]
    else:
        lines = [json.dumps({name: getattr(i, name) for name in TRACE_FIELDS}) for i in intervals]
    path.write_text("\n".join(lines) + "\n")
