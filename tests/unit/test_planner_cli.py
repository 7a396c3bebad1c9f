"""`phalanx planner dryrun` as a real subprocess: a synthetic bursty trace and a profile built in the test."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.planner.predictors import TraceInterval, save_trace
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile

pytestmark = pytest.mark.unit

CLI = [sys.executable, "-m", "phalanx.cli", "planner"]


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    profile = build_profile(
        [PrefillSample(128, 0.05), PrefillSample(512, 0.1), PrefillSample(2048, 0.4)],
        [DecodeSample(context, concurrency, itl) for context in (256, 1024) for concurrency, itl in ((1, 0.02), (8, 0.05), (32, 0.15))],
        model="synthetic",
    )
    # A diurnal-like ramp with a 3x burst in the middle, one interval a minute.
    intervals = [
        TraceInterval(timestamp=60.0 * i, requests=600 * (1.5 + math.sin(i / 8)) * (3 if 30 <= i < 34 else 1), isl=400, osl=150)
        for i in range(60)
    ]
    save_trace(tmp_path / "trace.jsonl", intervals)
    save_profile(profile, tmp_path / "profile.npz")
    return tmp_path / "trace.jsonl", tmp_path / "profile.npz"


def test_dryrun_prints_a_summary_and_writes_the_plot(tmp_path: Path) -> None:
    trace, profile = _inputs(tmp_path)
    out = tmp_path / "out.png"
    result = subprocess.run([*CLI, "dryrun", "--trace", str(trace), "--profile", str(profile), "--predictor", "constant", "--plot", str(out)],
                            capture_output=True, text=True, timeout=120, env=os.environ, check=False)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["intervals"] == 60 and summary["interval_s"] == 60.0 and summary["predictor"] == "constant"
    # The burst needs more workers than the quiet start; a constant predictor lags it by one interval at least.
    assert summary["max_workers"] > 1 and summary["under_provisioned_intervals"] >= 1
    assert summary["worker_intervals"] > 0 and summary["needed_worker_intervals"] > 0
    assert summary["pools"]["prefill_worker_intervals"] > 0 and summary["pools"]["max_decode_workers"] >= 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dryrun_replays_a_request_trace_compressed_to_minutes(tmp_path: Path) -> None:
    """A Mooncake-layout trace (one request a line, ms timestamps): two hours of arrivals with a burst, compressed to 20 minutes."""
    _, profile = _inputs(tmp_path)
    rows, t_ms = [], 0.0
    for i in range(1200):
        t_ms += 2000.0 if not 500 <= i < 700 else 200.0  # a burst at ten times the rate
        rows.append(json.dumps({"timestamp": int(t_ms), "input_length": 300 + i % 200, "output_length": 120, "hash_ids": [i]}))
    (tmp_path / "mooncake.jsonl").write_text("\n".join(rows) + "\n")
    result = subprocess.run([*CLI, "dryrun", "--trace", str(tmp_path / "mooncake.jsonl"), "--profile", str(profile), "--predictor", "constant",
                             "--minutes", "20", "--interval-s", "30"], capture_output=True, text=True, timeout=120, env=os.environ, check=False)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["trace"] == "requests" and summary["requests"] == 1200 and summary["interval_s"] == 30.0
    assert summary["intervals"] == 41  # 20 minutes of 30 s intervals, the last arrival opening the 41st
    assert summary["max_workers"] > 1 and summary["under_provisioned_intervals"] >= 1  # the burst, seen one interval late


def test_dryrun_rejects_a_missing_trace_and_an_unknown_predictor_with_a_readable_message(tmp_path: Path) -> None:
    _, profile = _inputs(tmp_path)
    missing = subprocess.run([*CLI, "dryrun", "--trace", str(tmp_path / "nope.jsonl"), "--profile", str(profile)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr
    unknown = subprocess.run([*CLI, "dryrun", "--trace", str(tmp_path / "trace.jsonl"), "--profile", str(profile), "--predictor", "magic"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert unknown.returncode == 2 and "magic" in unknown.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--connector", "foo"], "connector: Input should be 'virtual' or 'kubernetes'"),
        (["--min-workers", "5", "--max-workers", "2"], "min_workers (5) exceeds max_workers (2)"),
        (["--profile", "/nonexistent/profile.npz"], "/nonexistent/profile.npz"),
    ],
)
def test_the_service_refuses_bad_settings_with_a_readable_message(args: list[str], message: str) -> None:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
