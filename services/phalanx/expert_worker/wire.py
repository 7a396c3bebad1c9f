"""What an attention worker and an expert worker exchange per (layer, step) over their tensor channel.

AW -> EW: a header of `header_len(num_experts)` int64s (layer, rows, groups,
invariant, then (expert, rows) per group), then the activations
[rows, hidden] in the model's dtype, grouped by expert in the header's
order. EW -> AW: the expert outputs [rows, hidden], in the same order. The
header has a fixed size, so each side preallocates what it receives; the
channel's order pairs each reply with its request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.model.expert_split import ExpertBatch

_FIXED = 4


def header_len(num_experts: int) -> int:
    return _FIXED + 2 * num_experts


@dataclass(frozen=True)
class ExpertCall:
    """One layer's expert work for one EW: the experts and how many rows each."""

    layer: int
    experts: tuple[int, ...]
    counts: tuple[int, ...]
    invariant: bool

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def header(self, num_experts: int) -> torch.Tensor:
        header = torch.zeros(header_len(num_experts), dtype=torch.int64)
        header[:_FIXED] = torch.tensor([self.layer, self.rows, len(self.experts), int(self.invariant)])
        for i, (expert, count) in enumerate(zip(self.experts, self.counts, strict=True)):
            header[_FIXED + 2 * i] = expert
            header[_FIXED + 2 * i + 1] = count
        return header

    @classmethod
    def parse(cls, header: torch.Tensor) -> ExpertCall:
        values = header.tolist()
        layer, _, groups, invariant = values[:_FIXED]
        pairs = values[_FIXED : _FIXED + 2 * groups]
        return cls(layer, tuple(pairs[0::2]), tuple(pairs[1::2]), bool(invariant))

    def batches(self, activations: torch.Tensor) -> list[ExpertBatch]:
        """The received activations cut into one batch per expert."""
        return [ExpertBatch(e, rows) for e, rows in zip(self.experts, activations.split(list(self.counts)), strict=True)]


def pack(layer: int, batches: list[ExpertBatch], invariant: bool) -> tuple[ExpertCall, torch.Tensor]:
    """The call and its activations [rows, hidden] (contiguous), for one EW."""
    call = ExpertCall(layer, tuple(b.expert for b in batches), tuple(b.rows.shape[0] for b in batches), invariant)
    return call, torch.cat([b.rows for b in batches]).contiguous()
