"""Correction factors: how far the live fleet is from its profile. Pure, no I/O.

Dynamo divides the observed latency by the profile's expectation for the load the fleet carried:

    prefill = observed_ttft / expected_ttft      decode = observed_itl / expected_itl

and the replica maths scales the prefill demand by min(1, prefill) and tightens the ITL target by
1 / decode. Its design notes say the factors oscillate during ramps: more load than the profile expects
raises the factor, the planner over-provisions, latencies drop below the profile, the factor falls under
1, the planner under-provisions, and so on, because each interval's raw ratio is acted on at once. Here:

- the factor is an exponential moving average of the ratio, taken in log space (a halving and a doubling
  average to 1, as they should, where a plain average would drift up), with weight `smoothing` on the
  newest interval: a factor the planner reacts to can move only part of the way per interval, which damps
  the loop above (with the default 0.3 a loop gain of -2 that makes raw factors diverge converges);
- every ratio and the factor are clamped to [min_factor, max_factor]: one stalled interval (a GC pause, a
  migration) must not triple the fleet;
- an interval with too few latency samples (idle, or a few requests) leaves the factor as it was;
- so does, for the decode factor, an interval whose fleet ran well below the concurrency the plan sizes it for
  (`min_decode_load`): there the expectation, the profile's ITL at the mean concurrency Little's law gives,
  is not what the tokens saw. A token always shares its step with its own sequence and, when requests come
  at random, more tokens come from the busier moments, so at a mean of one sequence per worker a fleet that
  steps exactly as profiled shows about 1.26 x the expected ITL (Poisson arrivals, the bench profile), at
  half its operating concurrency 1.1, at the operating point 1.06. Learnt from an idle-ish fleet, that
  ratio tightened the ITL target, the plan added workers, the fleet got idler and the ratio stayed: the planner
  bench's simulated workers, which step as profiled, held a decode factor of 1.2-1.5, worth half a worker on
  average in the offline breakdown (docs/results/, the sixth and seventh planner passes);
- `enabled=False` (`--no-correction`) pins both factors to 1: plan from the profile alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.planner.profile import PerformanceProfile


@dataclass(frozen=True)
class CorrectionConfig:
    enabled: bool = True
    min_factor: float = 0.5
    max_factor: float = 3.0
    # Weight of the newest interval's ratio in the moving average (1.0: no smoothing, Dynamo's behaviour).
    smoothing: float = 0.3
    # Intervals with fewer first tokens (prefill) or token gaps (decode) than this do not move the factor.
    min_samples: float = 10.0
    # Intervals whose concurrency per worker was below this fraction of the plan's operating concurrency do not move the
    # decode factor (0: every interval does).
    min_decode_load: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.min_factor <= 1.0 <= self.max_factor:
            raise ValueError(f"need 0 < min_factor <= 1 <= max_factor, got [{self.min_factor}, {self.max_factor}]")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 <= self.min_decode_load <= 1:
            raise ValueError(f"min_decode_load must be in [0, 1], got {self.min_decode_load}")


@dataclass(frozen=True)
class CorrectionFactors:
    """Observed over expected latency; 1.0 means the fleet performs as profiled."""

    prefill: float = 1.0
    decode: float = 1.0


class _SmoothedRatio:
    def __init__(self, config: CorrectionConfig) -> None:
        self.config = config
        self._log_factor = 0.0

    @property
    def value(self) -> float:
        return math.exp(self._log_factor)

    def update(self, observed: float | None, expected: float | None, samples: float) -> None:
        if observed is None or expected is None or samples < self.config.min_samples:
            return
        if not (math.isfinite(observed) and math.isfinite(expected) and observed > 0 and expected > 0):
            return
        low, high = math.log(self.config.min_factor), math.log(self.config.max_factor)
        ratio = min(max(math.log(observed / expected), low), high)
        self._log_factor = min(max(self._log_factor + self.config.smoothing * (ratio - self._log_factor), low), high)


class CorrectionTracker:
    """Keeps the smoothed, clamped prefill and decode factors across intervals."""

    def __init__(self, config: CorrectionConfig | None = None) -> None:
        self.config = config or CorrectionConfig()
        self._prefill = _SmoothedRatio(self.config)
        self._decode = _SmoothedRatio(self.config)

    @property
    def factors(self) -> CorrectionFactors:
        if not self.config.enabled:
            return CorrectionFactors()
        return CorrectionFactors(prefill=self._prefill.value, decode=self._decode.value)

    def update(
        self,
        *,
        observed_ttft_s: float | None,
        expected_ttft_s: float | None,
        observed_itl_s: float | None,
        expected_itl_s: float | None,
        ttft_samples: float = math.inf,
        itl_samples: float = math.inf,
        decode_load: float = math.inf,
    ) -> CorrectionFactors:
        """Fold one interval's latencies in; returns the factors to plan the next interval with. `decode_load`: the
        interval's concurrency per worker over the plan's operating concurrency (`decode_load`)."""
        if self.config.enabled:
            self._prefill.update(observed_ttft_s, expected_ttft_s, ttft_samples)
            if decode_load >= self.config.min_decode_load:
                self._decode.update(observed_itl_s, expected_itl_s, itl_samples)
        return self.factors


def expected_ttft_s(profile: PerformanceProfile, isl: float) -> float:
    """The profile's TTFT for the interval's mean prompt length (queueing shows up as a factor above 1)."""
    return profile.prefill_ttft(isl)


def fleet_concurrency(*, request_rate: float, request_duration_s: float, workers: int) -> float:
    """The mean sequences per worker by Little's law: arrivals per second times seconds a request stays, shared by the
    workers (Dynamo computes it the same way)."""
    return request_rate * request_duration_s / max(workers, 1)


def expected_itl_s(profile: PerformanceProfile, concurrency: float, *, context: float) -> float:
    """The profile's ITL at the `concurrency` per worker the fleet carried (`fleet_concurrency`); context is the mean
    prompt plus half the mean output, the average length over a request's decode."""
    return profile.decode_itl(context, max(concurrency, 1.0))


def decode_load(profile: PerformanceProfile, concurrency: float, *, itl_target_s: float, context: float) -> float:
    """`concurrency` per worker over the concurrency at which the profile's workers run at `itl_target_s` (the plan's
    operating point, `PerformanceProfile.best_decode`)."""
    return concurrency / max(profile.best_decode(itl_target_s, context).concurrency, 1e-9)
