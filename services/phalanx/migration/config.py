"""Settings of `phalanx migration` (env PHALANX_MIGRATION_*)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

Strategy = Literal["checkpoint", "transfer-only", "reprefill", "sequential-replay", "restart"]


class MigrationConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_MIGRATION_", extra="ignore")

    migration_id: str = Field("", description="Unique id; empty means <hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    strategy: Strategy = Field(
        "checkpoint",
        description="checkpoint: cheapest of KV transfer, checkpoint restore and re-prefill by the cost model; transfer-only: "
        "KV from a live source else re-prefill; reprefill: always recompute (in parallel); sequential-replay: recompute "
        "one output token per step; restart: the whole group's requests are recomputed after a failure",
    )
    transport: Literal["channel", "grpc"] = Field("channel", description="How KV moves: tensor channel, or the gRPC byte stream")
    # Cost model defaults until measured: loopback gloo ~3.5 GB/s, CPU prefill of the built-in model ~2k tokens/s.
    link_bytes_per_s: float = Field(3.0e9, gt=0, description="KV transfer bandwidth assumed before one is measured")
    prefill_tokens_per_s: float = Field(2000.0, gt=0, description="Prefill rate assumed when a worker reports none")
    kv_restore_overhead_s: float = Field(
        0.03, ge=0, description="Fixed cost of a KV restore (channel setup, RPCs) on top of bytes over the link"
    )
    restore_timeout_s: float = Field(10.0, gt=0, description="Longest one restore (transfer included) may take")
    restore_batch_window_s: float = Field(
        0.005, ge=0, le=1.0,
        description="Restores to one target that come within this of the first (or while a call to it runs) go in one Restore call",
    )
    load_report_max_age_s: float = Field(
        0.5, ge=0, le=10.0,
        description="A target's NATS load report younger than this prices it without a Stats call (workers report every 0.1 s)",
    )
    target_stats_reuse_s: float = Field(
        0.1, ge=0, le=5.0,
        description="The targets' Stats serve the migrations that come within this of the answer (their own restores are counted on top)",
    )
    failover_wait_s: float = Field(
        2.0, ge=0, le=60.0,
        description="How long the requests of a dead engine of a failover slot wait for the slot's next engine (its shadow, "
        "which takes over within a fraction of a second) before they go to other workers; 0 never waits",
    )
    max_attempts: int = Field(4, ge=1, le=16, description="Targets tried per request before giving up")
    remember_s: float = Field(120.0, gt=0, description="How long a finished migration answers repeated calls for the same request")
    parallel: int = Field(16, ge=1, le=256, description="Migrations run at once; the rest wait, lower RequestState.priority (premium) first")
    trigger_on_dead: bool = Field(True, description="Migrate a worker's requests when the health service marks it DEAD")
    # Rebalancing (docs/migration.md, "Rebalancing onto new capacity"; phalanx.migration.rebalance_policy).
    rebalance: bool = Field(
        False,
        description="Move running requests off loaded workers onto new capacity (a worker registered or a spare promoted); "
        "`phalanx up --planner` turns it on",
    )
    rebalance_interval_s: float = Field(0.5, gt=0, le=60.0, description="How often the load reports are checked for a rebalance")
    rebalance_itl_target_s: float = Field(
        0.25, gt=0, description="A worker whose step time is over this (or with requests queued) is loaded; health's "
        "PHALANX_DEGRADATION_SLO_TPOT_S is the natural value",
    )
    rebalance_new_capacity_s: float = Field(
        15.0, ge=0, description="Targets are workers routable for at most this long (registered, or promoted from spare); 0: any worker",
    )
    rebalance_arrival_window_s: float = Field(
        5.0, ge=0, le=60.0,
        description="A worker that became routable while no worker looked loaded is still new capacity if one does within "
        "this long after (load reports average the step time over steps: they show a burst a second or more late); 0: "
        "only capacity that comes while a worker is reported loaded",
    )
    rebalance_target_load: float = Field(
        0.8, gt=0, le=1.0, description="A target's step time must be within this fraction of rebalance_itl_target_s",
    )
    rebalance_max_moves_per_worker: int = Field(4, ge=1, le=64, description="Requests that leave one worker, or reach one, per round")
    rebalance_cooldown_s: float = Field(
        3.0, ge=0, description="A worker that was the source or target of a move is neither again for this long",
    )
    rebalance_request_memory_s: float = Field(30.0, ge=0, description="A request moved by a rebalance is not moved again for this long")
    rebalance_min_remaining_tokens: int = Field(
        4, ge=0, description="Requests with fewer output tokens than this still to generate stay where they are",
    )
    rebalance_park_ttl_s: float = Field(10.0, gt=0, description="How long a rebalanced request's KV waits on its source for the transfer")
