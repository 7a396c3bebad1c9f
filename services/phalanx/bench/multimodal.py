"""`phalanx bench multimodal`: encoder throughput with per-modality batching vs one image at a time, encode cost per unit,
and media requests' TTFT (overlap of the text prefix with encoding, joint routing under skew, by modality: multimodal_ttft.py).

In process (no gRPC): an ``EncodePool`` serves ``concurrency`` concurrent
image requests, ``rounds`` times, once with batches of up to 16 and once
with batches of 1 (the same pool code, ``max_batch=1``); the throughput
ratio is the batching gain (goal ≥ 2× at 16 concurrent images).
It also times the encoders directly: one batch of 1 and of 16 images, 8
video frames, one 30 s audio chunk (medians), and reports the unit costs
the pool learned. Decoding and preprocessing are included in the pool runs,
as in the service.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time

import torch

from phalanx.bench.multimodal_ttft import random_png, run_ttft_benches
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.encoder_pool.cost import Modality
from phalanx.encoder_pool.pool import EncodePool, MediaInput

__all__ = ["GOALS", "run_multimodal_bench"]

GOALS = {
    "batching_speedup_at_16_concurrent_images": 2.0,
    # Overlapped TTFT at most 70 % of the sequential one with a long text prefix (>= 30 % lower).
    "overlap_ttft_reduction_long_prefix": 0.30,
    # Joint routing's TTFT p90 under a skewed encoder load, as a fraction of round-robin's: below 1 (it beats it).
    "joint_vs_round_robin_ttft_p90_under_skew": 1.0,
}


async def _throughput(config: EncoderPoolConfig, images: list[bytes], rounds: int) -> tuple[float, dict[str, float]]:
    pool = EncodePool(config)
    task = asyncio.get_running_loop().create_task(pool.run())
    try:
        await pool.encode([MediaInput(Modality.IMAGE, images[0])])  # warm-up
        start = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(pool.encode([MediaInput(Modality.IMAGE, data)]) for data in images))
        elapsed = time.perf_counter() - start
    finally:
        task.cancel()
    return rounds * len(images) / elapsed, {m.value: round(pool.cost.unit_ms(m), 3) for m in Modality if pool.cost.measured(m)}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def _direct(pool: EncodePool, repeats: int) -> dict[str, float]:
    assert pool.image is not None and pool.audio is not None
    size = pool.image.tower.config.image_size
    pixels = torch.randn(16, 3, size, size, generator=torch.Generator().manual_seed(0))
    image = pool.image
    audio = pool.audio
    chunk = torch.randn(1, audio.n_mels, 3000, generator=torch.Generator().manual_seed(1))
    one = _median_ms(lambda: image.encode(pixels[:1]), repeats)
    sixteen = _median_ms(lambda: image.encode(pixels), repeats)
    return {
        "image_batch_1_ms": one, "image_batch_16_ms": sixteen, "image_batch_16_per_image_ms": round(sixteen / 16, 3),
        "video_8_frames_ms": _median_ms(lambda: image.encode(pixels[:8]), repeats),
        "audio_30s_chunk_ms": _median_ms(lambda: audio.encode(chunk), max(1, repeats // 4)),
    }


def run_multimodal_bench(
    *, image_encoder: str = "small-clip", audio_encoder: str = "tiny-whisper", llm_hidden_size: int = 256, concurrency: int = 16,
    rounds: int = 4, repeats: int = 8, torch_threads: int = 2, ttft_rounds: int = 6, skew_requests: int = 20, long_prefix: int = 1024,
    ttft: bool = True, model: str = "phalanx-tiny-dense", device: str = "cpu", encoder_device: str = "cpu",
) -> dict:
    torch.set_num_threads(torch_threads)
    batched_config, single_config = (
        EncoderPoolConfig(
            image_encoder=image_encoder, audio_encoder=audio_encoder, llm_hidden_size=llm_hidden_size, max_batch=batch,
            max_backlog_ms=1e9, device=encoder_device,
        )
        for batch in (16, 1)
    )
    probe = EncodePool(batched_config)
    assert probe.image is not None
    images = [random_png(seed, probe.image.tower.config.image_size) for seed in range(concurrency)]
    batched, batched_costs = asyncio.run(_throughput(batched_config, images, rounds))
    single, single_costs = asyncio.run(_throughput(single_config, images, rounds))
    speedup = batched / single
    met = {"batching_speedup_at_16_concurrent_images": speedup >= GOALS["batching_speedup_at_16_concurrent_images"]}
    ttft_results: dict = {}
    if ttft:
        ttft_results = run_ttft_benches(
            image_encoder=image_encoder, audio_encoder=audio_encoder, rounds=ttft_rounds, skew_requests=skew_requests,
            long_prefix=long_prefix, model=model, device=device, encoder_device=encoder_device,
        )
        reduction = ttft_results["overlap_through_services"]["long_prefix"]["reduction"]
        skew = ttft_results["joint_routing_under_skew"]
        p90_ratio = skew["joint_ttft_ms"]["p90"] / skew["round_robin_ttft_ms"]["p90"]
        ttft_results["joint_vs_round_robin_p90_ratio"] = round(p90_ratio, 3)
        met["overlap_ttft_reduction_long_prefix"] = reduction >= GOALS["overlap_ttft_reduction_long_prefix"]
        met["joint_vs_round_robin_ttft_p90_under_skew"] = p90_ratio < GOALS["joint_vs_round_robin_ttft_p90_under_skew"]
    return {
        "image_encoder": image_encoder,
        "tokens_per_image": probe.image.tokens_per_image,
        "concurrency": concurrency,
        "rounds": rounds,
        "images_per_s": {"batched_max_16": round(batched, 1), "one_at_a_time": round(single, 1)},
        "learned_unit_ms": {"batched_max_16": batched_costs, "one_at_a_time": single_costs},
        "encoder_ms": _direct(probe, repeats),
        "torch_threads": torch_threads,
        "device": device,
        "encoder_device": encoder_device,
        **({"gpu": torch.cuda.get_device_name(torch.device(device))} if device.startswith("cuda") else {}),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "goals": {k: v for k, v in GOALS.items() if k in met},
        "met": met,
        "batching_speedup": round(speedup, 2),
        **({"ttft": ttft_results} if ttft else {}),
    }
