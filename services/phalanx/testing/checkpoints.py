"""Tiny random Hugging Face checkpoints of each architecture we serve, saved with transformers (a test dependency).

Tests load them with `phalanx.model.load` and compare with transformers' own forward on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 300
# Llama 3.x rope scaling with an original context small enough that the tiny heads' frequencies fall in all three
# bands (kept, divided, smoothed).
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Small enough for seconds per test, with GQA (4 query heads over 2 KV heads) and a head_dim that is not hidden/heads
# where the architecture allows it, so a loader that derives head_dim gets the wrong shapes.
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
# Scaling the default init up makes logits far from uniform; by 4 the float32 noise between two correct
# implementations stays far below the tests' 1e-4 (by 8, an expert's rows batched in another order already show).
WEIGHT_SCALE = 4.0


def tiny_config(architecture: str, **overrides: Any):
    """A transformers config: llama, qwen2, qwen3 or qwen3_moe (4 experts, top 2, experts of 48)."""
    import transformers

    if architecture == "llama":
        return transformers.LlamaConfig(**{**_COMMON, **overrides})
    if architecture == "qwen2":
        return transformers.Qwen2Config(**{**_COMMON, **overrides})
    if architecture == "qwen3":
        return transformers.Qwen3Config(**{**_COMMON, "head_dim": 32, **overrides})
    if architecture == "qwen3_moe":
        moe = dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
        return transformers.Qwen3MoeConfig(**{**_COMMON, **moe, **overrides})
    raise ValueError(f"no tiny {architecture!r}")


def tiny_model(architecture: str, *, seed: int = 0, **overrides: Any):
    """A random transformers model of `architecture` in eval mode, weights scaled by WEIGHT_SCALE."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(architecture, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(WEIGHT_SCALE)
    return model


def save_tiny_checkpoint(path: Path, architecture: str, *, seed: int = 0, **overrides: Any):
    """Saves a tiny model's safetensors and config.json under `path`; returns the transformers model."""
    model = tiny_model(architecture, seed=seed, **overrides)
    model.save_pretrained(path)
    return model


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), vocab] for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()
