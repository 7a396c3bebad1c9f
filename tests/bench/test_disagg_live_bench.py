"""`phalanx bench disagg --live` in a short configuration: two real stacks with the real engine, aggregated and
disaggregated, the same workload through the router."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_live_disagg_bench_hands_long_prompts_over_and_loses_no_token():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "disagg", "--json", "--workers", "3", "--prefill-workers", "1", "--seconds", "2",
         "--warmup", "0.5", "--live", "--live-seconds", "20", "--live-long-tokens", "300", "--live-long-every", "6"],
        capture_output=True, text=True, timeout=900, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    live = json.loads(out.stdout.strip().splitlines()[-1])["live"]
    assert set(live["met"]) == {"kv_transfer_share_of_ttft", "requests_with_lost_or_repeated_tokens", "handovers"}
    for mode in ("aggregated", "disaggregated"):
        assert live[mode]["long_requests"] >= 2 and live[mode]["steady_requests"] >= 1, live[mode]
        assert live[mode]["requests_with_lost_or_repeated_tokens"] == 0 and live[mode]["errors"] == 0, live[mode]
    handovers = live["disaggregated"]["handovers"]
    assert handovers["ok"] >= 1 and handovers["local_by_reason"].get("short", 0) >= 1, handovers
