"""RoPE inverse frequencies, plain or scaled, computed as transformers computes them (modeling_rope_utils)."""

from __future__ import annotations

import math

import torch

from phalanx.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """inv_freq [head_dim / 2] (float32): transformers' default, linear or llama3 parameters, or a GGUF's rope_freqs divisors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":
        # llama.cpp divides each frequency by its factor (ggml_rope_ext's freq_factors).
        if len(scaling.freq_factors) != inv_freq.shape[0]:
            raise ValueError(f"rope_freqs has {len(scaling.freq_factors)} factors, the heads need {inv_freq.shape[0]}")
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32, device=device)
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # The same operations in the same order as transformers' _compute_llama3_parameters, so the tables match bit for bit.
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)
