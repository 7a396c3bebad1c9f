"""Replica maths: how many workers the next interval needs. Pure, no I/O.

Dynamo's formulas, per interval of `interval_s` seconds with `requests` predicted arrivals:

    prefill = ceil(requests * ISL / interval * min(1, p_corr) / prefill_thpt_per_gpu(ISL) / gpus_per_worker)
    decode  = ceil(requests * OSL / interval / best_thpt_per_gpu(itl_target / d_corr, ISL + OSL / 2) / gpus_per_worker)

each plus `failure_reserve` k (N+k: the SLOs still hold after k workers are lost) and floored at `min_workers`, then,
when prefill + decode workers need more GPUs than `max_gpus`, both
scaled by max_gpus / needed and rounded down (so the budget holds unless the minimums alone exceed it).
min(1, p_corr) is Dynamo's: a prefill factor above 1 is mostly queueing, which more prefill workers of the
same speed would not shorten; a factor below 1 (the fleet is faster than profiled) does lower demand.

Quantile planning (what Dynamo's mean-based plan gets wrong). ISL and OSL play two parts in those
formulas, and the mean is right for only one:

- volume: tokens to process per second = requests x mean length / interval. Sums are what the fleet
  must process, so the mean stays here;
- operating point: the per-GPU throughput the profile allows, prefill_thpt(ISL) and best_thpt(ITL
  target, context). That depends on the lengths of the requests actually in a batch, and a mean of a
  bimodal or heavy-tailed mix describes no request: 90 % chats of 200 tokens and 10 % documents of 8000
  average 980 tokens, a context at which a worker's best decode throughput under the ITL target is far
  higher than with the documents in its batch, so a mean plan meets the SLO only for batches without
  documents. Here the operating point is read at the `length_quantile` (p90 by default) of ISL and of
  OSL (context = ISL_q + OSL_q / 2), never below the mean: the throughput is what a batch holding the
  long requests sustains, so the ITL target holds for the requests up to that quantile. With
  `length_quantile=None` the plan is Dynamo's exactly.

The plan also says whether the SLOs are reachable at all: a quantile prompt whose prefill alone takes
longer than the TTFT target, or an ITL target no concurrency meets, is not fixed by more workers (it needs
chunked prefill or a faster worker); the planner still plans the volume and reports it.

Aggregated workers (Phalanx's: one worker prefills and decodes, interleaved in its continuous batch). The
two constraints share the same workers' GPU time, so the combined count adds the two fractional needs
before rounding up:

    combined = max(min_workers, ceil(prefill_raw + decode_raw))

where *_raw are the unrounded worker-equivalents of the formulas above. The model is time-sharing: a
worker spending a fraction f of its time on prefill decodes at (1 - f) of its profiled decode throughput,
which is how a continuous batch that interleaves prefill chunks with decode steps behaves to first order
(each step's time is roughly its prefill work plus its decode work). max(prefill, decode) would assume
prefill and decode overlap for free and under-provision; prefill + decode after rounding each would
round twice and over-provision by up to one worker. The combined count is budgeted like the others:
at most max_gpus // gpus_per_worker workers.

Degradation: from `relaxed_slo_level` (3) on, the deployment promises latency SLOs x `relaxed_slo_factor`
(2), so the plan targets the relaxed SLOs, as the routers' SLO accounting does (health/degradation.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.planner.correction import CorrectionFactors
from phalanx.planner.distribution import Summary
from phalanx.planner.profile import PerformanceProfile

# Worker-equivalents within this of a whole number count as that number: 3.0000000001 workers is 3.
_ROUNDING_SLACK = 1e-9


@dataclass(frozen=True)
class LoadForecast:
    """The next interval's predicted load: arrivals, and the distribution of their input and output lengths."""

    requests: float
    isl: Summary
    osl: Summary


