"""Prometheus metrics of the migration service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# core.METHOD_NAMES' values (core imports this module).
METHODS = ("transfer", "checkpoint", "reprefill", "sequential_replay")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class MigrationMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.migrations = Counter("phalanx_migration", "Requests migrated, by method", ["method"], registry=self.registry)
        self.duration = Histogram(
            "phalanx_migration_duration_seconds", "From the migration call to the request running on its target", ["method"],
            buckets=_BUCKETS, registry=self.registry,
        )
        self.failures = Counter("phalanx_migration_failures", "Requests no target could take", registry=self.registry)
        self.left_to_router = Counter(
            "phalanx_migration_left_to_router",
            "Requests of a dead worker left to the router relaying them: their media embeddings are only there",
            registry=self.registry,
        )
        self.kv_bytes = Counter("phalanx_migration_kv_bytes", "KV bytes moved into targets", registry=self.registry)
        self.restore_calls = Histogram(
            "phalanx_migration_restore_batch_size", "Requests per Restore call to a target", buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.worker_triggers = Counter(
            "phalanx_migration_worker_triggers", "Whole-worker migrations, by what triggered them", ["trigger"], registry=self.registry
        )
        self.rebalanced = Counter(
            "phalanx_migration_rebalanced", "Requests parked on a loaded worker to move onto new capacity (a rebalance)",
            registry=self.registry,
        )
        self.rebalance_placed = Counter(
            "phalanx_migration_rebalance_placed", "Rebalanced requests restored, by whether the planned target took them",
            ["target"], registry=self.registry,
        )
        self.rebalance_failures = Counter(
            "phalanx_migration_rebalance_failures", "Rebalance moves whose source did not park (unreachable, refused)",
            registry=self.registry,
        )
        # Every label set from the start: a dashboard shows zeros rather than no data, and a series that appeared with its
        # first event would lose that event to rate().
        for method in METHODS:
            self.migrations.labels(method=method)
            self.duration.labels(method=method)
        for trigger in ("dead", "rpc"):
            self.worker_triggers.labels(trigger=trigger)
        for target in ("planned", "other"):
            self.rebalance_placed.labels(target=target)
