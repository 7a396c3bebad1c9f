"""Numerical building blocks, with a batch-invariant mode.

CPU GEMM kernels pick their blocking by the number of rows: a row's result
for M=1..3 differs in the last bits from M>=4, while every M from 4 to 4096
gives bit-identical rows (measured on torch 2.13 CPU, oneDNN/MKL), so a
sequence's logits would depend on how many others share its batch. In
batch-invariant mode every matmul runs on at least INVARIANT_MIN_ROWS rows
(padding small batches), where a row's result depends on that row alone.
The unit tests that compare batched, chunked, preempted and prefix-cached
runs with solo runs bit for bit guard this on the machine they run on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Query rows per attention tile in batch-invariant mode (one KV block).
INVARIANT_TILE = 16
INVARIANT_MIN_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, *, invariant: bool) -> torch.Tensor:
    if not invariant:
        return F.linear(x, weight)
    rows = x.shape[0]
    if rows >= INVARIANT_MIN_ROWS:
        return F.linear(x, weight)
    x_padded = torch.zeros((INVARIANT_MIN_ROWS, x.shape[1]), dtype=x.dtype, device=x.device)
    x_padded[:rows] = x
    return F.linear(x_padded, weight)[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF's MixtralRMSNorm / LlamaRMSNorm.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_tables(head_dim: int, max_positions: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (float32)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotated * sin
