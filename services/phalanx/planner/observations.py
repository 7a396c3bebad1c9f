"""What the planner observed over an interval, from the routers' metrics. Pure: text and JSON in, an
`Observation` out; fetching them is the shell's job.

Two sources, the same result:

- scraping each router's /metrics directly (the embedded default of `phalanx up`): `parse_scrape` turns
  Prometheus text exposition into a `Scrape`, and `observe_scrapes` takes two rounds of scrapes (the
  previous interval's and this one's, per router) and differences them;
- Prometheus' HTTP API when one is configured: `promql_queries` gives the PromQL to run (instant queries
  over a window of at least the interval), `observe_prometheus` reads their JSON responses.

Metrics read (the routers' phalanx_router_* names, router/metrics.py):

- phalanx_router_requests_total{tier,status}: requests by final status, summed over every label: shed
  and failed requests are demand too, the very demand a planner must see. Counted at completion, so the
  rate lags arrivals by a request's duration.
- phalanx_router_ttft_seconds / phalanx_router_itl_seconds histograms: TTFT and ITL mean and quantiles.
- phalanx_router_arrivals_total{tier}: requests admitted and routed, counted when they start (once per request,
  not per resume or retry): the arrival rate without the completion lag (`Observation.arrival_rate`; None
  from routers that do not export it).
- phalanx_router_input_tokens / phalanx_router_output_tokens histograms (TOKEN_BUCKETS): ISL per admitted
  request and OSL per finished request, with quantiles. With no samples in the interval ISL is None and
  OSL falls back to a mean from phalanx_router_tokens_total (tokens relayed) per completed request.

Counter resets (a router restarted between scrapes) count from zero, as Prometheus' rate() does; a
router with no previous scrape (new, or the planner just started) is left out of this interval rather
than counted with its whole history.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from phalanx.planner.distribution import Summary, summarise_histogram
from phalanx.planner.errors import PrometheusQueryError

REQUESTS = "phalanx_router_requests"
TOKENS = "phalanx_router_tokens"
ARRIVALS = "phalanx_router_arrivals"
TTFT = "phalanx_router_ttft_seconds"
ITL = "phalanx_router_itl_seconds"
INPUT_TOKENS = "phalanx_router_input_tokens"
OUTPUT_TOKENS = "phalanx_router_output_tokens"
COUNTERS = (REQUESTS, TOKENS, ARRIVALS)
HISTOGRAMS = (TTFT, ITL, INPUT_TOKENS, OUTPUT_TOKENS)
# Buckets of the routers' ISL/OSL histograms (one per power of two from 16 to 128 Ki tokens:
# quantiles within a factor of two, 14 series per router).
TOKEN_BUCKETS = tuple(float(2**n) for n in range(4, 18))
DEFAULT_QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative bucket counts {upper bound: count} (+Inf included), the sum and the count, summed over labels."""

    buckets: Mapping[float, float]
    total: float
    count: float

    def minus(self, earlier: HistogramSnapshot) -> HistogramSnapshot:
        """The samples between `earlier` and this one; after a reset (count fell), all of this one's."""
        if self.count < earlier.count:
            return self
        return HistogramSnapshot(
            buckets={bound: count - earlier.buckets.get(bound, 0.0) for bound, count in self.buckets.items()},
            total=self.total - earlier.total,
            count=self.count - earlier.count,
        )

    def plus(self, other: HistogramSnapshot) -> HistogramSnapshot:
        bounds = set(self.buckets) | set(other.buckets)
        return HistogramSnapshot(
            buckets={b: self.buckets.get(b, 0.0) + other.buckets.get(b, 0.0) for b in bounds},
            total=self.total + other.total,
            count=self.count + other.count,
        )


@dataclass(frozen=True)
class Scrape:
    """One router's metrics at time `at` (seconds, the planner's clock)."""

    at: float
    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, HistogramSnapshot] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """The fleet over one interval. A latency or length is None when no sample fell in the interval (or,
    for ISL/OSL, when the routers do not export it)."""

    interval_s: float
    requests: float
    request_rate: float
    ttft: Summary | None
    itl: Summary | None
    isl: Summary | None
    osl: Summary | None
    # Routers that contributed (both scrapes present).
    routers: int = 0
    # Requests admitted per second (counted at arrival, unlike request_rate); None when no router exports arrivals.
    arrival_rate: float | None = None


