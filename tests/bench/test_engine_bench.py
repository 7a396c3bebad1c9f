"""`phalanx bench engine` runs end to end and prints the comparison (run with -m slow)."""

import json
import os
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


def test_bench_engine_compares_a_gguf_model_with_transformers(tmp_path):
    pytest.importorskip("transformers")
    out = subprocess.run(
        [
            sys.executable, "-m", "phalanx.cli", "bench", "engine", "--json", "--model", "smollm2-135m-instruct", "--tokens", "8", "--repeats", "1",
            "--no-side-by-side",
        ],
        check=True, capture_output=True, text=True, timeout=600, env={**os.environ, "PHALANX_CACHE_DIR": str(tmp_path)},
    ).stdout
    result = json.loads(out)
    versus = result["versus_transformers"]
    assert result["results"] == []  # a real model skips the bare-loop matrix unless --batches asks for it
    assert versus["transformers_batch1_tokens_per_s"] > 0 and versus["engine_batch16_aggregate_tokens_per_s"] > 0
    assert versus["batch1_ratio"] == pytest.approx(versus["engine_batch1_tokens_per_s"] / versus["transformers_batch1_tokens_per_s"], rel=0.01)
    assert versus["load_s"] < versus["load_to_first_token_s"]
    assert set(result["met"]) == set(result["goals"]) == {"ratio_at_batch_32", "batch1_ratio", "batch16_ratio", "load_to_first_token_s"}


def test_bench_engine_runs_a_gguf_model_side_by_side_with_transformers_and_llama_cpp(tmp_path):
    pytest.importorskip("transformers")
    out = subprocess.run(
        [
            sys.executable, "-m", "phalanx.cli", "bench", "engine", "--json", "--model", "smollm2-135m-instruct", "--tokens", "4", "--repeats", "1",
            "--side-batches", "1,16", "--ttft-lens", "128",
        ],
        check=True, capture_output=True, text=True, timeout=600, env={**os.environ, "PHALANX_CACHE_DIR": str(tmp_path)},
    ).stdout
    result = json.loads(out)
    side = result["side_by_side"]
    assert "versus_transformers" not in result
    engines = side["engines"]
    for name in ("phalanx_float32", "phalanx_auto"):
        assert [row["batch"] for row in engines[name]["decode"]] == [1, 16] and engines[name]["ttft_s"]["128"] > 0
    assert [row["batch"] for row in engines["transformers"]["decode"]] == [1]  # batch 1 only, said so in its entry
    assert "batch 1 only" in engines["transformers"]["batches"]
    if "skipped" in engines["llama_cpp"]:
        assert "not installed" in engines["llama_cpp"]["skipped"] and result["met"]["batch1_vs_llama_cpp"] is None
    else:
        assert [row["batch"] for row in engines["llama_cpp"]["decode"]] == [1, 16]
        assert isinstance(result["met"]["batch1_vs_llama_cpp"], bool)
    assert set(side["goals"]) <= set(result["goals"]) and set(result["met"]) == set(result["goals"])
