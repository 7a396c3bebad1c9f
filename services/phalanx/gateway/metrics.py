"""Prometheus metrics of the gateway (phalanx_gateway_* names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from phalanx.gateway.responses import CHAT, COMPLETIONS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "phalanx_gateway_requests", "HTTP requests by endpoint and final status (the HTTP code, or client_closed)",
            ["endpoint", "status"], registry=r,
        )
        self.latency = Histogram(
            "phalanx_gateway_request_seconds", "Time from a request's arrival to its last byte", ["endpoint"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "phalanx_gateway_ttft_seconds", "Time from a request's arrival to its first token", ["endpoint"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("phalanx_gateway_tokens", "Completion tokens sent to clients", ["endpoint"], registry=r)
        self.resumes = Counter(
            "phalanx_gateway_stream_resumes", "Broken router streams the SDK resumed without the HTTP client noticing", registry=r
        )
        self.active = Gauge("phalanx_gateway_active_requests", "Generation requests in flight", registry=r)
        # Every endpoint's series from the start: a dashboard shows zeros, and rate() sees the first request.
        for dialect in (COMPLETIONS, CHAT):
            for metric in (self.latency, self.ttft, self.tokens):
                metric.labels(endpoint=dialect.endpoint)

    def count_wrong_peers(self, wrong_peers: Callable[[], int]) -> None:
        """Exports ``wrong_peers()``, the SDK's count of router calls that reached another service."""
        self.registry.register(_WrongPeers(wrong_peers))


class _WrongPeers(Collector):
    def __init__(self, wrong_peers: Callable[[], int]) -> None:
        self._wrong_peers = wrong_peers

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "phalanx_gateway_router_wrong_peers",
            "Router calls that reached another service at a router's address; each dropped its channel and was retried",
            value=self._wrong_peers(),
        )
