"""Prometheus metrics of the health service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx.health.degradation import LEVEL_THRESHOLDS, LEVELS_HELP
from phalanx.health.state import Circuit, Health

_CHECK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# phalanx_circuit_breaker_state values, in the order operators read them.
CIRCUIT_VALUES = {Circuit.CLOSED: 0, Circuit.HALF_OPEN: 1, Circuit.OPEN: 2}


class HealthMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.worker_status = Gauge(
            "phalanx_worker_status", "1 for the worker's current health status (healthy, suspicious, unhealthy, draining, dead)",
            ["worker", "status"], registry=r,
        )
        self.routing_weight = Gauge("phalanx_worker_routing_weight", "Routing weight the health service gives the worker", ["worker"], registry=r)
        self.check_duration = Histogram(
            "phalanx_health_check_duration_seconds", "Canary check latency by result", ["worker", "result"], buckets=_CHECK_BUCKETS,
            registry=r,
        )
        self.circuit = Gauge("phalanx_circuit_breaker_state", "0 closed, 1 half-open, 2 open", ["worker"], registry=r)
        self.degradation = Gauge("phalanx_degradation_level", f"Degradation level this instance computed ({LEVELS_HELP})", registry=r)
        self.pressure = Gauge(
            "phalanx_capacity_pressure",
            f"Demand over healthy capacity by the worst SLO criterion; above {', '.join(f'{t:g}' for t in LEVEL_THRESHOLDS)} it calls "
            "for degradation levels 1 to 4",
            registry=r,
        )
        self.bus_rejected = Counter(
            "phalanx_bus_rejected_messages", "NATS messages refused (undecodable, not from the subject's worker, or failing their checks)",
            ["subject_kind"], registry=r,
        )
        self.canary_failures = Counter("phalanx_canary_failures", "Failed canary checks by reason", ["worker", "reason"], registry=r)
        self.checks = Counter("phalanx_health_checks", "Canary checks by result (pass, fail, inconclusive)", ["result"], registry=r)
        self.latency_rechecks = Counter(
            "phalanx_health_latency_rechecks", "Canaries repeated because the first was only too slow", registry=r
        )
        self.timeout_rechecks = Counter(
            "phalanx_health_timeout_rechecks",
            "Canaries repeated at once because a healthy worker missed one deadline while its engine made progress",
            registry=r,
        )
        self.load_allowance = Gauge(
            "phalanx_health_load_allowance",
            "How much the worker's load (and its host's) stretched its latest canary's latency limit (1: not at all)",
            ["worker"], registry=r,
        )
        self.busy_passes = Counter(
            "phalanx_health_busy_passes",
            "Canaries that passed only thanks to the worker's load allowance: slow because busy, not broken",
            registry=r,
        )
        self.transitions = Counter("phalanx_health_transitions", "Health status changes", ["from_status", "to_status"], registry=r)
        self.liveness_deaths = Counter("phalanx_health_liveness_deaths", "Workers marked DEAD by a liveness signal", ["signal"], registry=r)
        self.leader = Gauge("phalanx_health_leader", "1 while this instance is the active health service", registry=r)
        self.calibrations = Counter("phalanx_canary_calibrations", "Canary calibrations by outcome", ["outcome"], registry=r)

    def set_worker(self, worker_id: str, health: Health, weight: float, circuit: Circuit) -> None:
        for h in Health:
            self.worker_status.labels(worker=worker_id, status=h.label).set(1 if h is health else 0)
        self.routing_weight.labels(worker=worker_id).set(weight)
        self.circuit.labels(worker=worker_id).set(CIRCUIT_VALUES[circuit])

    def forget_worker(self, worker_id: str) -> None:
        for h in Health:
            _remove(self.worker_status, worker_id, h.label)
        _remove(self.routing_weight, worker_id)
        _remove(self.circuit, worker_id)
        _remove(self.load_allowance, worker_id)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
