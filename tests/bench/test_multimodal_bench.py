"""`phalanx bench multimodal` reports batched vs one-at-a-time encoder throughput, per-unit costs, and media TTFT: overlap
vs sequential, joint routing vs round-robin under skew, by modality (run with -m slow)."""

import json

import pytest

from phalanx.bench.multimodal import GOALS, run_multimodal_bench

pytestmark = pytest.mark.slow


def test_multimodal_bench_reports_throughput_costs_and_goals():
    result = run_multimodal_bench(
        image_encoder="tiny-clip", concurrency=8, rounds=2, repeats=2, torch_threads=1, ttft_rounds=2, skew_requests=4, long_prefix=256,
    )
    json.dumps(result)  # plain JSON types only
    assert result["tokens_per_image"] == 16
    assert result["images_per_s"]["batched_max_16"] > 0 and result["images_per_s"]["one_at_a_time"] > 0
    assert result["learned_unit_ms"]["batched_max_16"]["image"] > 0
    assert 0 < result["encoder_ms"]["image_batch_1_ms"] and 0 < result["encoder_ms"]["audio_30s_chunk_ms"]
    assert result["goals"] == GOALS and set(result["met"]) == set(GOALS)
    assert result["met"]["batching_speedup_at_16_concurrent_images"] == (result["batching_speedup"] >= 2.0)
    ttft = result["ttft"]
    for where in ("overlap_in_process", "overlap_through_services"):
        long = ttft[where]["long_prefix"]
        assert long["prefix_tokens"] == 256 and long["sequential_ttft_ms"] > 0 and long["overlapped_ttft_ms"] > 0
    # Warm-up and 2 rounds x 2 prefixes, each prefix prefilled on the worker while the encoder ran.
    assert ttft["overlap_through_services"]["prefix_prefills_ok"] == 2 + 2 * 2
    skew = ttft["joint_routing_under_skew"]
    assert skew["requests_sent_to_busy_encoder"]["round_robin"] == 2  # every other one of 4
    assert result["met"]["joint_vs_round_robin_ttft_p90_under_skew"] == (ttft["joint_vs_round_robin_p90_ratio"] < 1.0)
    assert set(ttft["ttft_by_modality_ms"]) == {"image", "4_images", "video_8_frames", "audio_10s"}