_COUNTER_SAMPLES = {f"{name}_total": name for name in COUNTERS}
_HISTOGRAM_SAMPLES = {f"{name}{suffix}": (name, suffix) for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}


def parse_scrape(text: str, at: float) -> Scrape:
    """The planner's counters and histograms from one /metrics page, summed over their labels; other metrics
    are ignored. Samples are matched by name, not by family, so an exporter's TYPE lines (`x` or `x_total`
    for a counter, or none at all) do not matter."""
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _COUNTER_SAMPLES:
                name = _COUNTER_SAMPLES[sample.name]
                counters[name] = counters.get(name, 0.0) + sample.value
            elif sample.name in _HISTOGRAM_SAMPLES:
                name, suffix = _HISTOGRAM_SAMPLES[sample.name]
                if suffix == "_bucket":
                    per_bound = buckets.setdefault(name, {})
                    bound = float(sample.labels["le"])
                    per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
                elif suffix == "_sum":
                    sums[name] = sums.get(name, 0.0) + sample.value
                else:
                    counts[name] = counts.get(name, 0.0) + sample.value
    histograms = {
        name: HistogramSnapshot(buckets=per_bound, total=sums.get(name, 0.0), count=counts.get(name, 0.0))
        for name, per_bound in buckets.items()
        if per_bound
    }
    return Scrape(at=at, counters=counters, histograms=histograms)


def _counter_delta(current: float, previous: float) -> float:
    return current if current < previous else current - previous


def observe_scrapes(
    previous: Mapping[str, Scrape], current: Mapping[str, Scrape], quantiles: Sequence[float] = DEFAULT_QUANTILES
) -> Observation | None:
    """The interval between two rounds of scrapes keyed by router id; None when no router was scraped twice
    (or no time passed)."""
    pairs = [(previous[router], scrape) for router, scrape in current.items() if router in previous and scrape.at > previous[router].at]
    if not pairs:
        return None
    request_rate = 0.0
    requests = 0.0
    tokens = 0.0
    arrival_rate: float | None = None
    deltas: dict[str, HistogramSnapshot] = {}
    for before, after in pairs:
        elapsed = after.at - before.at
        if ARRIVALS in after.counters:
            arrived = _counter_delta(after.counters[ARRIVALS], before.counters.get(ARRIVALS, 0.0))
            arrival_rate = (arrival_rate or 0.0) + arrived / elapsed
        completed = _counter_delta(after.counters.get(REQUESTS, 0.0), before.counters.get(REQUESTS, 0.0))
        requests += completed
        request_rate += completed / elapsed
        tokens += _counter_delta(after.counters.get(TOKENS, 0.0), before.counters.get(TOKENS, 0.0))
        for name, snapshot in after.histograms.items():
            earlier = before.histograms.get(name)
            delta = snapshot.minus(earlier) if earlier is not None else None
            if delta is not None:
                deltas[name] = deltas[name].plus(delta) if name in deltas else delta
    interval = sum(after.at - before.at for before, after in pairs) / len(pairs)

    def summary(name: str) -> Summary | None:
        delta = deltas.get(name)
        return summarise_histogram(delta.buckets, delta.total, quantiles) if delta is not None else None

    osl = summary(OUTPUT_TOKENS)
    if osl is None and requests > 0:
        osl = Summary(mean=tokens / requests, count=requests)
    return Observation(
        interval_s=interval,
        requests=requests,
        request_rate=request_rate,
        ttft=summary(TTFT),
        itl=summary(ITL),
        isl=summary(INPUT_TOKENS),
        osl=osl,
        routers=len(pairs),
        arrival_rate=arrival_rate,
    )


# Prometheus HTTP API.


def _quantile_key(name: str, q: float) -> str:
    return f"{name}_q{q:g}"


