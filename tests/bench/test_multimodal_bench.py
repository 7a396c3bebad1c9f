"""`phalanx bench multimodal` reports batched vs one-at-a-time encoder throughput and per-unit costs (run with -m slow)."""

import json

import pytest

from phalanx.bench.multimodal import GOALS, run_multimodal_bench

pytestmark = pytest.mark.slow


def test_multimodal_bench_reports_throughput_costs_and_goals():
    result = run_multimodal_bench(image_encoder="tiny-clip", concurrency=8, rounds=2, repeats=2, torch_threads=1)
    json.dumps(result)  # plain JSON types only
    assert result["tokens_per_image"] == 16
    assert result["images_per_s"]["batched_max_16"] > 0 and result["images_per_s"]["one_at_a_time"] > 0
    assert result["learned_unit_ms"]["batched_max_16"]["image"] > 0
    assert 0 < result["encoder_ms"]["image_batch_1_ms"] and 0 < result["encoder_ms"]["audio_30s_chunk_ms"]
    assert result["goals"] == GOALS and set(result["met"]) == set(GOALS)
    assert result["met"]["batching_speedup_at_16_concurrent_images"] == (result["batching_speedup"] >= 2.0)
