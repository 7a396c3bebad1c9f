"""`phalanx bench engine-failover` SIGKILLs a primary engine under load: shadow takeover, cold restart, peer migration."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_engine_failover_bench_reports_every_way_back_and_the_takeover_loses_no_token():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "engine-failover", "--streams", "4", "--tokens", "32", "--kill-after", "8",
         "--json"],
        capture_output=True, text=True, timeout=600, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["scenarios"]) == {"shadow", "cold", "peer"}
    assert set(result["goals"]) == set(result["met"]) == set(result["measured"])
    for name, row in result["scenarios"].items():
        assert row["tokens_lost"] == 0 and row["repeated_tokens"] == 0 and row["identical_fraction"] == 1.0, (name, row)
        assert row["affected_streams"] >= 1 and 0 < row["kill_to_first_token_p50_s"] <= row["kill_to_first_token_p99_s"], (name, row)
    shadow = result["scenarios"]["shadow"]
    assert shadow["migrations_by_method"]["transfer"] == 0 and sum(shadow["migrations_by_method"].values()) == shadow["affected_streams"]
    assert len(shadow["kill_to_registered_s"]) == 1 and 0 < shadow["kill_to_registered_s"][0] < shadow["kill_to_first_token_p99_s"]
    memory = shadow["standby_memory_kib"]
    assert memory["shared"] > 50 * 1024 and memory["rss"] >= memory["shared"] + memory["private"] - 1024  # the mapped weights
    # A cold replacement imports torch and loads the model first: slower than a takeover by a wide margin.
    assert result["scenarios"]["cold"]["kill_to_first_token_p50_s"] > 2 * shadow["kill_to_first_token_p50_s"]
