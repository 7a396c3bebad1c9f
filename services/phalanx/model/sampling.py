"""Sampling parameters, their validation, and a per-request sampler whose RNG state travels with the request."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from phalanx.model.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

__all__ = ["MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "RequestSampler", "SamplingParams"]


@dataclass
class RequestSampler:
    """Samples one request's tokens from its own generator.

    Greedy decoding never touches the generator; random sampling draws from it
    exactly once per token, so restoring `state()` elsewhere continues the
    same random sequence.
    """

    params: SamplingParams
    seed: int = field(default=-1)

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def state(self) -> bytes:
        return self.generator.get_state().numpy().tobytes()

    def restore(self, state: bytes) -> None:
        """Continues from `state`; empty keeps the seeded start (a greedy request, whose generator is never drawn)."""
        if state:
            self.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 for the next position."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits).item())
        logits = logits.float().cpu() / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Keep the smallest set whose mass reaches top_p (always at least the top token).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
