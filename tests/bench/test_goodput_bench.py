"""`phalanx bench goodput` in a tiny configuration: two real stacks of simulated workers, loads through the gateway."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_goodput_bench_compares_admission_on_and_off_at_capacity_and_beyond():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "goodput", "--seconds", "4", "--factors", "1,4", "--capacity", "2", "--osl", "8",
         "--json"],
        capture_output=True, text=True, timeout=600, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["modes"]) == {"off", "slo"} and set(result["modes"]["slo"]) == {"1", "4"}
    assert set(result["met"]) == set(result["goals"])
    at_4x = result["modes"]["slo"]["4"]
    # Four times what it serves: admission refuses some (429 with Retry-After) and what it admits meets the SLOs.
    assert at_4x["refused"] > 0 and at_4x["retry_after_s"]
    assert at_4x["admitted_meeting_slo"] >= 0.8
    assert result["modes"]["off"]["4"]["refused"] == 0
