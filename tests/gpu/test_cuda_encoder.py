"""The encoder pool on a CUDA device: the same embeddings as on the CPU, returned on the host, batched.

Run where a GPU is (scripts/gpu_checks.sh on a lent device machine); skipped
elsewhere, CI included. The CPU suite checks the encoders against transformers.
"""

import asyncio

import pytest
import torch

from phalanx.bench.multimodal_ttft import random_png
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.encoder_pool.cost import Modality
from phalanx.encoder_pool.models import load_audio_encoder, load_image_encoder
from phalanx.encoder_pool.pool import EncodePool, MediaInput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", ["tiny-clip", "small-clip"])
def test_a_vision_tower_on_the_gpu_gives_the_cpu_embeddings_on_the_host(name):
    cpu, gpu = load_image_encoder(name, 64), load_image_encoder(name, 64, device="cuda")
    size = cpu.tower.config.image_size
    pixels = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(3))
    expected, got = cpu.encode(pixels), gpu.encode(pixels)
    assert got.device.type == "cpu" and got.shape == expected.shape
    # float32 on both; TF32 matmuls (if enabled) and other kernels differ in the last bits only.
    assert (got - expected).abs().max().item() < 1e-3 * max(1.0, expected.abs().max().item())


def test_the_audio_encoder_on_the_gpu_gives_the_cpu_embeddings_on_the_host():
    cpu, gpu = load_audio_encoder("tiny-whisper", 32), load_audio_encoder("tiny-whisper", 32, device="cuda")
    features = torch.randn(2, 80, 400, generator=torch.Generator().manual_seed(4))
    expected, got = cpu.encode(features), gpu.encode(features)
    assert got.device.type == "cpu"
    assert (got - expected).abs().max().item() < 1e-3 * max(1.0, expected.abs().max().item())


def test_a_gpu_pool_batches_concurrent_images_and_answers_with_host_tensors():
    config = EncoderPoolConfig(image_encoder="tiny-clip", audio_encoder="", llm_hidden_size=64, device="cuda")
    reference = EncodePool(EncoderPoolConfig(image_encoder="tiny-clip", audio_encoder="", llm_hidden_size=64))
    images = [random_png(seed, 32) for seed in range(16)]

    async def encode_all(pool: EncodePool):
        runner = asyncio.get_running_loop().create_task(pool.run())
        try:
            return await asyncio.gather(*(pool.encode([MediaInput(Modality.IMAGE, data)]) for data in images))
        finally:
            runner.cancel()

    gpu_results = asyncio.run(encode_all(EncodePool(config)))
    cpu_results = asyncio.run(encode_all(reference))
    for gpu_result, cpu_result in zip(gpu_results, cpu_results, strict=True):
        got, expected = gpu_result.items[0].embeddings, cpu_result.items[0].embeddings
        assert got.device.type == "cpu" and got.shape == expected.shape == (16, 64)
        assert (got - expected).abs().max().item() < 1e-3
