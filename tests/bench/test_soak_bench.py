"""`phalanx bench soak`: a stack under steady load with a worker SIGKILLed on a timer; per-minute series and trends."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

KINDS = {"worker", "router", "checkpoint_store", "migration", "nats", "etcd", "client"}


def test_soak_reports_per_minute_series_trends_and_loses_no_token_across_kills():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "soak", "--minutes", "1.5", "--kill-every", "30", "--streams", "4",
         "--sample", "3", "--json"],
        capture_output=True, text=True, timeout=420, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"per_minute", "trend", "totals", "fd_kinds", "config", "goals", "met"} <= set(result)
    assert set(result["fd_kinds"]) == KINDS and result["fd_kinds"]["worker"]["last"].get("socket", 0) > 0
    totals = result["totals"]
    assert totals["kills"] >= 2 and totals["requests"] > 0, totals
    assert totals["start_failures"] == 0, result["start_failures"]  # every killed worker was replaced
    assert totals["lost"] == 0 and totals["repeated"] == 0 and totals["changed"] == 0 and totals["errors"] == 0, result["errors"]
    assert [row["minute"] for row in result["per_minute"]] == [0, 1]
    first = result["per_minute"][0]
    assert first["requests"] > 0 and first["latency_p99_s"] > 0 and set(first["rss_mib"]) == KINDS and set(first["fds"]) == KINDS
    assert set(result["trend"]) == KINDS
    for kind, trend in result["trend"].items():
        assert trend["rss_mib"]["slope_per_min"] is not None and trend["rss_mib"]["mean"] > 0, kind
        assert trend["fds"]["samples"] >= 3, kind
    assert result["met"]["lost"] and result["met"]["repeated"] and result["met"]["changed"]
