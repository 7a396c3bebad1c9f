"""Sampling parameters, their validation, and a per-request sampler whose RNG state travels with the request."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

from phalanx.common.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequestError naming the first field that is wrong."""
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError("sampling.temperature", f"must be in [0, 100] (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise InvalidRequestError("sampling.max_tokens", f"must be > 0, got {self.max_tokens}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError("sampling.stop_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidRequestError("sampling.stop_strings", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_strings)}")
        for s in self.stop_strings:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("sampling.stop_strings", f"each stop string needs 1..{MAX_STOP_STRING_CHARS} characters")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("sampling.seed", "must be in [0, 2^63)")


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
        return bytes(self.generator.get_state().tolist())

    def restore(self, state: bytes) -> None:
        self.generator.set_state(torch.tensor(list(state), dtype=torch.uint8))

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
