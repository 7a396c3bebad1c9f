"""The engine side by side (`phalanx bench engine` on a GGUF model): its report's shape, its goals, and that every engine
decodes the same greedy tokens from the same ids, so the figures compare like with like."""

from __future__ import annotations

import pytest

import phalanx.model
from phalanx.bench.engine_llama_cpp import llama_cpp_version
from phalanx.bench.engine_reference import prompts
from phalanx.bench.engine_side_by_side import (
    GOALS,
    PhalanxSide,
    SideBySideSettings,
    goals_met,
    model_for,
    percentile,
    run_side_by_side,
    variant_config,
)
from phalanx.model.config import BUILTIN_CHECKPOINTS

pytestmark = pytest.mark.unit

GGUF_MODEL = "smollm2-135m-instruct"


def test_side_by_side_reports_both_phalanx_variants_and_leaves_goals_without_a_reference_unmet_by_none():
    settings = SideBySideSettings(batches=(1, 2), new_tokens=3, prompt_len=8, repeats=1, ttft_prompt_lens=(16, 24))
    report = run_side_by_side("phalanx-tiny-dense", None, settings)
    engines = report["engines"]
    assert set(engines) == {"phalanx_float32", "phalanx_auto", "transformers", "llama_cpp"}
    for name in ("phalanx_float32", "phalanx_auto"):
        assert [row["batch"] for row in engines[name]["decode"]] == [1, 2]
        for row in engines[name]["decode"]:
            assert row["tokens_per_s"] > 0 and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert set(engines[name]["ttft_s"]) == {"16", "24"} and all(s > 0 for s in engines[name]["ttft_s"].values())
    assert engines["phalanx_float32"]["dtype"] == "float32"
    assert "skipped" in engines["transformers"] and "skipped" in engines["llama_cpp"]
    assert set(report["met"]) == set(report["goals"]) == set(GOALS)
    # Measured: batch 1 of both variants. Not measured: batch 16, and llama.cpp.
    assert report["reached"]["batch1_vs_float32"] == pytest.approx(
        engines["phalanx_auto"]["decode"][0]["tokens_per_s"] / engines["phalanx_float32"]["decode"][0]["tokens_per_s"], rel=0.01
    )
    assert report["met"]["batch1_vs_llama_cpp"] is None and report["met"]["batch16_tokens_per_s"] is None
    assert report["batches"] == [1, 2] and report["new_tokens"] == 3


def test_goals_read_the_auto_variant_against_float32_and_llama_cpp():
    def engine(batch1: float, batch16: float) -> dict:
        return {"decode": [{"batch": 1, "tokens_per_s": batch1}, {"batch": 16, "tokens_per_s": batch16}]}

    figures = {"phalanx_float32": engine(20, 100), "phalanx_auto": engine(40, 250), "llama_cpp": engine(100, 400)}
    reached, met = goals_met(figures)
    assert reached == {
        "batch1_vs_float32": 2.0, "batch1_vs_llama_cpp": 0.4, "batch16_vs_float32": 2.5, "batch16_tokens_per_s": 250,
        "batch1_tokens_per_s": 40,
    }
    assert met == {
        "batch1_vs_float32": True, "batch1_vs_llama_cpp": False, "batch16_vs_float32": True, "batch16_tokens_per_s": True,
        "batch1_tokens_per_s": True,
    }
    del figures["llama_cpp"]
    assert goals_met(figures)[1]["batch1_vs_llama_cpp"] is None


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return BUILTIN_CHECKPOINTS[GGUF_MODEL].path()
    except phalanx.model.CheckpointError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def phalanx_side(gguf_path):
    # The default cache, as the bench itself reads it: the dequantized weights are made once per machine.
    config = variant_config(GGUF_MODEL, "float32", max_batch=2, seq_len=64, max_model_len=64)
    return PhalanxSide(model_for(config), config)


@pytest.fixture(scope="module")
def two_prompts(phalanx_side):
    return prompts(phalanx_side.model, 2, 24)


# transformers dequantizes the GGUF in Python on every load (half a minute here): slow, like the bench tests.
@pytest.mark.slow
def test_transformers_side_decodes_phalanx_greedy_tokens(gguf_path, phalanx_side, two_prompts):
    pytest.importorskip("transformers")
    from phalanx.bench.engine_reference import TransformersSide

    theirs = TransformersSide(gguf_path)
    decoded = theirs.decode(two_prompts[:1], 3)
    assert decoded.tokens == phalanx_side.decode(two_prompts[:1], 3).tokens
    assert len(decoded.step_s) == 2 and all(s > 0 for s in decoded.step_s)
    assert theirs.first_token_s(two_prompts[0]) > 0


@pytest.mark.skipif(llama_cpp_version() is None, reason="llama-cpp-python not installed (the optional bench extra)")
def test_llama_cpp_side_decodes_a_batch_with_phalanx_greedy_tokens_on_the_gguf(gguf_path, phalanx_side, two_prompts):
    from phalanx.bench.engine_llama_cpp import LlamaCppSide

    theirs = LlamaCppSide(gguf_path, threads=1, max_batch=2, n_ctx=128)
    try:
        decoded = theirs.decode(two_prompts, 2)
        assert decoded.tokens == phalanx_side.decode(two_prompts, 2).tokens
        assert len(decoded.step_s) == 1
        assert theirs.first_token_s(two_prompts[0]) > 0
    finally:
        theirs.close()


def test_a_reference_that_is_not_installed_is_reported_so_and_left_out(gguf_path, monkeypatch):
    import phalanx.bench.engine_llama_cpp
    import phalanx.bench.engine_reference
    from phalanx.bench.engine_side_by_side import _references

    # What a machine without the optional packages sees (CI has no llama-cpp-python).
    monkeypatch.setattr(phalanx.bench.engine_llama_cpp, "llama_cpp_version", lambda: None)
    monkeypatch.setattr(phalanx.bench.engine_reference, "transformers_installed", lambda: False)
    engines, skipped = _references(gguf_path, threads=1, max_batch=1, n_ctx=64)
    assert engines == {}
    assert set(skipped) == {"transformers", "llama_cpp"}
    assert all("not installed" in entry["skipped"] for entry in skipped.values())
