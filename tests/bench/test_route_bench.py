"""`phalanx bench route` builds a full index and reports routing latency (run with -m slow)."""

import json
import subprocess
import sys

import pytest

from phalanx.bench.route import run_route_bench

pytestmark = pytest.mark.slow


def test_route_bench_reports_latency_for_every_worker_count():
    result = run_route_bench(worker_counts=(4, 16), total_blocks=3000, decisions=300, seed=1)
    json.dumps(result)  # plain JSON types only
    assert [r["workers"] for r in result["results"]] == [4, 16]
    for row in result["results"]:
        assert row["indexed_blocks"] == 3000
        assert 0 < row["distinct_blocks"] <= 3000
        assert row["decisions"] == 300
        assert 0 < row["p50_us"] <= row["p99_us"]
        assert row["mean_us"] > 0
        assert 0 <= row["routed_with_cache_hit"] <= 1
    assert 256 <= result["prompt_tokens"]["min"] <= result["prompt_tokens"]["mean"] <= result["prompt_tokens"]["max"] <= 1024
    assert result["python"]


def test_route_bench_is_reproducible_in_its_workload():
    first = run_route_bench(worker_counts=(8,), total_blocks=2000, decisions=100, seed=3)
    second = run_route_bench(worker_counts=(8,), total_blocks=2000, decisions=100, seed=3)
    assert first["prompt_tokens"] == second["prompt_tokens"]
    assert first["results"][0]["distinct_blocks"] == second["results"][0]["distinct_blocks"]


def test_phalanx_bench_route_prints_json():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "route", "--json", "--workers", "4", "--blocks", "2000"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    result = json.loads(out)
    assert [r["workers"] for r in result["results"]] == [4]
    assert result["results"][0]["indexed_blocks"] == 2000
