"""The planner bench's trace and predictor choice (the live part runs in `phalanx bench planner`)."""

import pytest

from phalanx.bench import planner as bench

pytestmark = pytest.mark.unit


def test_the_trace_ramps_up_and_down_with_three_triple_bursts():
    duration, peak = 300.0, 2.0
    assert len(bench.bursts(duration)) == 3
    assert bench.rate_at(0.0, duration, peak) == pytest.approx(0.3 * peak)
    assert bench.rate_at(duration / 2 - 20, duration, peak) == pytest.approx(peak, rel=0.05)
    for burst in bench.bursts(duration):
        inside = bench.rate_at(burst.start_s + 1, duration, peak)
        outside = bench.rate_at(burst.start_s - 1, duration, peak)
        assert inside == pytest.approx(3 * outside, rel=0.05)
    times = bench.arrivals(duration, peak, seed=1)
    assert times == sorted(times) and times == bench.arrivals(duration, peak, seed=1)
    rows = bench.trace(times, duration, isl=48.0)
    assert sum(row.requests for row in rows) == len(times)
    expected = sum(bench.rate_at(t + 0.5, duration, peak) for t in range(int(duration)))
    assert abs(len(times) - expected) < 4 * expected**0.5


def test_the_best_predictor_weighs_missing_workers_over_idle_ones():
    results = {
        "constant": {"cost": 73.0}, "arima": {"cost": 71.0}, "kalman": {"cost": 71.0}, "prophet": {"skipped": "no"},
    }
    assert bench.best_predictor(results) == "arima"  # the tie goes to the simpler one
    rows = bench.trace(bench.arrivals(60.0, 1.0, seed=2), 60.0, isl=48.0)
    offline = bench.dryruns(rows, bench.bench_profile(), max_workers=6)
    for kind, result in offline.items():
        if "skipped" not in result:
            assert result["cost"] == result["worker_intervals"] + bench.MISSING_COST * result["missing_worker_intervals"], kind


def test_worker_seconds_count_every_worker_process_alive_starting_ones_too():
    state = {
        "workers": [{"worker_id": "worker-0"}, {"worker_id": "worker-1"}],
        "planner": {"target_workers": 4, "spares": [{"worker_id": "worker-2"}], "draining": ["worker-3"], "starting": 2,
                    "spares_starting": 1},
    }
    assert bench._processes(state) == (7, 4)
    assert bench._processes({"workers": [{"worker_id": "worker-0"}]}) == (1, None)  # no planner: the workers alone


def test_a_production_trace_is_compressed_thinned_to_the_asked_rate_and_its_bursts_found(tmp_path):
    # An Azure-layout trace: one request a second for an hour, and ten a second from minute 30 to 33.
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for second in range(3600):
        burst = 1800 <= second < 1980
        for k in range(10 if burst else 1):
            lines.append(f"2023-11-16 {18 + second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}.{k:07d},100,20")
    path = tmp_path / "azure.csv"
    path.write_text("\n".join(lines) + "\n")
    duration = 600.0  # compressed to 10 minutes: the burst from 300 s to 330 s
    times, in_file = bench.trace_arrivals(path, duration, mean_rps=2.0, seed=3)
    assert in_file == 3600 + 9 * 180
    assert times == sorted(times) and times == bench.trace_arrivals(path, duration, mean_rps=2.0, seed=3)[0]
    assert abs(len(times) - 2.0 * duration) < 4 * (2.0 * duration) ** 0.5
    found = bench.detected_bursts(times, duration)
    assert len(found) == 1 and 290 <= found[0].start_s <= 300 and 330 <= found[0].end_s <= 340, found
    rates = bench.windowed_rates(times, duration, 10.0)
    assert max(rates) > 4 * min(rates[:25])  # the burst is kept by the thinning, at the same share of the load
