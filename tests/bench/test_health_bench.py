"""`phalanx bench health` injects every fault into a real stack and reports detection, false positives and canary cost."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_health_bench_reports_detection_per_fault_false_positives_and_canary_share():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "health", "--repeats", "1", "--min-checks", "200", "--json"],
        capture_output=True, text=True, timeout=600, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["detection_s"]) == {"crash", "hang", "corrupt", "slow"}
    assert all(0 < v < 60 for v in result["detection_s"].values())
    assert result["checks"] >= 200 and result["false_positives"] == 0, result
    assert 0 < result["canary_time_share"] < 1
