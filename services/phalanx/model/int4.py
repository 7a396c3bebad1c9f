"""Linear weights kept as 4-bit codes for torch's int4 CPU kernel: a decode step reads an eighth of float32's bytes.

A decode step on a CPU is bound by memory bandwidth, not arithmetic: SmolLM2-135M's linear weights take 49 ms a step
in float32 on this project's 2-core machines, 22 ms in bfloat16 and 6 ms as 4-bit codes (the same 30 layers' shapes,
measured with torch 2.13). A GGUF file already holds most weights of a model as 4-bit codes in groups of 32 with a
scale and an offset each, w = scale * q + offset (Q4_0: offset = -8 * scale; Q4_1: offset = the block's minimum;
Q4_K: scale = d * sc and offset = -dmin * m per sub-block of 32). torch's `_weight_int4pack_mm_for_cpu` computes
(q - 8) * scale + zero per group, so zero = offset + 8 * scale takes the file's codes as they are: nothing is
re-quantized, only the scale and zero are rounded to the activation dtype (bfloat16). The kernel is fast with
bfloat16 activations only (with float32 ones it takes a reference path some 15x slower than float32 dense), so the
loader packs weights only when the model runs in bfloat16 on a CPU. Each row's result depends on that row alone
whatever the number of rows (checked by tests/unit/test_int4.py), so deterministic mode keeps its promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from phalanx.model import onednn

GROUP = 32
# GGML's quantization types whose blocks are 4-bit codes with a scale and an offset per group of GROUP weights.
_Q4_0, _Q4_1, _Q4_K = 2, 3, 12
PACKABLE_GGML_TYPES = frozenset({_Q4_0, _Q4_1, _Q4_K})


@dataclass(frozen=True)
class Int4Codes:
    """A weight [out, in] as codes (uint8 0..15) with a float32 scale and offset per group of GROUP inputs."""

    codes: np.ndarray  # [out, in]
    scale: np.ndarray  # [out, in // GROUP]
    offset: np.ndarray  # [out, in // GROUP]

    def dequantized(self) -> np.ndarray:
        out, inputs = self.codes.shape
        grouped = self.codes.reshape(out, inputs // GROUP, GROUP).astype(np.float32)
        return (grouped * self.scale[..., None] + self.offset[..., None]).reshape(out, inputs)

    def rows(self, order: np.ndarray) -> Int4Codes:
        """The same weight with its output rows in `order` (groups run along the inputs, so rows move whole)."""
        return Int4Codes(self.codes[order], self.scale[order], self.offset[order])


def gguf_codes(data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Int4Codes:
    """The codes, scales and offsets of a Q4_0, Q4_1 or Q4_K tensor's raw blocks (as the `gguf` package reads them:
    uint8 [rows, bytes per row]), laid out as in gguf.quants' dequantizers."""
    out, inputs = shape
    if ggml_type not in PACKABLE_GGML_TYPES:
        raise ValueError(f"GGML type {ggml_type} has no 4-bit codes with a scale and offset per group of {GROUP}")
    if inputs % 256 and ggml_type == _Q4_K:
        raise ValueError(f"a Q4_K tensor's rows are whole super-blocks of 256, not {inputs}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(out, -1)
    if ggml_type == _Q4_K:
        return _q4_k_codes(raw, out, inputs)
    block_bytes = 18 if ggml_type == _Q4_0 else 20
    blocks = raw.reshape(out, inputs // GROUP, block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == _Q4_0:
        offset, packed = -8.0 * scale, blocks[..., 2:]
    else:
        offset, packed = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
    # Low nibbles hold a block's first 16 weights, high nibbles the next 16.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, inputs)
    return Int4Codes(codes, scale, offset)


def _q4_k_codes(raw: np.ndarray, out: int, inputs: int) -> Int4Codes:
    supers = raw.reshape(out, inputs // 256, 144)  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of codes
    d = supers[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = supers[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = supers[..., 4:16].reshape(out, inputs // 256, 3, 4)
    low, high, mixed = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1).astype(np.float32)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1).astype(np.float32)
    packed = supers[..., 16:].reshape(out, inputs // 256, 4, 32)
    # Each 32 bytes hold two sub-blocks: low nibbles the first, high nibbles the second.
    codes = np.stack([packed & 0x0F, packed >> 4], axis=3).reshape(out, inputs)
    scale = (d[..., None] * sc).reshape(out, inputs // GROUP)
    offset = -(dmin[..., None] * mins).reshape(out, inputs // GROUP)
    return Int4Codes(codes, scale, offset)


def quantize(weight: torch.Tensor) -> Int4Codes:
    """Round-to-nearest 4-bit codes between each group's minimum and maximum (Q4_1's rule): for models that come
    dense (tests, and a dense checkpoint an operator asks to serve packed)."""
    w = weight.detach().to(torch.float32).cpu().numpy()
    out, inputs = w.shape
    grouped = w.reshape(out, inputs // GROUP, GROUP)
    low, high = grouped.min(-1), grouped.max(-1)
    scale = np.where(high > low, (high - low) / 15, 1.0).astype(np.float32)
    codes = np.clip(np.rint((grouped - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return Int4Codes(codes.reshape(out, inputs), scale, low.astype(np.float32))


class Int4Weight(nn.Module):
    """A linear weight as packed codes and per-group (scale, zero): what `ops.linear` multiplies by when it is given
    one instead of a tensor. Buffers, so that `.to(dtype)` moves the scales with the activations. The packed layout
    is torch's and depends on the CPU's vector width (``packed_layout``)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in // GROUP, out, 2], the kernel's layout
        # The same weight dense in bfloat16, prepacked for oneDNN (phalanx.model.onednn), for steps of several rows; None:
        # the codes alone. Not a buffer: derived at load, it stays out of state dicts and `.to()`.
        self.dense: torch.Tensor | None = None

    @classmethod
    def from_codes(cls, codes: Int4Codes) -> Int4Weight:
        out, inputs = codes.codes.shape
        if inputs % GROUP:
            raise ValueError(f"inputs {inputs} are not whole groups of {GROUP}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.codes.astype(np.int32)), 2)
        zero = codes.offset + 8 * codes.scale
        return cls(packed, torch.from_numpy(np.stack([codes.scale, zero], axis=-1).transpose(1, 0, 2).copy()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def matmul(self, x: torch.Tensor, *, invariant: bool = False) -> torch.Tensor:
        """x [rows, in] -> [rows, out]; x must have the scales' dtype (bfloat16 where it is fast).

        From onednn.DENSE_FROM_ROWS rows by the dense copy, if there is one; in batch-invariant mode by the codes at any
        rows (the two round differently, and a sequence's tokens must not depend on its batch)."""
        if self.dense is not None and not invariant and x.shape[0] >= onednn.DENSE_FROM_ROWS:
            return onednn.matmul(x, self.dense)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


def packed_layout() -> str:
    """What the packed codes' layout depends on (torch blocks them by the CPU's vector width): a cache of packed
    weights is valid only where this is the same."""
    return f"torch-{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}"


class Int4Linear(nn.Module):
    """Stands where an nn.Linear stood: `.weight` is its Int4Weight, so `linear(x, module.weight)` call sites stay."""

    def __init__(self, weight: Int4Weight, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


def pack_linears(model: nn.Module, weights: dict[str, Int4Weight]) -> None:
    """Replaces the nn.Linear named by each key (its weight's name, e.g. ``layers.0.self_attn.q_proj.weight``) with an
    Int4Linear of that weight."""
    for weight_name, weight in weights.items():
        parent_name, _, child = weight_name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if not isinstance(old, nn.Linear) or old.weight.shape != weight.shape:
            raise ValueError(f"{weight_name}: no nn.Linear of shape {tuple(weight.shape)} to pack")
        setattr(parent, child, Int4Linear(weight, old.bias))  # a bias still on the meta device comes with the state


def is_packable(weight_name: str, shape: tuple[int, ...]) -> bool:
    """A dense linear weight the kernel can take: 2-D, inputs in whole groups, outputs a multiple of the kernel's 16."""
    return (
        weight_name.endswith("_proj.weight") and len(shape) == 2 and shape[1] % GROUP == 0 and shape[0] % 16 == 0
    )
