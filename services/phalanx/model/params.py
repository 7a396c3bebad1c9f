"""Sampling parameters and their validation, importable without torch (the router validates with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.common.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# OpenAI's bound on top_logprobs (chat completions); the legacy completions API allows 5.
MAX_TOP_LOGPROBS = 20


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
    # Log-probabilities (of the model's raw next-token distribution) of each generated token, the top_logprobs most
    # likely alternatives at each position, and with prompt_logprobs those of the prompt's tokens too.
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False

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
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if (self.top_logprobs or self.prompt_logprobs) and not self.logprobs:
            name = "top_logprobs" if self.top_logprobs else "prompt_logprobs"
            raise InvalidRequestError(f"sampling.{name}", "needs sampling.logprobs")


def sampling_from_proto(p) -> SamplingParams:
    """From a phalanx.common.v1.SamplingParams message (top_p 0 reads as 1.0, as the proto says)."""
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        max_tokens=p.max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        stop_strings=tuple(p.stop_strings),
        seed=p.seed if p.HasField("seed") else None,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        prompt_logprobs=p.prompt_logprobs,
    )
