"""Encoders the pool serves: a tower, its projector into the LLM's hidden size and its preprocessing, in one object.

Built-in small encoders (``tiny-clip``, ``tiny-whisper``) have seeded random
weights, so every process that builds one gets the same numbers (tests,
determinism across encoder replicas); a Hugging Face directory loads a real
tower, whose projector is seeded the same way until a trained one is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from phalanx.encoder_pool.audio import WhisperAudioEncoder, WhisperEncoderConfig, load_whisper_encoder
from phalanx.encoder_pool.image import ImageProcessing
from phalanx.encoder_pool.projector import Projector
from phalanx.encoder_pool.vision import ClipVisionConfig, ClipVisionTower, load_clip_vision

__all__ = ["BUILTIN_AUDIO", "BUILTIN_VISION", "AudioEncoder", "ImageEncoder", "load_audio_encoder", "load_image_encoder"]

BUILTIN_VISION: dict[str, ClipVisionConfig] = {
    # 32² pixels in 8² patches: 16 tokens per image.
    "tiny-clip": ClipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    ),
    # A ViT-S/32-sized tower at CLIP's 224² input (49 tokens per image): large enough that benchmarks measure
    # compute, not Python overhead, small enough for a CPU.
    "small-clip": ClipVisionConfig(
        hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6, image_size=224, patch_size=32
    ),
}
BUILTIN_AUDIO: dict[str, WhisperEncoderConfig] = {
    "tiny-whisper": WhisperEncoderConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128),
}
# Audio positions stacked per LLM position: 1,500 -> 375 per 30 s.
AUDIO_STACK = 4


def _seeded_init(module: nn.Module, seed: int) -> None:
    """Normal(0, 0.02) weights, zero biases, unit norms, from a private generator (the global RNG is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("embed_positions.weight"):
                continue  # Whisper's fixed sinusoids
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _to_host(embeddings: torch.Tensor) -> torch.Tensor:
    # Embeddings leave over gRPC bytes or a CPU tensor channel, so a GPU encoder's come back to the host here, once per
    # batch (which also waits for the batch's kernels: the pool's measured batch time is the real encode time).
    return embeddings.cpu()


@dataclass
class ImageEncoder:
    """Pixels -> LLM embeddings: ``preprocess`` one RGB image, ``encode`` a batch."""

    name: str
    tower: ClipVisionTower
    projector: Projector
    processing: ImageProcessing

    @property
    def tokens_per_image(self) -> int:
        return self.tower.config.num_patches

    def preprocess(self, rgb: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.processing(rgb))

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(batch, 3, S, S) -> (batch, tokens_per_image, llm_hidden), on the CPU whatever the encoder's device."""
        return _to_host(self.projector(self.tower(pixels.to(_device_of(self.projector))).features))


@dataclass
class AudioEncoder:
    """Log-mel chunks -> LLM embeddings."""

    name: str
    encoder: WhisperAudioEncoder
    projector: Projector

    @property
    def n_mels(self) -> int:
        return self.encoder.config.num_mel_bins

    def tokens_for_frames(self, frames: int) -> int:
        return self.projector.output_length(WhisperAudioEncoder.output_length(frames))

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """(batch, n_mels, frames) -> (batch, tokens_for_frames(frames), llm_hidden), on the CPU whatever the encoder's
        device."""
        return _to_host(self.projector(self.encoder(features.to(_device_of(self.projector)))))


def load_image_encoder(name_or_path: str, llm_hidden_size: int, *, seed: int = 0, device: str = "cpu") -> ImageEncoder:
    """A built-in name (seeded weights) or a Hugging Face CLIP directory, on ``device``."""
    if name_or_path in BUILTIN_VISION:
        tower = ClipVisionTower(BUILTIN_VISION[name_or_path])
        _seeded_init(tower, seed)
    elif Path(name_or_path).is_dir():
        tower = load_clip_vision(name_or_path)
    else:
        raise ValueError(f"unknown image encoder {name_or_path!r}: a directory or one of {sorted(BUILTIN_VISION)}")
    projector = Projector(tower.config.hidden_size, llm_hidden_size)
    _seeded_init(projector, seed + 1)
    size = tower.config.image_size
    return ImageEncoder(name_or_path, tower.to(device).eval(), projector.to(device).eval(), ImageProcessing(size=size, crop=size))


def load_audio_encoder(name_or_path: str, llm_hidden_size: int, *, seed: int = 0, device: str = "cpu") -> AudioEncoder:
    """A built-in name (seeded weights) or a Hugging Face Whisper directory, on ``device``."""
    if name_or_path in BUILTIN_AUDIO:
        encoder = WhisperAudioEncoder(BUILTIN_AUDIO[name_or_path])
        _seeded_init(encoder, seed)
    elif Path(name_or_path).is_dir():
        encoder = load_whisper_encoder(name_or_path)
    else:
        raise ValueError(f"unknown audio encoder {name_or_path!r}: a directory or one of {sorted(BUILTIN_AUDIO)}")
    projector = Projector(encoder.config.d_model, llm_hidden_size, stack=AUDIO_STACK)
    _seeded_init(projector, seed + 1)
    return AudioEncoder(name_or_path, encoder.to(device).eval(), projector.to(device).eval())
