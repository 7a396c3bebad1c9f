"""Sampling parameters, their validation, and a per-request sampler whose RNG state travels with the request."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx.model.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "RequestSampler", "SamplingParams"]


@dataclass
class RequestSampler:
    """Samples one request's tokens from its own generator.

    Greedy decoding never touches the generator; random sampling draws from it
    exactly once per token, so restoring `state()` elsewhere continues the
    same random sequence. The generator (and torch) comes with the first draw:
    until then the state is the seed's start, written as empty bytes, and the
    simulated engine, which never draws, never imports torch.
    """

    params: SamplingParams
    seed: int = field(default=-1)

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self._generator: Any = None
        self._restored = b""  # a state restored before the generator exists

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            import torch

            self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
            if self._restored:
                self._generator.set_state(torch.frombuffer(bytearray(self._restored), dtype=torch.uint8))
        return self._generator

    def state(self) -> bytes:
        if self._generator is None:
            return self._restored  # never drawn from here: the seeded start (empty) or the state it was restored to
        return self._generator.get_state().numpy().tobytes()

    def restore(self, state: bytes) -> None:
        """Continues from `state`; empty keeps the seeded start (a greedy request, whose generator is never drawn)."""
        if not state:
            return
        if self._generator is None:
            self._restored = bytes(state)
        else:
            import torch

            self._generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 for the next position."""
        import torch

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
