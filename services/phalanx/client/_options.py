"""How to generate: the sampling, stop and admission parameters of a request, as one checked value."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypedDict

from phalanx.client._errors import InvalidArgumentError
from phalanx.client._types import Tier

__all__ = ["DEFAULT_MAX_TOKENS", "GenerateOptions", "GenerateParams", "with_params"]

DEFAULT_MAX_TOKENS = 256
# SamplingParams' counts and token ids are int32 on the wire, its seed uint64.
_INT32_MAX = 2**31 - 1
_UINT64_END = 2**64
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateOptions:
    """The parameters of a generation, reusable across calls: ``client.generate(prompt, options=GenerateOptions(...))``.

    Keyword arguments of ``generate`` given beside ``options`` override its fields.
    ``stop`` may be one string; ``tier`` a Tier or its name. Checked when made
    (InvalidArgumentError naming the router's field): what cannot be sent or means
    nothing is refused here; limits of the deployment (the model's context and
    vocabulary, the router's temperature cap, a tenant's limits) are the router's.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 disables it
    top_p: float = 1.0  # 1 (or 0, read as 1) disables it
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None  # None: the router draws one and reports it on the first chunk
    ignore_eos: bool = False
    tier: Tier | str | None = None  # None: the tenant's default
    tenant: str | None = None
    # Each token's log-probability (Chunk.logprobs), of the model's raw next-token distribution (before temperature,
    # top-k and top-p); with top_logprobs (0..20) the most likely tokens' too; with prompt_logprobs the prompt's
    # tokens' as well (on the first chunk: Chunk.prompt_logprobs).
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        # A lone string is one stop string, not one per character; tuples keep the value frozen and hashable.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "tier", _tier(self.tier))
        _check(0 < self.max_tokens <= _INT32_MAX, "sampling.max_tokens", f"must be in [1, {_INT32_MAX}], got {self.max_tokens}")
        temperature_ok = math.isfinite(self.temperature) and self.temperature >= 0
        _check(temperature_ok, "sampling.temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")
        _check(0 <= self.top_k <= _INT32_MAX, "sampling.top_k", f"must be in [0, {_INT32_MAX}] (0 disables it), got {self.top_k}")
        _check(math.isfinite(self.top_p) and 0 <= self.top_p <= 1, "sampling.top_p", f"must be in [0, 1], got {self.top_p}")
        bad = [t for t in self.stop_token_ids if not 0 <= t <= _INT32_MAX]
        _check(not bad, "sampling.stop_token_ids", f"token ids are in [0, {_INT32_MAX}], got {bad[:5]}")
        _check(self.seed is None or 0 <= self.seed < _UINT64_END, "sampling.seed", f"must be in [0, 2^64), got {self.seed}")
        top = self.top_logprobs
        _check(0 <= top <= MAX_TOP_LOGPROBS, "sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        _check(self.logprobs or not top, "sampling.top_logprobs", "needs logprobs=True")
        _check(self.logprobs or not self.prompt_logprobs, "sampling.prompt_logprobs", "needs logprobs=True")


class GenerateParams(TypedDict, total=False):
    """GenerateOptions' fields as keyword arguments of ``generate`` and ``complete``."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    seed: int | None
    ignore_eos: bool
    tier: Tier | str | None
    tenant: str | None
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool


def with_params(options: GenerateOptions | None, params: GenerateParams) -> GenerateOptions:
    """``options`` (default: every field's default) with the keyword arguments given beside it taking precedence."""
    base = GenerateOptions() if options is None else options
    return replace(base, **params) if params else base


def _tier(tier: Tier | str | None) -> Tier | None:
    try:
        return None if tier is None else Tier(tier)
    except ValueError:
        choices = ", ".join(t.value for t in Tier)
        raise InvalidArgumentError(f"unknown tier {tier!r}", violations=[("tier", f"must be one of {choices}")]) from None


def _check(ok: bool, field: str, description: str) -> None:
    if not ok:
        raise InvalidArgumentError(f"{field} {description}", violations=[(field, description)])
