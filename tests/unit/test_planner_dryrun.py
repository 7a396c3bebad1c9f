"""Offline replay of a trace through predictor + replica maths + profile, and its plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from phalanx.planner.distribution import Summary
from phalanx.planner.dryrun import plot, replay, trace_interval_s
from phalanx.planner.predictors import TraceInterval, load_trace, save_trace
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile
from phalanx.planner.replicas import LoadForecast, ReplicaConfig, SloTargets, plan_replicas

pytestmark = pytest.mark.unit

PROFILE = build_profile(
    [PrefillSample(isl, isl / 10_000.0) for isl in (128.0, 1024.0, 8192.0)],
    [DecodeSample(c, k, 0.01 + k * (2e-4 + c * 1e-7)) for c in (256.0, 2048.0, 8192.0) for k in (1.0, 8.0, 32.0, 128.0)],
    model="synthetic",
)
SLO = SloTargets(ttft_s=1.0, itl_s=0.03)


def bursty_trace(intervals: int = 60, interval_s: float = 10.0) -> list[TraceInterval]:
    """A compressed diurnal ramp (one sine period) with a 3x burst in the middle of the rise."""
    rows = []
    for i in range(intervals):
        base = 200.0 + 150.0 * math.sin(2 * math.pi * i / intervals)
        burst = 3.0 if 10 <= i < 14 else 1.0
        rows.append(TraceInterval(timestamp=1_700_000_000.0 + i * interval_s, requests=base * burst, isl=600.0 + 5 * i, osl=150.0))
    return rows


def test_replay_produces_one_point_per_interval_with_the_planner_maths() -> None:
    trace = bursty_trace()
    config = ReplicaConfig(interval_s=trace_interval_s(trace))
    series = replay(trace, PROFILE, SLO, config, predictor="constant")
    lengths = {len(getattr(series, name)) for name in (
        "timestamps", "observed_requests", "predicted_requests", "observed_isl", "predicted_isl",
        "observed_osl", "predicted_osl", "prefill", "decode", "combined", "needed_combined",
    )}
    assert lengths == {len(trace)}
    # Constant predicts each interval as the one before it; the first has nothing before it.
    assert series.predicted_requests[0] == 0.0
    assert series.predicted_requests[1:] == series.observed_requests[:-1]
    # Planned and needed workers come from the same replica maths on the predicted and the real load.
    row = trace[20]
    needed = plan_replicas(LoadForecast(row.requests, Summary.constant(row.isl), Summary.constant(row.osl)), PROFILE, SLO, config)
    assert series.needed_combined[20] == needed.combined
    assert series.combined[21] == needed.combined
    # The burst is not foreseen: the first burst interval is under-provisioned, later ones are not.
    assert series.combined[10] < series.needed_combined[10]
    assert series.combined[11] >= series.needed_combined[11] - 1
    assert series.under_provisioned_intervals >= 1
    assert series.worker_intervals == sum(series.combined)
    # A disaggregated fleet's two pools, each from its own figure of the same plans.
    pools = series.pools()
    assert pools["prefill_worker_intervals"] == sum(series.prefill) and pools["max_decode_workers"] == max(series.decode)
    assert pools["max_prefill_workers"] >= 1 and pools["decode_worker_intervals"] <= series.worker_intervals


def test_a_trend_predictor_under_provisions_less_often_than_constant_on_the_ramp() -> None:
    trace = [TraceInterval(10.0 * i, 50.0 + 12.0 * i, 800.0, 200.0) for i in range(40)]
    config = ReplicaConfig(interval_s=10.0)
    constant = replay(trace, PROFILE, SLO, config, predictor="constant")
    kalman = replay(trace, PROFILE, SLO, config, predictor="kalman")
    assert kalman.under_provisioned_intervals < constant.under_provisioned_intervals


def test_workers_slow_to_start_under_provision_a_ramp_unless_the_plan_looks_as_far_ahead() -> None:
    trace = [TraceInterval(10.0 * i, 50.0 + 12.0 * i, 800.0, 200.0) for i in range(40)]
    config = ReplicaConfig(interval_s=10.0)
    instant = replay(trace, PROFILE, SLO, config, predictor="kalman")
    # A worker routable 15 s after its plan: the workers planned for an interval serve only from its second half on, and
    # the fleet during its first half is the last plan's.
    late = replay(trace, PROFILE, SLO, config, predictor="kalman")
    late = type(late)(**{**late.__dict__, "lead_time_s": 15.0})
    ahead = replay(trace, PROFILE, SLO, config, predictor="kalman", lead_time_s=15.0)
    assert late.routable()[5:] == [min(late.combined[i - 2:i + 1]) for i in range(5, 40)]
    assert late.under_provisioned_intervals > instant.under_provisioned_intervals
    assert ahead.under_provisioned_intervals < late.under_provisioned_intervals
    # Planned 1.5 intervals ahead on a rise: never fewer workers than the plan for the next interval alone, more in all.
    assert all(a >= b for a, b in zip(ahead.combined, instant.combined, strict=True))
    assert ahead.worker_intervals > instant.worker_intervals


def test_plot_is_written_from_a_trace_file(tmp_path: Path) -> None:
    trace_path = tmp_path / "trace.jsonl"
    save_trace(trace_path, bursty_trace())
    trace = load_trace(trace_path)
    series = replay(trace, PROFILE, SLO, ReplicaConfig(interval_s=trace_interval_s(trace)), predictor="kalman")
    out = plot(series, tmp_path / "dryrun.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # three panels of lines, not an empty canvas


def test_trace_interval_is_the_median_spacing() -> None:
    rows = [TraceInterval(t, 1.0, 1.0, 1.0) for t in (0.0, 10.0, 20.0, 45.0, 55.0)]
    assert trace_interval_s(rows) == 10.0
    assert trace_interval_s(rows[:1]) == 60.0
