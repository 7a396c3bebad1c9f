"""Observations from the routers' real metrics (RouterMetrics rendered by prometheus_client) and from
Prometheus HTTP API responses; histogram quantiles as PromQL computes them."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from phalanx.planner.distribution import Summary, histogram_quantile, summarise_histogram
from phalanx.planner.errors import PrometheusQueryError
from phalanx.planner.observations import (
    SHEDDING_LEVEL,
    Observation,
    interval_demand,
    observe_prometheus,
    observe_scrapes,
    parse_scrape,
    promql_queries,
)
from phalanx.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit


class FakeRouter:
    """A router's real metrics objects (RouterMetrics), fed as its request handlers feed them."""

    def __init__(self, with_lengths: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        # Without: as routers before the ISL/OSL histograms and the arrivals counter (their families absent or empty).
        self.lengths = with_lengths

    def serve(
        self, n: int, *, tier: str = "standard", status: str = "ok", ttft: float = 0.03, itl: float = 0.02, isl: int = 500, osl: int = 100
    ) -> None:
        for _ in range(n):
            self.metrics.requests.labels(tier, status).inc()
            self.metrics.ttft.labels(tier).observe(ttft)
            self.metrics.itl.labels(tier).observe(itl)
            self.metrics.tokens.inc(osl)
            if self.lengths:
                self.metrics.arrivals.labels(tier).inc()
                self.metrics.input_tokens.observe(isl)
                self.metrics.output_tokens.observe(osl)

    def scrape(self, at: float):
        return parse_scrape(generate_latest(self.registry).decode(), at)


def test_histogram_quantile_interpolates_inside_the_bucket_like_promql() -> None:
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.5, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.04)  # first bucket interpolates from 0
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.2 + 0.3 * 6 / 10)
    assert histogram_quantile(0.99, [(1.0, 5.0), (math.inf, 10.0)]) == 1.0  # in the +Inf bucket: the last finite bound
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))
    assert math.isnan(histogram_quantile(1.5, buckets))


def test_summarise_histogram_and_summary_quantiles() -> None:
    summary = summarise_histogram({0.1: 10.0, 0.2: 30.0, 0.5: 40.0, math.inf: 40.0}, total_sum=6.0, quantiles=(0.5, 0.9))
    assert summary is not None
    assert (summary.mean, summary.count) == (pytest.approx(0.15), 40.0)
    assert summary.quantile(0.5) == pytest.approx(0.15)
    assert summary.quantile(0.7) == pytest.approx((0.15 + 0.38) / 2)  # between observed quantiles, linearly
    assert summary.quantile(None) == summary.mean
    assert summary.quantile(0.99) == summary.quantile(0.9)  # beyond the last observed: the last
    assert summarise_histogram({math.inf: 0.0}, 0.0, (0.5,)) is None
    assert Summary(mean=3.0).quantile(0.9) == 3.0  # a mean-only summary answers the mean


def test_observation_from_two_scrapes_of_a_router() -> None:
    router = FakeRouter()
    router.serve(5, ttft=0.5)  # before the interval: must not count
    before = router.scrape(at=100.0)
    router.serve(30, ttft=0.03, itl=0.015)
    router.serve(10, tier="best_effort", status="shed", ttft=0.2, itl=0.04)
    after = router.scrape(at=110.0)
    observation = observe_scrapes({"r0": before}, {"r0": after})
    assert observation is not None
    assert (observation.interval_s, observation.requests, observation.request_rate) == (10.0, 40.0, 4.0)  # shed requests are demand
    assert observation.ttft is not None and observation.itl is not None
    assert observation.ttft.mean == pytest.approx((30 * 0.03 + 10 * 0.2) / 40)
    # 30 of 40 first tokens in (0.025, 0.05]: p50 interpolates inside it; p90 lands in (0.1, 0.25].
    assert 0.025 < observation.ttft.quantile(0.5) <= 0.05
    assert 0.1 < observation.ttft.quantile(0.9) <= 0.25
    assert observation.itl.count == 40
    # No ISL samples (a router that does not export them): unobserved; OSL is a mean from relayed tokens per completed request.
    assert observation.isl is None
    assert observation.osl == Summary(mean=100.0, count=40.0)
    assert observation.arrival_rate is None


