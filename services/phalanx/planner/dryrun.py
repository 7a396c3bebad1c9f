"""Replay a load trace offline through predictor + replica maths + profile, and plot it.

`replay` is pure: for each interval of the trace it predicts requests, ISL and OSL from the intervals
before it (as the live planner would), plans workers from the prediction, then shows the predictors the
interval's real values. It also plans from the real values (what a perfect predictor would have asked for),
so the plot shows where the prediction under- or over-provisions. With a lead time (new workers take that long to
become routable), each plan is for the load up to the lead time past its interval (`Predictor.predict_peak`, as the
live planner plans), and an interval counts as under-provisioned when it needs more than the workers routable all
through it: the fewest of the plans made within the lead time before its end (a scale-up is not routable yet, a
scale-down is at once). No correction factors: offline there
is no observed latency to correct with. A trace records means only, so ISL/OSL quantiles equal the means
here; quantile planning shows in the live planner, which observes histograms.

`plot` (the one function with I/O) draws the series with matplotlib's Agg canvas, without pyplot's global
state, into a PNG: requests per interval, ISL/OSL, and workers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.planner.distribution import Summary
from phalanx.planner.predictors import PredictorConfig, PredictorKind, TraceInterval, make_predictor
from phalanx.planner.profile import PerformanceProfile
from phalanx.planner.replicas import LoadForecast, ReplicaConfig, SloTargets, plan_replicas


@dataclass(frozen=True)
class DryRunSeries:
    """One value per trace interval, in trace order."""

    predictor: str
    interval_s: float
    lead_time_s: float = 0.0
    timestamps: list[float] = field(default_factory=list)
    observed_requests: list[float] = field(default_factory=list)
    predicted_requests: list[float] = field(default_factory=list)
    observed_isl: list[float] = field(default_factory=list)
    predicted_isl: list[float] = field(default_factory=list)
    observed_osl: list[float] = field(default_factory=list)
    predicted_osl: list[float] = field(default_factory=list)
    # Planned from the prediction: what the planner would have run.
    prefill: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    combined: list[int] = field(default_factory=list)
    # Planned from the interval's real load: what it needed.
    needed_combined: list[int] = field(default_factory=list)

    @property
    def worker_intervals(self) -> int:
        """Sum of planned workers over the intervals (times interval_s: worker-seconds)."""
        return sum(self.combined)

    @property
    def under_provisioned_intervals(self) -> int:
        return sum(1 for routable, needed in zip(self.routable(), self.needed_combined, strict=True) if routable < needed)

    def routable(self) -> list[int]:
        """Workers routable all through each interval: the fewest the plans of the last lead time asked for."""
        back = math.ceil(self.lead_time_s / self.interval_s - 1e-9)
        return [min(self.combined[max(0, i - back):i + 1]) for i in range(len(self.combined))]

    def pools(self) -> dict[str, int]:
        """What a disaggregated fleet would have run (docs/disagg.md, Planner): each pool's worker-intervals and its most
        workers, from the plan's prefill (TTFT-driven) and decode (ITL-driven) counts."""
        return {"prefill_worker_intervals": sum(self.prefill), "decode_worker_intervals": sum(self.decode),
                "max_prefill_workers": max(self.prefill, default=0), "max_decode_workers": max(self.decode, default=0)}


def trace_interval_s(trace: Sequence[TraceInterval]) -> float:
    """The trace's interval: the median spacing of its timestamps (one interval: 60 s)."""
    gaps = [later.timestamp - earlier.timestamp for earlier, later in zip(trace, trace[1:], strict=False)]
    return statistics.median(gaps) if gaps else 60.0


