"""Projectors from an encoder's hidden size into the LLM's: LLaVA's two-layer MLP, with optional frame stacking for audio.

Whisper gives 1,500 positions per 30 s; stacking ``stack`` adjacent positions
before the MLP (as Qwen-Audio-style models pool) divides the LLM positions
audio takes by ``stack``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Projector"]


class Projector(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, stack: int = 1) -> None:
        super().__init__()
        if stack < 1:
            raise ValueError("stack must be at least 1")
        self.stack = stack
        self.linear_1 = nn.Linear(in_features * stack, out_features)
        self.linear_2 = nn.Linear(out_features, out_features)

    def output_length(self, positions: int) -> int:
        return -(-positions // self.stack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, positions, in) -> (batch, ceil(positions / stack), out); the last group is zero-padded."""
        if self.stack > 1:
            batch, positions, width = x.shape
            x = F.pad(x, (0, 0, 0, self.output_length(positions) * self.stack - positions))
            x = x.reshape(batch, -1, width * self.stack)
        return self.linear_2(F.gelu(self.linear_1(x)))