def test_isl_and_osl_quantiles_once_routers_export_them() -> None:
    router = FakeRouter(with_lengths=True)
    before = router.scrape(at=0.0)
    router.serve(90, isl=200, osl=50)
    router.serve(10, isl=8000, osl=1500)
    observation = observe_scrapes({"r": before}, {"r": router.scrape(at=30.0)})
    assert observation is not None and observation.isl is not None and observation.osl is not None
    assert observation.isl.mean == pytest.approx(0.9 * 200 + 0.1 * 8000)
    assert 128 < observation.isl.quantile(0.5) <= 256  # the short prompts' bucket
    assert 4096 < observation.isl.quantile(0.99) <= 8192  # the documents' bucket
    assert observation.osl.quantiles  # from the histogram, not the token-count fallback
    assert 1024 < observation.osl.quantile(0.99) <= 2048
    assert observation.arrival_rate == pytest.approx(100 / 30)


def test_several_routers_are_summed_and_new_or_restarted_ones_handled() -> None:
    a, b, c = FakeRouter(), FakeRouter(), FakeRouter()
    a.serve(10)
    b.serve(50)
    previous = {"a": a.scrape(0.0), "b": b.scrape(0.0)}
    a.serve(20)
    restarted = FakeRouter()  # b restarted: its counters start again from zero
    restarted.serve(6, ttft=0.2)
    c.serve(1000)  # c is new this interval: its whole history is not this interval's load
    current = {"a": a.scrape(10.0), "b": restarted.scrape(12.0), "c": c.scrape(10.0)}
    observation = observe_scrapes(previous, current)
    assert observation is not None
    assert observation.routers == 2
    assert observation.requests == 26.0
    assert observation.request_rate == pytest.approx(20 / 10 + 6 / 12)
    assert observation.interval_s == pytest.approx(11.0)
    assert observation.ttft is not None and observation.ttft.count == 26
    assert observation.ttft.mean == pytest.approx((20 * 0.03 + 6 * 0.2) / 26)


def test_an_idle_interval_has_a_rate_of_zero_and_no_latencies() -> None:
    router = FakeRouter()
    router.serve(3)
    observation = observe_scrapes({"r": router.scrape(0.0)}, {"r": router.scrape(15.0)})
    assert observation is not None
    assert (observation.requests, observation.request_rate) == (0.0, 0.0)
    assert observation.ttft is None and observation.itl is None and observation.osl is None


def test_no_observation_without_two_scrapes() -> None:
    router = FakeRouter()
    assert observe_scrapes({}, {"r": router.scrape(0.0)}) is None
    assert observe_scrapes({"r": router.scrape(5.0)}, {"r": router.scrape(5.0)}) is None


def test_parse_scrape_ignores_unrelated_metrics() -> None:
    text = "# TYPE other_total counter\nother_total 5\n# TYPE phalanx_router_tokens_total counter\nphalanx_router_tokens_total 7\n"
    scrape = parse_scrape(text, at=1.0)
    assert scrape.counters == {"phalanx_router_tokens": 7.0}
    assert scrape.histograms == {}
    # Untyped samples (no TYPE lines) are read by name as well.
    assert parse_scrape("phalanx_router_requests_total{tier=\"a\"} 2\nphalanx_router_requests_total{tier=\"b\"} 3\n", 1.0).counters == {
        "phalanx_router_requests": 5.0
    }


