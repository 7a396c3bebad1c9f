"""Planner service settings (env prefix PHALANX_PLANNER_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.planner.predictors import PredictorKind


class PlannerConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_PLANNER_", extra="forbid", frozen=True)

    instance_id: str = Field("", description="Unique id; empty means planner-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server (health and reflection) binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")

    connector: Literal["virtual", "kubernetes"] = Field(
        "virtual", description="Who carries decisions out: an orchestrator acknowledging through etcd (`phalanx up --planner` is one), or Kubernetes"
    )
    interval_s: float = Field(30.0, gt=0, le=3600, description="Adjustment interval (it grows with measured scaling latency)")
    max_interval_s: float = Field(600.0, gt=0, description="Longest the adaptive interval gets")
    observe_window_s: float = Field(
        0.0, ge=0, description="A tick plans from rates over at least this trailing window (sliding, as Prometheus' rate[]); 0: the "
        "interval since the last tick. A few arrivals per interval make a noisy plan (docs/planner.md)"
    )
    poll_s: float = Field(0.5, gt=0, le=10, description="How often the planner checks readiness, acknowledgements and operator targets")
    min_workers: int = Field(1, ge=0, description="Fewest workers the planner asks for")
    max_workers: int = Field(8, ge=1, description="Most workers the planner asks for")
    gpus_per_worker: int = Field(1, ge=1, description="Used with max_gpus; the profile's own value wins when a profile is given")
    max_gpus: int | None = Field(None, ge=1, description="GPU budget of the fleet; unset: max_workers is the only bound")
    hot_spares: int = Field(0, ge=0, le=16, description="Hot spares to keep: warm registered workers not routed to, promoted when a worker dies")
    failure_reserve: int = Field(
        0, ge=0, le=16, description="N+k: serving workers planned beyond what the SLOs need (in each pool), so that the SLOs still hold "
        "after this many workers are lost; unlike hot spares, they serve"
    )
    lead_time_s: float | None = Field(
        None, ge=0, description="How far past the interval a plan sizes the fleet for (its new workers serve only once routable); "
        "unset: the measured P90 of new workers' start-to-routable (none measured: 0); 0: the next interval only"
    )
    promote_deadline_s: float = Field(5.0, gt=0, description="A spare's promotion not acknowledged after this long times out")
    capacity_view: bool = Field(True, description="Publish the capacity-vs-demand view (needs a profile) that health's degradation reads")
    scale_deadline_s: float = Field(120.0, gt=0, description="A scaling decision not acknowledged after this long times out")
    replace_deadline_s: float = Field(60.0, gt=0, description="Likewise for the replacement of a DEAD worker")

    profile: str = Field("", description="Performance profile (.npz, `phalanx profile`); without one the planner holds the count "
                         "between min and max, follows operator targets and replaces DEAD workers, but does not scale with load")
    predictor: PredictorKind = Field("constant", description="Load predictor: constant, arima, kalman or prophet")
    trace: str = Field("", description="Trace file (JSON lines or CSV) to warm the predictors up with")
    correction: bool = Field(True, description="Apply smoothed correction factors (False: plan from the profile alone)")
    length_quantile: float | None = Field(0.9, gt=0, lt=1, description="ISL/OSL quantile the operating point is read at; unset: the mean")
    default_isl: float = Field(512.0, gt=0, description="Prompt tokens assumed while the routers do not export ISL")
    default_osl: float | None = Field(
        None, gt=0, description="Output tokens assumed until a request completes (an overloaded fleet completes none); unset: no "
        "load plan before the first completion"
    )
    ttft_slo_s: float = Field(2.0, gt=0, description="Time-to-first-token SLO")
    itl_slo_s: float = Field(0.25, gt=0, description="Inter-token latency SLO")
    slo_headroom: float = Field(
        1.0, gt=0, le=1, description="The plan sizes the fleet for this fraction of the latency SLOs (1: at the SLOs). A fleet "
        "sized at the SLO runs its average request at it, and the requests of the busier workers over it"
    )
    surge_window_s: float = Field(
        2.0, ge=0, description="Between ticks, arrivals over this window that need more workers than the target scale up at "
        "once (a SURGE decision); 0: only at ticks"
    )
    surge_min_requests: int = Field(4, ge=1, description="Arrivals a surge window must hold before it counts (noise at low rates)")
    surge_confidence: float = Field(
        0.0, ge=0, lt=1, description="> 0: a surge window (surge_window_s, and 2 and 4 times it) counts only when arrivals as many "
        "as it holds had less than 1 - this chance to come from the rate the last plan was made for (a Poisson tail; at 0.99 and "
        "1 request/s planned, 7 or more in 2 s), and the surge asks for the workers of the highest rate a window shows beyond "
        "that noise (its Poisson lower bound), not of the window's own rate; 0 (default): any window of surge_min_requests "
        "counts, and asks for its own rate (the planner bench's fifth and seventh passes, docs/results/)"
    )
    surge_size_confidence: float | None = Field(
        None, ge=0, lt=1, description="With surge_confidence: the confidence of the lower bound a surge is sized by (lower: nearer "
        "the window's own rate); unset: surge_confidence"
    )
    surge_withdraw_odds: float = Field(
        0.0, ge=0, description="> 1: a surge is withdrawn (back to the count before it) once the arrivals after it favour the rate "
        "the fleet was planned for over the rate the surge was sized for by these odds, a Poisson likelihood ratio, and stands "
        "once they favour the surge's by them; 0 (default): a surge stands until a tick scales down (the planner bench's ninth pass, docs/results/)"
    )
    scale_down_hold_confidence: float = Field(
        0.0, ge=0, lt=1, description="> 0: the last surge_window_s of arrivals hold a scale-down only when as many had less than "
        "1 - this chance to come from the rate it was planned for (a Poisson tail); 0 (default): any rate above it holds"
    )
    scale_down_confidence: float = Field(
        0.0, ge=0, lt=1, description="> 0: a tick scales down no further than the workers for the upper Poisson bound, at this "
        "confidence, of the arrivals it observed (a dip within the noise of the rate the fleet serves is no reason to shed "
        "workers; the planner bench's seventh pass, docs/results/); 0 (default): to what the plan asks"
    )
    scale_down_confirm_s: float | None = Field(
        None, ge=0, description="A tick's scale-down is issued after the arrivals stayed at or below its plan for this long (a rise "
        "cancels it); unset: surge_window_s; 0: at once"
    )
    scale_down_window_s: float | None = Field(
        None, ge=0, description="A tick asks for no fewer workers than the most wanted within this window; unset: 3 x interval_s"
    )

    prometheus_url: str = Field("", description="Prometheus base URL (http://host:9090); unset: scrape the routers' /metrics directly")
    scrape_timeout_s: float = Field(2.0, gt=0, le=60, description="Deadline of one /metrics scrape or Prometheus query")

    leader_ttl_s: int = Field(2, ge=1, le=60, description="TTL of the leadership lease; a standby takes over within about this")

    kube_namespace: str = Field("default", description="Namespace of the worker StatefulSet (connector kubernetes)")
    kube_statefulset: str = Field("phalanx-worker", description="Name of the worker StatefulSet (connector kubernetes)")
    kube_prefill_statefulset: str = Field(
        "", description="Name of the prefill workers' StatefulSet of a disaggregated fleet (connector kubernetes); empty: "
        "<kube_statefulset>-prefill, the Helm chart's"
    )

    disaggregated: bool | None = Field(
        None, description="Plan prefill and decode pools apart (docs/disagg.md, Planner): min/max_workers then bound the decode "
        "pool, prefill_min/max_workers the prefill pool; unset: once a prefill worker is registered"
    )
    prefill_min_workers: int = Field(1, ge=0, description="Fewest prefill workers the planner asks for (a disaggregated fleet)")
    prefill_max_workers: int = Field(8, ge=0, description="Most prefill workers the planner asks for (a disaggregated fleet)")
    prefill_hot_spares: int = Field(0, ge=0, le=16, description="Hot spares of the prefill pool (hot_spares: the decode pool's)")

    @model_validator(mode="after")
    def _check(self) -> PlannerConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
        if self.interval_s > self.max_interval_s:
            raise ValueError("interval_s exceeds max_interval_s")
        if self.prefill_min_workers > self.prefill_max_workers:
            raise ValueError(f"prefill_min_workers ({self.prefill_min_workers}) exceeds prefill_max_workers ({self.prefill_max_workers})")
        if 0 < self.surge_withdraw_odds <= 1:
            raise ValueError("surge_withdraw_odds must be 0 (off) or > 1")
        return self

    def clamp(self, workers: int) -> int:
        return min(max(workers, self.min_workers), self.max_workers)

    @property
    def prefill_statefulset(self) -> str:
        return self.kube_prefill_statefulset or f"{self.kube_statefulset}-prefill"
