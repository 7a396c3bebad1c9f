"""Canary expectations: calibrating them on healthy workers and judging answers. Pure logic, no I/O.

A canary is a short greedy generation through the worker's normal
scheduler. Calibration runs candidate prompts on up to
``calibration_workers`` workers of one model version, twice each, and keeps
the prompts on which a majority of workers agree token for token and whose
greedy choices win by a clear margin (a near-tie could flip with harmless
rounding and raise false alarms). The margin follows the dtype the workers
compute in (``required_margin``); a prompt keeps the tokens up to its first
near-tie, as a greedy token depends only on those before it. The expected
tokens and the range of top logits seen are stored in etcd per model
version and compute dtype (CanaryGroup) and reused.

Agreement alone cannot tell a real model that is wrong everywhere (a bad
conversion, corrupt weights on every worker) from a right one. A model
with a real vocabulary therefore has known facts (CANARY_FACTS, by model
name): calibration asks each fact's prompt and keeps it only if the
majority answer decodes to the fact's answer; a worker that answers
otherwise is a dissenter. Random-weight models have no facts and keep the
agreement calibration.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from phalanx._proto import common_pb2
from phalanx.health.state import CheckOutcome, FailureReason

__all__ = [
    "CANARY_FACTS", "CANDIDATE_PROMPTS", "CalibrationResult", "CanaryFact", "CanaryGroup", "CanaryRun", "calibrate", "canary_facts",
    "judge", "logit_ulp", "required_margin", "worker_compute_dtype",
]

# Varied, plain prompts; calibration keeps the steadiest of them.
CANDIDATE_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The three primary colors are red, blue and",
    "Water boils at one hundred degrees",
    "In 1969 the first humans walked on the",
    "A quick brown fox jumps over the lazy",
    "SELECT name, email FROM users WHERE",
    "The mitochondria is the powerhouse of the",
    "To be, or not to be, that is the",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "Dear customer, thank you for your",
)
_MIN_ABS_LOGIT_TOLERANCE = 0.05

# Explicit mantissa bits of the dtypes an engine may compute in (torch's names). An unknown name counts as bfloat16,
# the coarsest an engine computes in today.
_MANTISSA_BITS = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}
_DEFAULT_MANTISSA_BITS = _MANTISSA_BITS["bfloat16"]


def worker_compute_dtype(registration: common_pb2.WorkerRegistration) -> str:
    """The dtype a worker computes in; an older worker says it only as its KV dtype (the model's), an older still not at all."""
    return registration.compute_dtype or registration.kv_dtype or "float32"


@dataclass(frozen=True, order=True)
class CanaryGroup:
    """Workers that share canary expectations: one model version computed in one dtype (greedy tokens differ between dtypes)."""

    model_version: str
    compute_dtype: str

    @classmethod
    def of_worker(cls, registration: common_pb2.WorkerRegistration) -> CanaryGroup:
        return cls(registration.model_version, worker_compute_dtype(registration))

    @classmethod
    def of_calibration(cls, calibration: common_pb2.CanaryCalibration) -> CanaryGroup:
        return cls(calibration.model_version, calibration.compute_dtype)


def logit_ulp(dtype: str, value: float) -> float:
    """The spacing of ``dtype``'s numbers at ``value``'s magnitude (bfloat16: 0.125 from 16 to 32)."""
    _, exponent = math.frexp(value)  # value = m * 2**exponent, 0.5 <= |m| < 1
    return math.ldexp(1.0, exponent - 1 - _MANTISSA_BITS.get(dtype, _DEFAULT_MANTISSA_BITS))


def required_margin(dtype: str, top_logit: float, *, min_margin: float, margin_ulps: float) -> float:
    """The greedy margin a canary position needs: max(min_margin, margin_ulps * ulp(dtype, |top logit|)).

    The two logits compared are each rounded to ``dtype`` (half an ulp of their magnitude, one ulp in their difference)
    and carry the rounding of every layer before them, which another kernel rounds otherwise. Measured in bfloat16:
    smollm2's " Paris" margin (2.5 at logit 17) is 0.2 ulp from float32's, while a lone decode's kernel against a full
    batch's moved a random-weight 4-layer model's margins (logits near 3, small beside its hidden states) by up to 19
    ulps. Canaries therefore compute batch-invariant (worker/engine.py), so one worker's answer does not depend
    on its batch; the margin covers the rounding itself and what differs between workers' kernels: 8 ulps by default
    (bfloat16 at logits of 16-32: 1.0). In float32 the ulps are negligible and ``min_margin`` rules.
    """
    return max(min_margin, margin_ulps * logit_ulp(dtype, top_logit))


@dataclass(frozen=True)
class CanaryFact:
    """A prompt whose greedy answer a working model knows: its first ``tokens`` generated tokens decode to ``answer``."""

    prompt: str
    answer: str
    # How many tokens the answer is in this model's vocabulary (known per model, as the table is).
    tokens: int = 1


# Known facts by model name (the worker registration's `model`). A model not listed calibrates by agreement only.
CANARY_FACTS: dict[str, tuple[CanaryFact, ...]] = {
    "smollm2-135m-instruct": (CanaryFact("The capital of France is", " Paris"),),
}


def canary_facts(model: str) -> tuple[CanaryFact, ...]:
    return CANARY_FACTS.get(model, ())


@dataclass(frozen=True)
class CanaryRun:
    """One Canary answer of one worker."""

    worker_id: str
    prompt: str
    token_ids: tuple[int, ...]
    top_logits: tuple[float, ...]
    top_margins: tuple[float, ...]
    text: str = ""


@dataclass(frozen=True)
class CalibrationResult:
    calibration: common_pb2.CanaryCalibration | None  # None: no prompt qualified
    # Workers whose answers differ from the majority, with why: they are suspect from the start.
    dissenters: dict[str, str]
    rejected: dict[str, str]  # prompt -> why it was not kept


def calibrate(
    model_version: str,
    model: str,
    runs: Iterable[CanaryRun],
    *,
    prompts_wanted: int,
    min_margin: float,
    margin_ulps: float = 0.0,
    compute_dtype: str = "float32",
    facts: Sequence[CanaryFact] = (),
    now: float | None = None,
) -> CalibrationResult:
    """The calibration of one model version from its workers' runs.

    With ``facts``, only the facts' prompts count, and one is kept only if
    the majority answers it right; a worker that answers it wrong dissents.
    ``compute_dtype`` (the runs' workers') and ``margin_ulps`` set the
    margin each position needs with ``min_margin``.
    """
    margin = _MarginRule(compute_dtype, min_margin, margin_ulps)
    answers = {fact.prompt: fact.answer for fact in facts}
    by_prompt: dict[str, list[CanaryRun]] = defaultdict(list)
    for run in runs:
        if not answers or run.prompt in answers:
            by_prompt[run.prompt].append(run)
    cases: list[common_pb2.CanaryCase] = []
    dissenters: dict[str, str] = {}
    rejected: dict[str, str] = {}
    workers: set[str] = set()
    order = [fact.prompt for fact in facts] if facts else list(CANDIDATE_PROMPTS)
    for prompt in sorted(by_prompt, key=lambda p: order.index(p) if p in order else len(order)):
        prompt_runs = by_prompt[prompt]
        workers.update(r.worker_id for r in prompt_runs)
        if prompt in answers:
            case, why, odd = _calibrate_fact(prompt, answers[prompt], prompt_runs, margin)
        else:
            case, why, odd = _calibrate_prompt(prompt, prompt_runs, margin)
        for worker_id, why_odd in odd.items():
            dissenters.setdefault(worker_id, why_odd)
        if case is None:
            rejected[prompt] = why
        elif len(cases) < prompts_wanted:
            cases.append(case)
    if not cases:
        return CalibrationResult(None, dissenters, rejected)
    calibration = common_pb2.CanaryCalibration(
        model_version=model_version, model=model, cases=cases, calibrated_on=sorted(workers - set(dissenters)),
        calibrated_at=time.time() if now is None else now, compute_dtype=compute_dtype,
    )
    return CalibrationResult(calibration, dissenters, rejected)


@dataclass(frozen=True)
class _MarginRule:
    dtype: str
    min_margin: float
    margin_ulps: float

    def at(self, top_logit: float) -> float:
        return required_margin(self.dtype, top_logit, min_margin=self.min_margin, margin_ulps=self.margin_ulps)


def _calibrate_fact(
    prompt: str, answer: str, runs: Sequence[CanaryRun], margin: _MarginRule
) -> tuple[common_pb2.CanaryCase | None, str, dict[str, str]]:
    """Agreement calibration of a fact's prompt on the workers that answer it right; the truth outvotes any majority."""
    wrong = {r.worker_id: f"answered {prompt!r} with {r.text!r}, not {answer!r}" for r in runs if r.text != answer}
    right = [r for r in runs if r.worker_id not in wrong]
    if not right:
        return None, f"no worker answers {prompt!r} with {answer!r}", wrong
    case, why, odd = _calibrate_prompt(prompt, right, margin)
    return case, why, {**wrong, **odd}


def _calibrate_prompt(prompt: str, runs: Sequence[CanaryRun], margin: _MarginRule) -> tuple[common_pb2.CanaryCase | None, str, dict[str, str]]:
    """The case for one prompt (or None and why), and the workers that disagree with the majority (and why)."""
    answers: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for run in runs:
        answers[run.worker_id].add(run.token_ids)
    if any(len(a) > 1 for a in answers.values()):
        unsteady = sorted(w for w, a in answers.items() if len(a) > 1)
        return None, f"repeated runs on {unsteady} gave different tokens", {}
    votes = Counter(next(iter(a)) for a in answers.values())
    tokens, count = votes.most_common(1)[0]
    if count * 2 <= len(answers) and len(answers) > 1:
        return None, f"no majority among {len(answers)} workers", {}
    odd = {w: f"answered {prompt!r} unlike the majority" for w, a in answers.items() if tokens not in a}
    agreeing = [r for r in runs if r.token_ids == tokens]
    positions = 0  # the tokens before the first near-tie: each depends only on those before it
    for i in range(len(tokens)):
        won_by = min(r.top_margins[i] if i < len(r.top_margins) else 0.0 for r in agreeing)
        needed = margin.at(max(abs(r.top_logits[i]) if i < len(r.top_logits) else 0.0 for r in agreeing))
        if won_by < needed:
            if positions == 0:
                return None, f"greedy margin {won_by:.4f} at the first token below {needed:.4f} ({margin.dtype})", odd
            break
        positions += 1
    case = common_pb2.CanaryCase(
        prompt_text=prompt,
        expected_token_ids=tokens[:positions],
        top_logit_min=[min(r.top_logits[i] for r in agreeing) for i in range(positions)],
        top_logit_max=[max(r.top_logits[i] for r in agreeing) for i in range(positions)],
    )
    return case, "", odd


def judge(case: common_pb2.CanaryCase, token_ids: Sequence[int], top_logits: Sequence[float], latency_s: float, *, tolerance: float) -> CheckOutcome:
    """PASS, or FAIL with token_mismatch / logit_out_of_range (latency is the tracker's business)."""
    expected = list(case.expected_token_ids)
    got = list(token_ids)
    if got != expected:
        at = next((i for i, (e, g) in enumerate(zip(expected, got, strict=False)) if e != g), min(len(expected), len(got)))
        return CheckOutcome.failed(
            FailureReason.TOKEN_MISMATCH, f"{case.prompt_text[:24]!r}: position {at} expected {expected[at:at + 1]} got {got[at:at + 1]}", latency_s
        )
    for i, value in enumerate(top_logits):
        lo, hi = case.top_logit_min[i], case.top_logit_max[i]
        slack = max(_MIN_ABS_LOGIT_TOLERANCE, tolerance * max(abs(lo), abs(hi)))
        if not lo - slack <= value <= hi + slack:
            return CheckOutcome.failed(
                FailureReason.LOGIT_OUT_OF_RANGE,
                f"{case.prompt_text[:24]!r}: top logit {value:.3f} at position {i} outside [{lo - slack:.3f}, {hi + slack:.3f}]",
                latency_s,
            )
    return CheckOutcome.passed(latency_s)