def test_promql_queries_name_the_router_metrics() -> None:
    queries = promql_queries(30.0, quantiles=(0.9,))
    assert queries["request_rate"] == "sum(rate(phalanx_router_requests_total[30s]))"
    assert queries["ttft_q0.9"] == "histogram_quantile(0.9, sum by (le) (rate(phalanx_router_ttft_seconds_bucket[30s])))"
    assert queries["itl_mean"] == "sum(rate(phalanx_router_itl_seconds_sum[30s])) / sum(rate(phalanx_router_itl_seconds_count[30s]))"
    assert queries["isl_q0.9"].startswith("histogram_quantile(0.9, sum by (le) (rate(phalanx_router_input_tokens_bucket")
    assert set(queries) == {
        "request_rate", "arrival_rate", "token_rate",
        *(f"{k}_{s}" for k in ("ttft", "itl", "isl", "osl") for s in ("mean", "count", "q0.9")),
    }


def vector(value: str | None) -> dict:
    result = [] if value is None else [{"metric": {}, "value": [1_700_000_000.0, value]}]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def test_observation_from_prometheus_responses() -> None:
    queries = promql_queries(60.0, quantiles=(0.5, 0.9))
    answers = {
        "request_rate": "4", "arrival_rate": "5", "token_rate": "400",
        "ttft_mean": "0.05", "ttft_count": "240", "ttft_q0.5": "0.04", "ttft_q0.9": "0.12",
        "itl_mean": "0.02", "itl_count": "24000", "itl_q0.5": "0.018", "itl_q0.9": "NaN",
        # ISL and OSL histograms absent (today's routers): empty vectors and NaN means.
        "isl_mean": "NaN", "isl_count": None, "isl_q0.5": "NaN", "isl_q0.9": "NaN",
        "osl_mean": None, "osl_count": None, "osl_q0.5": None, "osl_q0.9": None,
    }
    assert set(answers) == set(queries)
    observation = observe_prometheus({key: vector(value) for key, value in answers.items()}, 60.0, quantiles=(0.5, 0.9))
    assert (observation.request_rate, observation.requests, observation.interval_s) == (4.0, 240.0, 60.0)
    assert observation.arrival_rate == 5.0
    assert observation.ttft == Summary(mean=0.05, quantiles={0.5: 0.04, 0.9: 0.12}, count=240.0)
    assert observation.itl == Summary(mean=0.02, quantiles={0.5: 0.018}, count=24000.0)  # NaN quantile left out
    assert observation.isl is None
    assert observation.osl == Summary(mean=100.0, count=240.0)  # 400 tokens/s over 4 requests/s


def test_prometheus_errors_are_reported_with_the_query() -> None:
    error = {"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}
    with pytest.raises(PrometheusQueryError, match="ttft_mean: bad_data: parse error"):
        observe_prometheus({"ttft_mean": error}, 30.0)
    matrix = {"status": "success", "data": {"resultType": "matrix", "result": []}}
    with pytest.raises(PrometheusQueryError, match="expected an instant vector"):
        observe_prometheus({"request_rate": matrix}, 30.0)


def test_scalar_responses_are_accepted() -> None:
    scalar = {"status": "success", "data": {"resultType": "scalar", "result": [1_700_000_000.0, "2.5"]}}
    assert observe_prometheus({"request_rate": scalar}, 10.0).request_rate == 2.5


def test_demand_is_arrivals_unless_the_routers_shed_or_export_no_arrivals() -> None:
    # After a burst: 2 requests arrived in the interval, 9 of the burst's finished in it.
    after_burst = Observation(interval_s=2.0, requests=9.0, request_rate=4.5, ttft=None, itl=None, isl=None, osl=None, arrival_rate=1.0)
    assert interval_demand(after_burst, degradation_level=0) == pytest.approx(2.0)
    # While shedding, refused requests finish at once and never arrive: the larger count is the demand.
    assert interval_demand(after_burst, degradation_level=SHEDDING_LEVEL) == pytest.approx(9.0)
    older_router = Observation(interval_s=2.0, requests=9.0, request_rate=4.5, ttft=None, itl=None, isl=None, osl=None)
    assert interval_demand(older_router, degradation_level=0) == 9.0