_SUMMARIES = {"ttft": TTFT, "itl": ITL, "isl": INPUT_TOKENS, "osl": OUTPUT_TOKENS}


def promql_queries(window_s: float, quantiles: Sequence[float] = DEFAULT_QUANTILES) -> dict[str, str]:
    """Instant queries (GET /api/v1/query?query=...) giving an Observation over the last `window_s` seconds,
    keyed as `observe_prometheus` expects. The window should span at least two scrapes."""
    window = f"[{max(1, round(window_s))}s]"
    queries = {
        "request_rate": f"sum(rate({REQUESTS}_total{window}))",
        "arrival_rate": f"sum(rate({ARRIVALS}_total{window}))",
        "token_rate": f"sum(rate({TOKENS}_total{window}))",
    }
    for key, metric in _SUMMARIES.items():
        queries[f"{key}_mean"] = f"sum(rate({metric}_sum{window})) / sum(rate({metric}_count{window}))"
        queries[f"{key}_count"] = f"sum(increase({metric}_count{window}))"
        for q in quantiles:
            queries[_quantile_key(key, q)] = f"histogram_quantile({q:g}, sum by (le) (rate({metric}_bucket{window})))"
    return queries


def _scalar(key: str, response: Mapping[str, Any]) -> float | None:
    """The single value of an instant-vector response; None when empty or NaN (no samples in the window)."""
    if response.get("status") != "success":
        raise PrometheusQueryError(f"{key}: {response.get('errorType', 'error')}: {response.get('error', response)}")
    data = response.get("data", {})
    if data.get("resultType") not in ("vector", "scalar"):
        raise PrometheusQueryError(f"{key}: expected an instant vector, got {data.get('resultType')!r}")
    result = data.get("result", [])
    if data["resultType"] == "scalar":
        result = [{"value": result}]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return value if math.isfinite(value) else None


def _summary_from(key: str, values: Mapping[str, float | None], quantiles: Iterable[float]) -> Summary | None:
    mean = values.get(f"{key}_mean")
    if mean is None:
        return None
    found = {q: v for q in quantiles if (v := values.get(_quantile_key(key, q))) is not None}
    return Summary(mean=mean, quantiles=found, count=values.get(f"{key}_count") or 0.0)


def observe_prometheus(
    responses: Mapping[str, Mapping[str, Any]], window_s: float, quantiles: Sequence[float] = DEFAULT_QUANTILES
) -> Observation:
    """An Observation from the JSON responses to `promql_queries(window_s, quantiles)`, keyed the same way
    (a missing key counts as no data)."""
    values = {key: _scalar(key, response) for key, response in responses.items()}
    rate = values.get("request_rate") or 0.0
    osl = _summary_from("osl", values, quantiles)
    token_rate = values.get("token_rate")
    if osl is None and rate > 0 and token_rate is not None:
        osl = Summary(mean=token_rate / rate, count=rate * window_s)
    return Observation(
        interval_s=window_s,
        requests=rate * window_s,
        request_rate=rate,
        ttft=_summary_from("ttft", values, quantiles),
        itl=_summary_from("itl", values, quantiles),
        isl=_summary_from("isl", values, quantiles),
        osl=osl,
        arrival_rate=values.get("arrival_rate"),
    )


# From this degradation level on the routers refuse requests (best_effort first): those never count as arrivals.
SHEDDING_LEVEL = 2


def interval_demand(observation: Observation, degradation_level: int) -> float:
    """The requests an interval asked for: its arrivals, or, while the routers shed, the larger of its arrivals and its
    finished requests (refusals finish at once and never arrive).

    Completions lag arrivals by a request's duration: counted as demand outside shedding, they kept it high for the
    intervals after a burst, and the fleet stayed large (docs/results/, the second planner pass). Without an arrivals counter (older
    routers), finished requests are all there is.
    """
    if observation.arrival_rate is None:
        return observation.requests
    arrived = observation.arrival_rate * observation.interval_s
    return max(observation.requests, arrived) if degradation_level >= SHEDDING_LEVEL else arrived