def replay(
    trace: Sequence[TraceInterval],
    profile: PerformanceProfile,
    slo: SloTargets,
    replica_config: ReplicaConfig,
    *,
    predictor: PredictorKind = "arima",
    predictor_config: PredictorConfig | None = None,
    degradation_level: int = 0,
    lead_time_s: float = 0.0,
) -> DryRunSeries:
    """The trace through the planner's maths (module docstring)."""
    predictors = {name: make_predictor(predictor, predictor_config) for name in ("requests", "isl", "osl")}
    series = DryRunSeries(predictor=predictor, interval_s=replica_config.interval_s, lead_time_s=lead_time_s)
    for interval in trace:
        predicted = {name: p.predict_next() for name, p in predictors.items()}
        predicted["requests"] = predictors["requests"].predict_peak(1.0 + lead_time_s / replica_config.interval_s)
        plan = plan_replicas(_forecast(predicted["requests"], predicted["isl"], predicted["osl"]), profile, slo, replica_config,
                             degradation_level=degradation_level)
        needed = plan_replicas(_forecast(interval.requests, interval.isl, interval.osl), profile, slo, replica_config,
                               degradation_level=degradation_level)
        series.timestamps.append(interval.timestamp)
        series.observed_requests.append(interval.requests)
        series.predicted_requests.append(predicted["requests"])
        series.observed_isl.append(interval.isl)
        series.predicted_isl.append(predicted["isl"])
        series.observed_osl.append(interval.osl)
        series.predicted_osl.append(predicted["osl"])
        series.prefill.append(plan.prefill)
        series.decode.append(plan.decode)
        series.combined.append(plan.combined)
        series.needed_combined.append(needed.combined)
        predictors["requests"].observe(interval.requests)
        predictors["isl"].observe(interval.isl)
        predictors["osl"].observe(interval.osl)
    return series


def _forecast(requests: float, isl: float, osl: float) -> LoadForecast:
    return LoadForecast(requests=requests, isl=Summary.constant(isl), osl=Summary.constant(osl))


def plot(series: DryRunSeries, path: str | Path, *, title: str | None = None) -> Path:
    """Write the series as a PNG (three panels sharing the time axis); returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    start = series.timestamps[0] if series.timestamps else 0.0
    minutes = [(t - start) / 60.0 for t in series.timestamps]
    figure = Figure(figsize=(11, 8), constrained_layout=True)
    FigureCanvasAgg(figure)
    load, lengths, workers = figure.subplots(3, 1, sharex=True)

    load.plot(minutes, series.observed_requests, label="observed", color="black", linewidth=1.2)
    load.plot(minutes, series.predicted_requests, label=f"predicted ({series.predictor})", color="tab:orange", linestyle="--")
    load.set_ylabel(f"requests / {series.interval_s:g} s")
    load.legend(loc="upper left")

    lengths.plot(minutes, series.observed_isl, label="ISL observed", color="tab:blue")
    lengths.plot(minutes, series.predicted_isl, label="ISL predicted", color="tab:blue", linestyle="--")
    lengths.plot(minutes, series.observed_osl, label="OSL observed", color="tab:green")
    lengths.plot(minutes, series.predicted_osl, label="OSL predicted", color="tab:green", linestyle="--")
    lengths.set_ylabel("tokens")
    lengths.legend(loc="upper left", ncol=2)

    workers.step(minutes, series.combined, where="post", label="planned (aggregated)", color="tab:red")
    workers.step(minutes, series.needed_combined, where="post", label="needed by the observed load", color="black", linestyle=":")
    workers.step(minutes, series.prefill, where="post", label="prefill workers if disaggregated", color="tab:purple", alpha=0.5)
    workers.step(minutes, series.decode, where="post", label="decode workers if disaggregated", color="tab:cyan", alpha=0.5)
    workers.set_ylabel("workers")
    workers.set_xlabel("minutes")
    workers.legend(loc="upper left", ncol=2)

    figure.suptitle(title or f"Phalanx planner dry run: {series.predictor}, {series.worker_intervals} worker-intervals, "
                    f"{series.under_provisioned_intervals} under-provisioned")
    path = Path(path)
    figure.savefig(path, format="png", dpi=100)
    return path
