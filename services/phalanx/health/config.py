"""Health service settings (env prefixes PHALANX_HEALTH_ and PHALANX_DEGRADATION_)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class DegradationConfig(BaseSettings):
    """The capacity model that sets the degradation level, and its SLOs."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_DEGRADATION_", extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Compute and publish the degradation level")
    interval_s: float = Field(1.0, ge=0.05, le=60, description="Period of capacity evaluations")
    slo_tokens_per_s: float = Field(
        0.0, ge=0, description="Output tokens per second the deployment must sustain; 0 leaves throughput out of the model"
    )
    worker_tokens_per_s: float = Field(
        0.0, ge=0, description="Nominal decode capacity of one healthy worker; 0 learns it from the peak rates workers report"
    )
    slo_ttft_s: float = Field(2.0, gt=0, description="Time-to-first-token SLO")
    slo_tpot_s: float = Field(0.25, gt=0, description="Time-per-output-token SLO")
    min_free_kv_fraction: float = Field(0.05, ge=0, lt=1, description="Below this share of free KV blocks the fleet is full")
    raise_after_s: float = Field(2.0, ge=0, description="How long pressure must call for a higher level before it is raised")
    lower_after_s: float = Field(30.0, ge=0, description="How long pressure must allow a lower level before it drops one step")
    lower_margin: float = Field(
        0.1, ge=0, lt=1, description="Pressure must fall this fraction below a level's threshold to leave it (hysteresis)"
    )
    report_stale_s: float = Field(3.0, gt=0, description="A worker whose last load report is older counts as no capacity")
    planner_view: bool = Field(
        True, description="Take the planner's capacity-vs-demand view (predicted demand over the serving fleet) as one more criterion "
        "while it is fresh"
    )


class HealthConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_HEALTH_", extra="forbid", frozen=True)

    instance_id: str = Field("", description="Unique id; empty means health-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")

    check_interval_s: float = Field(30.0, ge=0.05, le=3600, description="Period of canary checks of each worker")
    check_jitter: float = Field(0.1, ge=0, le=0.5, description="Each period is drawn from interval x (1 +- jitter)")
    check_timeout_s: float = Field(
        5.0, gt=0, description="Longest one canary may take; once a latency baseline exists the deadline is tighter"
    )
    min_check_timeout_s: float = Field(0.25, gt=0, description="The tightest a canary deadline gets")
    check_retries: int = Field(1, ge=0, le=5, description="Immediate retries of a canary that failed to connect")
    failure_recheck_s: float = Field(
        0.25, ge=0, description="After a failed check the next one comes this soon (at most one interval)"
    )
    latency_factor: float = Field(3.0, gt=1, description="A canary slower than this multiple of the worker's baseline fails")
    latency_slack_s: float = Field(
        0.05, ge=0, description="...and slower than baseline plus this, so a few ms of jitter on a fast canary is no fault"
    )
    latency_ema_alpha: float = Field(0.1, gt=0, le=1, description="Weight of a new passing latency in the baseline")
    latency_recheck_delay_s: float = Field(
        0.2, ge=0,
        description="A canary over the latency limit is checked again this much later (at most half an interval)",
    )
    latency_rechecks: int = Field(
        2, ge=0, le=5,
        description="Rechecks of a slow canary; it fails only if every one is slow too (a slow answer on a shared host is "
        "as often its scheduler as the worker, a slow worker stays slow)",
    )
    load_aware: bool = Field(
        True, description="Judge a canary's latency against the worker's own step time from its load reports, so that a worker "
        "slow because it (or its host) is busy is not taken for a failing one (health/load.py)"
    )
    load_learn_factor: float = Field(
        1.5, gt=1, description="A load report's step time is learned as the worker's usual for its load level when it is at most "
        "this multiple of the usual one; a sudden larger jump is not learned (its peers may still explain it)"
    )
    load_max_stretch: float = Field(20.0, ge=1, description="The most a worker's load may stretch its canary latency limit")
    load_report_stale_s: float = Field(2.0, gt=0, description="A load report older than this grants no allowance")
    load_stall_s: float = Field(
        0.5, gt=0, description="A worker that holds work and whose reports show no step for this long (or 3 of its recent steps, "
        "if longer) makes no progress: no allowance, and a missed canary counts as a hang's"
    )
    unhealthy_after: int = Field(3, ge=1, description="Consecutive failures that make a worker UNHEALTHY (weight 0, drained)")
    circuit_failure_threshold: int = Field(3, ge=1, description="Consecutive failures that open a worker's circuit")
    circuit_recovery_s: float = Field(60.0, ge=0, description="How long a circuit stays open before one half-open canary")
    drain_grace_s: float = Field(10.0, ge=0, description="How long an UNHEALTHY worker's requests may finish before they are handed back")
    probe_timeout_s: float = Field(0.5, gt=0, description="Deadline of the liveness probe after a broken stream")

    canary_prompts: int = Field(3, ge=1, le=32, description="Canary prompts per model version; checks rotate through them")
    canary_max_tokens: int = Field(8, ge=1, le=64, description="Tokens each canary generates")
    calibration_workers: int = Field(3, ge=1, description="Workers that must agree on the expected tokens (fewer if fewer exist)")
    logit_tolerance: float = Field(
        0.05, ge=0, description="Accepted deviation of a top logit from its calibrated range, relative to its magnitude (min 0.05 absolute)"
    )
    min_margin: float = Field(
        0.05, ge=0, description="Calibration keeps a prompt's tokens only while their greedy choices win by at least this logit margin"
    )
    min_margin_ulps: float = Field(
        8.0, ge=0, description="...and by this many units in the last place of the workers' compute dtype at the top logit's "
        "magnitude (bfloat16 at logits of 16-32: 8 x 0.125 = 1.0), which covers the logits' own rounding and what differs "
        "between workers' kernels (health/canary.py, required_margin)"
    )

    leader_ttl_s: int = Field(2, ge=1, le=60, description="TTL of the leadership lease; a standby takes over within about this")
    dead_retention_s: float = Field(300.0, ge=0, description="How long a DEAD worker's record stays for operators")

    @model_validator(mode="after")
    def _check(self) -> HealthConfig:
        if self.min_check_timeout_s > self.check_timeout_s:
            raise ValueError("min_check_timeout_s exceeds check_timeout_s")
        return self