@dataclass(frozen=True)
class SloTargets:
    """Latency SLOs in force at degradation level 0."""

    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class ReplicaConfig:
    interval_s: float
    min_workers: int = 1
    # GPUs the fleet may use in all; None: no budget.
    max_gpus: int | None = None
    # Quantile of ISL and OSL the operating point is read at; None: the mean (Dynamo's behaviour).
    length_quantile: float | None = 0.9
    relaxed_slo_level: int = 3
    relaxed_slo_factor: float = 2.0
    # N+k: workers planned beyond what the SLOs need, so that they still hold after this many serving workers are lost
    # (each pool gets them: any k losses may fall on one pool). Unlike hot spares, these serve.
    failure_reserve: int = 0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.min_workers < 0 or self.failure_reserve < 0:
            raise ValueError("interval_s must be > 0, min_workers and failure_reserve >= 0")
        if self.max_gpus is not None and self.max_gpus < 1:
            raise ValueError("max_gpus must be >= 1 when set")
        if self.length_quantile is not None and not 0 < self.length_quantile < 1:
            raise ValueError("length_quantile must be in (0, 1) or None")


@dataclass(frozen=True)
class ReplicaPlan:
    """Worker counts for the next interval, and the figures they came from (for metrics and dry runs)."""

    prefill: int
    decode: int
    # Aggregated workers (prefill and decode on the same workers): what Phalanx deploys.
    combined: int
    prefill_raw: float
    decode_raw: float
    planning_isl: float
    planning_osl: float
    planning_context: float
    ttft_target_s: float
    itl_target_s: float
    budget_limited: bool
    ttft_reachable: bool
    itl_reachable: bool


def planning_length(summary: Summary, quantile: float | None) -> float:
    """The length the operating point is read at: the quantile, never below the mean (a heavy tail can put
    the mean above p90, and the plan should never be less careful than Dynamo's)."""
    if quantile is None:
        return summary.mean
    return max(summary.quantile(quantile), summary.mean)


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _ROUNDING_SLACK))


def plan_replicas(
    forecast: LoadForecast,
    profile: PerformanceProfile,
    slo: SloTargets,
    config: ReplicaConfig,
    factors: CorrectionFactors | None = None,
    *,
    degradation_level: int = 0,
) -> ReplicaPlan:
    """The module docstring's formulas for one interval."""
    factors = factors or CorrectionFactors()
    gpus = profile.gpus_per_worker
    slo_factor = config.relaxed_slo_factor if degradation_level >= config.relaxed_slo_level else 1.0
    ttft_target = slo.ttft_s * slo_factor
    requests = max(forecast.requests, 0.0)

    isl = planning_length(forecast.isl, config.length_quantile)
    osl = planning_length(forecast.osl, config.length_quantile)
    context = isl + osl / 2.0

    prefill_tokens_per_s = requests * forecast.isl.mean / config.interval_s * min(1.0, factors.prefill)
    prefill_raw = prefill_tokens_per_s / profile.prefill_throughput_per_gpu(isl) / gpus

    itl_target = slo.itl_s * slo_factor / factors.decode
    decode_point = profile.best_decode(itl_target, context)
    decode_tokens_per_s = requests * forecast.osl.mean / config.interval_s
    decode_raw = decode_tokens_per_s / decode_point.tokens_per_s_per_gpu / gpus

    floor, reserve = config.min_workers, config.failure_reserve
    prefill = max(floor, _ceil(prefill_raw) + reserve)
    decode = max(floor, _ceil(decode_raw) + reserve)
    combined = max(floor, _ceil(prefill_raw + decode_raw) + reserve)

    budget_limited = False
    if config.max_gpus is not None:
        needed = (prefill + decode) * gpus
        if needed > config.max_gpus:
            scale = config.max_gpus / needed
            prefill = max(floor, math.floor(prefill * scale))
            decode = max(floor, math.floor(decode * scale))
            budget_limited = True
        if combined * gpus > config.max_gpus:
            combined = max(floor, config.max_gpus // gpus)
            budget_limited = True

    return ReplicaPlan(
        prefill=prefill,
        decode=decode,
        combined=combined,
        prefill_raw=prefill_raw,
        decode_raw=decode_raw,
        planning_isl=isl,
        planning_osl=osl,
        planning_context=context,
        ttft_target_s=ttft_target,
        itl_target_s=itl_target,
        budget_limited=budget_limited,
        ttft_reachable=profile.prefill_ttft(isl) <= ttft_target,
        itl_reachable=decode_point.meets_target,
    )
