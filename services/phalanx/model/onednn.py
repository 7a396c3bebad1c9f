"""bfloat16 linear weights prepacked in oneDNN's blocked layout, for CPU steps of several rows.

`F.linear` hands oneDNN a plain [out, in] bfloat16 weight, which its matmul reorders into its blocked layout on every
call; reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`), the same matmul skips that. Measured with
torch 2.13 on this project's 2-core AVX512-BF16 machines, one thread, SmolLM2-135M's 30 layers of projections:

| rows | int4 kernel | F.linear, bfloat16 | prepacked |
| --- | --- | --- | --- |
| 1 | 7.1 ms | 18.8 ms | 9.1 ms |
| 8 | 24.3 ms | 27.1 ms | 15.7 ms |
| 16 | 46.1 ms | 37.5 ms | 28.3 ms |
| 32 | 91.4 ms | 63.1 ms | 50.9 ms |

and its tied LM head 3.2 ms at 1 row against 8.1 for F.linear. The int4 kernel unpacks the codes for every row, so it
wins at one row (an eighth of the bytes) and loses from four on. A prepacked product is bit-identical to F.linear's with
the same weight, and each row's result depends on that row alone (tests/unit/test_onednn.py), so deterministic mode keeps
its promise on it.
"""

from __future__ import annotations

import torch

# From this many rows a step multiplies a 4-bit weight by its prepacked bfloat16 copy (the table above: 12.0 ms against
# 11.5 at 4 rows, 7.1 against 9.1 at 1).
DENSE_FROM_ROWS = 4


def available() -> bool:
    """Whether this CPU multiplies prepacked bfloat16 weights in hardware (elsewhere oneDNN emulates it, slowly)."""
    from phalanx.model.ops import cpu_has_native_bfloat16  # ops multiplies by packed weights: imported here, not above

    return torch.backends.mkldnn.is_available() and cpu_has_native_bfloat16()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight as a bfloat16 oneDNN tensor in its blocked layout (an opaque tensor: only `matmul` reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous())


def matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (bfloat16) -> [rows, out]: x @ weight.T with a weight from `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
