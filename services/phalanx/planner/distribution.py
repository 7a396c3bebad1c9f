"""Summaries of a distribution (latencies, prompt and output lengths): a mean and a few quantiles. Pure, no I/O.

The planner plans for a quantile of ISL/OSL rather than their mean (replicas.py says why), so what it
observes carries quantiles, computed here from cumulative histogram buckets the way Prometheus'
`histogram_quantile` does: linear interpolation inside the bucket that holds the rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Summary:
    """A distribution's mean and quantiles ({0.9: p90, ...}); `count` is how many samples it summarises."""

    mean: float
    quantiles: Mapping[float, float] = field(default_factory=dict)
    count: float = 0.0

    def quantile(self, q: float | None) -> float:
        """The q-quantile, or the mean when q is None; a quantile not observed is interpolated between the
        nearest observed ones (the mean stands for nothing below the lowest: it is no quantile)."""
        if q is None:
            return self.mean
        if q in self.quantiles:
            return self.quantiles[q]
        known = sorted(self.quantiles.items())
        if not known:
            return self.mean
        if q <= known[0][0]:
            return known[0][1]
        if q >= known[-1][0]:
            return known[-1][1]
        for (q0, v0), (q1, v1) in zip(known, known[1:], strict=False):
            if q0 <= q <= q1:
                return v0 + (v1 - v0) * (q - q0) / (q1 - q0)
        return known[-1][1]  # unreachable: the loop covers [first, last]

    @classmethod
    def constant(cls, value: float) -> Summary:
        """Every sample equal to `value` (a trace that records only means, say)."""
        return cls(mean=value, quantiles={0.5: value, 0.9: value, 0.99: value})


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The q-quantile of a cumulative histogram [(upper_bound, cumulative_count), ...] sorted by bound, the last
    bound +Inf, as PromQL's histogram_quantile computes it: NaN when empty, linear interpolation inside the
    bucket holding the rank (from 0 for the first bucket when its bound is positive), and the highest finite
    bound when the rank falls in the +Inf bucket."""
    if not buckets or not 0.0 <= q <= 1.0:
        return math.nan
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


def summarise_histogram(buckets: Mapping[float, float], total_sum: float, quantiles: Sequence[float]) -> Summary | None:
    """A Summary from cumulative bucket counts {upper_bound: count} (over an interval: differences of two
    scrapes) and the sum of the samples; None when no sample fell in the interval."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    count = ordered[-1][1]
    return Summary(mean=total_sum / count, quantiles={q: histogram_quantile(q, ordered) for q in quantiles}, count=count)
