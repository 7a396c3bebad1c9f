"""`phalanx bench serve` runs a real stack and prints both sides of the comparison."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_serve_bench_prints_stack_and_bare_throughput_and_their_ratio():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "serve", "--streams", "4", "--tokens", "16", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["stack_tokens_per_s"] > 0 and result["bare_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["stack_tokens_per_s"] / result["bare_tokens_per_s"], rel=0.01)
    assert set(result["met"]) == set(result["goals"]) == {"ratio"}
    assert result["met"]["ratio"] == (result["stack_tokens_per_s"] / result["bare_tokens_per_s"] >= result["goals"]["ratio"])
