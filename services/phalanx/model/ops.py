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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from phalanx.model import onednn

if TYPE_CHECKING:
    from phalanx.model.int4 import Int4Weight

# Query rows per attention tile in batch-invariant mode (one KV block).
INVARIANT_TILE = 16
INVARIANT_MIN_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Weight, *, invariant: bool) -> torch.Tensor:
    """x @ weight.T, for a dense weight, one prepacked for oneDNN (phalanx.model.onednn) or one packed as 4-bit codes
    (phalanx.model.int4)."""
    rows = x.shape[0]
    if not invariant or rows >= INVARIANT_MIN_ROWS:
        return _multiply(x, weight, invariant)
    x_padded = torch.zeros((INVARIANT_MIN_ROWS, x.shape[1]), dtype=x.dtype, device=x.device)
    x_padded[:rows] = x
    return _multiply(x_padded, weight, invariant)[:rows]


def _multiply(x: torch.Tensor, weight: torch.Tensor | Int4Weight, invariant: bool) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        return weight.matmul(x, invariant=invariant)
    return onednn.matmul(x, weight) if weight.is_mkldnn else F.linear(x, weight)


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): there, bfloat16 halves a step's bytes at
    full speed; elsewhere torch emulates it, slower than float32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def auto_dtype(device: str) -> torch.dtype:
    """The dtype an engine computes in unless told: bfloat16 on an accelerator and on a CPU that multiplies it in
    hardware; float32 on other CPUs. Attention and expert workers both follow it, so that their exchanges agree."""
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF's MixtralRMSNorm / LlamaRMSNorm.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_tables(
    head_dim: int, max_positions: int, theta: float, device: torch.device, *, inv_freq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim]; ``inv_freq`` replaces the plain frequencies (scaled RoPE, model/rope.py)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rope_rows(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, signed sin) rows `apply_rope` takes for tokens at `positions`, [tokens, 1, head_dim] in `dtype`: made once a
    step for every layer's q and k (two casts and reshapes per call were a tenth of a batch-1 CPU step's small ops). sin's
    first half is negated here, so that rotating x needs no negation: (-x2) * s equals x2 * (-s) exactly."""
    cos, sin = cos_table[positions].unsqueeze(1).to(dtype), sin_table[positions].unsqueeze(1).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/signed_sin: `rope_rows` (HF's x * cos + rotate_half(x) * sin)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
