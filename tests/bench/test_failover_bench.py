"""`phalanx bench failover` kills workers under load per migration strategy, times restores and checkpointing's cost."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_failover_bench_reports_every_part_and_checkpoint_migration_loses_no_token():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "failover", "--streams", "6", "--tokens", "32", "--kill-after", "8",
         "--repeats", "1", "--strategies", "checkpoint,reprefill", "--restore-tokens", "64", "--restore-repeats", "1",
         "--overhead-pairs", "2", "--json"],
        capture_output=True, text=True, timeout=600, check=True, env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) >= {"strategies", "restore_s", "speedup_vs_reprefill", "checkpoint_overhead", "config"}
    assert set(result["strategies"]) == {"checkpoint", "reprefill"}
    checkpoint = result["strategies"]["checkpoint"]
    assert checkpoint["tokens_lost"] == 0 and checkpoint["repeated_tokens"] == 0, checkpoint
    assert checkpoint["identical_fraction"] == 1.0, checkpoint
    assert checkpoint["affected_streams"] >= 1 and 0 < checkpoint["stall_p50_s"] <= checkpoint["stall_p99_s"], checkpoint
    assert checkpoint["migrations_by_method"]["transfer"] == 0, checkpoint  # a dead source has no KV to give
    for name, row in result["strategies"].items():
        assert {"stall_p50_s", "stall_p99_s", "tokens_lost", "repeated_tokens", "identical_fraction", "affected_streams",
                "recovery_bytes", "recompute_s", "migration_s_by_method", "migrations_by_method"} <= set(row), name
    assert result["strategies"]["reprefill"]["recovery_bytes"] == 0
    assert set(result["restore_s"]["64"]) == {"checkpoint", "reprefill", "sequential_replay"}
    assert all(v > 0 for v in result["restore_s"]["64"].values())
    assert all(result["restore_detail"]["64"]["token_matches"].values()), result["restore_detail"]
    assert result["speedup_vs_reprefill"]["64"] > 0
    overhead = result["checkpoint_overhead"]
    assert overhead["throughput_on_tok_s"] > 0 and overhead["throughput_off_tok_s"] > 0
    assert overhead["overhead_fraction"] == pytest.approx(1 - overhead["throughput_on_tok_s"] / overhead["throughput_off_tok_s"], abs=1e-3)
    assert overhead["checkpoint_sent_bytes"]["on"] > 0 and overhead["checkpoint_sent_bytes"]["off"] == 0
