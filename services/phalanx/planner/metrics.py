"""Prometheus metrics of the planner service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.leader = Gauge("phalanx_planner_leader", "1 while this instance leads (decides)", registry=r)
        self.ready = Gauge("phalanx_planner_ready", "1 once routers and a worker serve and metrics flow (load decisions allowed)", registry=r)
        self.decisions = Counter("phalanx_planner_decisions", "Decisions published, by reason (scale, replace_dead, promote_spare)",
                                 ["reason"], registry=r)
        self.finished = Counter("phalanx_planner_decisions_finished", "Decisions finished, by outcome (completed, timed_out)", ["outcome"],
                                registry=r)
        self.decision_latency = Histogram("phalanx_planner_decision_latency_seconds", "From publishing a decision to its acknowledgement",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.target_workers = Gauge("phalanx_planner_target_workers", "Workers the last decision asked for", registry=r)
        self.desired_workers = Gauge("phalanx_planner_desired_workers", "Workers the last interval's plan wanted (before the decision rules)",
                                     registry=r)
        self.actual_workers = Gauge("phalanx_planner_actual_workers", "Workers registered and not DEAD, UNHEALTHY or DRAINING", registry=r)
        self.spares = Gauge("phalanx_planner_spares", "Hot spares ready (registered, warm, not routed to; of both pools of a "
                            "disaggregated fleet)", registry=r)
        self.capacity_pressure = Gauge("phalanx_planner_capacity_pressure", "Predicted demand over the serving fleet's capacity (1.0: at the SLOs)",
                                       registry=r)
        self.routers = Gauge("phalanx_planner_routers", "Routers registered", registry=r)
        self.interval = Gauge("phalanx_planner_interval_seconds", "The adaptive adjustment interval", registry=r)
        self.lead_time = Gauge("phalanx_planner_lead_time_seconds", "How far past the interval the last plan sized the fleet for (new "
                               "workers' measured P90 start-to-routable, or the configured lead time)", registry=r)
        self.observed_requests = Gauge("phalanx_planner_observed_requests_per_second", "Request rate over the last interval", registry=r)
        self.predicted_requests = Gauge("phalanx_planner_predicted_requests_per_second", "Request rate predicted for the next interval",
                                        registry=r)
        self.observed_osl = Gauge("phalanx_planner_observed_osl_tokens", "Mean output tokens per request over the last interval", registry=r)
        self.predicted_osl = Gauge("phalanx_planner_predicted_osl_tokens", "Mean output tokens predicted for the next interval", registry=r)
        self.correction = Gauge("phalanx_planner_correction_factor", "Smoothed observed/expected latency (prefill: TTFT, decode: ITL)",
                                ["phase"], registry=r)
        self.degradation = Gauge("phalanx_planner_degradation_level", "Degradation level the plan used (from 3 on: doubled latency SLOs)",
                                 registry=r)
        self.scale_downs_held = Counter("phalanx_planner_scale_downs_held", "Scale-downs not issued because arrivals rose (at the "
                                        "tick, or while the scale-down waited to be confirmed)", registry=r)
        self.surges_withdrawn = Counter("phalanx_planner_surges_withdrawn", "Surges withdrawn: the arrivals after them favoured the "
                                        "planned rate (surge_withdraw_odds)", registry=r)
        # A disaggregated fleet (docs/disagg.md, Planner): the gauges above are then its decode pool's, these its prefill pool's.
        self.target_prefill_workers = Gauge("phalanx_planner_target_prefill_workers", "Prefill workers the last decision asked for "
                                            "(a disaggregated fleet)", registry=r)
        self.desired_prefill_workers = Gauge("phalanx_planner_desired_prefill_workers", "Prefill workers the last interval's plan "
                                             "wanted (a disaggregated fleet)", registry=r)
        self.actual_prefill_workers = Gauge("phalanx_planner_actual_prefill_workers", "Prefill workers registered and not DEAD, "
                                            "UNHEALTHY or DRAINING (a disaggregated fleet)", registry=r)
        self.observe_errors = Counter("phalanx_planner_observe_errors", "Failed scrapes or Prometheus queries", ["source"], registry=r)

    def show_prefill(self, *, target: int | None = None, desired: int | None = None, actual: int | None = None) -> None:
        """The prefill pool's gauges, each when given (None: an aggregated fleet, or not known here)."""
        for gauge, value in ((self.target_prefill_workers, target), (self.desired_prefill_workers, desired),
                             (self.actual_prefill_workers, actual)):
            if value is not None:
                gauge.set(value)
