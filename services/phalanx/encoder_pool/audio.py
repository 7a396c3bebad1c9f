"""A Whisper-style audio encoder (two convolutions, sinusoidal positions, pre-norm layers) and its Hugging Face loader.

Input: log-mel features ``(batch, n_mels, frames)`` from ``log_mel_features``;
the second convolution halves the frames, so 30 s (3,000 frames) gives 1,500
positions. Unlike ``transformers.WhisperEncoder`` it accepts any frame count
up to ``2 * max_source_positions`` (shorter audio costs less), and a
checkpoint loads unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.encoder_pool.checkpoint import read_hf_config, read_safetensors_dir
from phalanx.encoder_pool.layers import ACTIVATIONS, EncoderAttention

__all__ = ["WhisperEncoderConfig", "WhisperAudioEncoder", "load_whisper_encoder", "sinusoids"]


@dataclass(frozen=True)
class WhisperEncoderConfig:
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> WhisperEncoderConfig:
        return cls(**{k: v for k, v in config.items() if k in cls.__dataclass_fields__})


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed position table: sin in the first half of the channels, cos in the second."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class _Layer(nn.Module):
    def __init__(self, config: WhisperEncoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = EncoderAttention(d, config.encoder_attention_heads, key_bias=False)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperAudioEncoder(nn.Module):
    """``transformers.WhisperEncoder`` with its parameter names."""

    def __init__(self, config: WhisperEncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        with torch.no_grad():
            self.embed_positions.weight.copy_(sinusoids(config.max_source_positions, d))
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    @staticmethod
    def output_length(frames: int) -> int:
        """Positions out for `frames` mel frames in (the stride-2 convolution)."""
        return (frames - 1) // 2 + 1

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(batch, n_mels, frames) -> (batch, ceil(frames / 2), d_model)."""
        frames = features.shape[-1]
        if frames > 2 * self.config.max_source_positions:
            raise ValueError(f"{frames} mel frames exceed the encoder's {2 * self.config.max_source_positions}")
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


def load_whisper_encoder(path: str | Path, *, dtype: torch.dtype = torch.float32) -> WhisperAudioEncoder:
    """The encoder of a Hugging Face directory (config.json + safetensors) of a WhisperEncoder, WhisperModel or
    WhisperForConditionalGeneration: the keys under ``encoder.`` (or ``model.encoder.``), or all of them."""
    root = Path(path)
    encoder = WhisperAudioEncoder(WhisperEncoderConfig.from_hf(read_hf_config(root)))
    state = read_safetensors_dir(root)
    for prefix in ("model.encoder.", "encoder."):
        if any(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            break
    encoder.load_state_dict(state, strict=True)
    return encoder.to(dtype).eval()
