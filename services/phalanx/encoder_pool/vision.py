"""A CLIP-style vision tower (ViT with a class token, pre- and post-layernorm) and its Hugging Face loader.

The tower's output for an LLM is the patch tokens of one hidden layer
(LLaVA takes the penultimate): ``(batch, num_patches, hidden)``, which a
``Projector`` maps into the LLM's hidden size. ``forward`` also returns
what ``transformers.CLIPVisionModel`` returns, for the parity test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.encoder_pool.checkpoint import read_hf_config, read_safetensors_dir
from phalanx.encoder_pool.layers import ACTIVATIONS, EncoderAttention

__all__ = ["ClipVisionConfig", "ClipVisionTower", "VisionOutput", "load_clip_vision"]


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    # Which hidden state feeds the projector: -1 the last layer, -2 the penultimate (LLaVA's choice).
    feature_layer: int = -2

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, config: dict[str, Any], **overrides: Any) -> ClipVisionConfig:
        """From a Hugging Face config.json: a CLIPVisionConfig, or a CLIPConfig's ``vision_config``."""
        config = config.get("vision_config", config)
        names = {f for f in cls.__dataclass_fields__ if f != "feature_layer"}
        return cls(**{k: v for k, v in config.items() if k in names}, **overrides)


@dataclass(frozen=True)
class VisionOutput:
    features: torch.Tensor  # (batch, patches, hidden): the feature layer's patch tokens, what the projector takes
    last_hidden_state: torch.Tensor  # (batch, 1 + patches, hidden), as CLIPVisionModel
    pooler_output: torch.Tensor  # (batch, hidden): post-layernorm class token, as CLIPVisionModel


class _Embeddings(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = EncoderAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = _Mlp(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class ClipVisionTower(nn.Module):
    """CLIPVisionModel's ``vision_model``: the same parameter names, so HF weights load directly."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        if not -config.num_hidden_layers <= config.feature_layer <= -1:
            raise ValueError(f"feature_layer {config.feature_layer} outside -{config.num_hidden_layers}..-1")
        self.config = config
        self.embeddings = _Embeddings(config)
        # "pre_layrnorm" is CLIP's own spelling; kept so the checkpoint keys match.
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = _Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> VisionOutput:
        """`pixels`: (batch, channels, image_size, image_size), normalised as ``preprocess_image`` does."""
        size = self.config.image_size
        if pixels.shape[-2:] != (size, size):
            raise ValueError(f"expected {size}x{size} pixels, got {tuple(pixels.shape[-2:])}")
        x = self.pre_layrnorm(self.embeddings(pixels))
        # The feature layer counted from the end; the last layer is index num_layers - 1.
        feature_index = self.config.num_hidden_layers + self.config.feature_layer
        features = x
        for index, layer in enumerate(self.encoder.layers):
            x = layer(x)
            if index == feature_index:
                features = x
        return VisionOutput(features=features[:, 1:], last_hidden_state=x, pooler_output=self.post_layernorm(x[:, 0]))


def load_clip_vision(path: str | Path, *, feature_layer: int = -2, dtype: torch.dtype = torch.float32) -> ClipVisionTower:
    """A tower from a Hugging Face directory (config.json + model.safetensors) of a CLIPVisionModel or CLIPModel."""
    root = Path(path)
    config = ClipVisionConfig.from_hf(read_hf_config(root), feature_layer=feature_layer)
    tower = ClipVisionTower(config)
    state = read_safetensors_dir(root)
    # A CLIPModel (and transformers 4's CLIPVisionModel) keeps the tower under vision_model.; transformers 5 saves it bare.
    prefix = "vision_model."
    if any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    state.pop("embeddings.position_ids", None)
    tower.load_state_dict(state, strict=True)
    return tower.to(dtype).eval()

