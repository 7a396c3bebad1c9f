"""The pre-norm transformer block that CLIP's vision tower and Whisper's encoder share.

Parameter names follow Hugging Face's (``self_attn.q_proj``, ``mlp.fc1`` …) so
a checkpoint's state dict loads with a prefix rename and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "EncoderAttention", "quick_gelu"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"quick_gelu": quick_gelu, "gelu": _gelu}


class EncoderAttention(nn.Module):
    """Bidirectional multi-head self-attention (no mask: every position sees every other)."""

    def __init__(self, hidden: int, heads: int, *, key_bias: bool = True) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        # Whisper's key projection has no bias; CLIP's has one.
        self.k_proj = nn.Linear(hidden, hidden, bias=key_bias)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        shape = (batch, length, self.heads, hidden // self.heads)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))
