"""`phalanx bench engine` runs end to end and prints the comparison (run with -m slow)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_engine_prints_ratios_for_every_batch():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "engine", "--json", "--batches", "1,8", "--tokens", "16", "--repeats", "1"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    result = json.loads(out)
    assert [r["batch"] for r in result["results"]] == [1, 8]
    for row in result["results"]:
        assert row["bare_tokens_per_s"] > 0 and row["engine_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["engine_tokens_per_s"] / row["bare_tokens_per_s"], rel=0.01)
