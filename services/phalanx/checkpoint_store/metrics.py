"""Prometheus metrics of the checkpoint store."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx.checkpoint_store.store import CheckpointStore

_RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class CheckpointMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.bytes_received = Counter("phalanx_checkpoint_bytes_received", "KV bytes received in segments", registry=r)
        self.segments = Counter(
            "phalanx_checkpoint_segments", "Segments received by outcome (applied, duplicate, gap, corrupt, superseded)", ["result"], registry=r
        )
        self.unchecked_segments = Counter(
            "phalanx_checkpoint_unchecked_segments", "Segments with KV applied without a checksum (a writer from before checksums)", registry=r
        )
        self.corrupt_restores = Counter(
            "phalanx_checkpoint_corrupt_restores", "Restores refused because held KV failed its checksum (the KV is dropped)", registry=r
        )
        self.spill_failures = Counter(
            "phalanx_checkpoint_spill_failures",
            "Spills of KV (and media embeddings) to disk that failed (disk full, I/O error); what was in memory was dropped", registry=r,
        )
        self.kv_dropped = Counter(
            "phalanx_checkpoint_kv_dropped_requests",
            "Requests whose KV the store dropped because it could not spill it (their restores re-prefill)", registry=r,
        )
        self.spill_failing = Gauge("phalanx_checkpoint_spill_failing", "1 while spilling fails (since the last failed spill)", registry=r)
        # The store keeps these totals; the counters follow them (see observe_store).
        self._seen_spill_failures = self._seen_kv_dropped = 0
        self.requests = Gauge("phalanx_checkpoint_requests", "Requests with a commit record", registry=r)
        self.memory_bytes = Gauge("phalanx_checkpoint_memory_bytes", "KV and media-embedding bytes held in memory", registry=r)
        self.spilled_bytes = Gauge("phalanx_checkpoint_spilled_bytes", "KV and media-embedding bytes spilled to disk", registry=r)
        self.memory_limit_bytes = Gauge(
            "phalanx_checkpoint_memory_limit_bytes", "Bytes (KV, media embeddings) the store holds in memory before it spills (its setting)",
            registry=r,
        )
        self.committed_tokens = Gauge("phalanx_checkpoint_committed_tokens", "KV token positions committed, all requests", registry=r)
        self.connected_workers = Gauge("phalanx_checkpoint_connected_workers", "Workers with an open checkpoint stream", registry=r)
        self.restores = Counter("phalanx_checkpoint_restores", "Requests whose KV was restored, by transport", ["transport"], registry=r)
        self.restore_seconds = Histogram(
            "phalanx_checkpoint_restore_seconds", "Duration of one restore call (all its requests), by transport", ["transport"],
            buckets=_RESTORE_BUCKETS, registry=r,
        )
        for result in ("applied", "duplicate", "gap", "corrupt", "superseded"):
            self.segments.labels(result=result)
        # Every label set from the start: a series that appears with its first event loses that event to rate().
        for transport in ("channel", "grpc"):
            self.restores.labels(transport=transport)
            self.restore_seconds.labels(transport=transport)

    def observe_store(self, store: CheckpointStore) -> None:
        """Copy the store's gauges (cheap: running totals)."""
        self.requests.set(len(store))
        self.memory_bytes.set(store.memory_bytes)
        self.spilled_bytes.set(store.spilled_bytes)
        self.memory_limit_bytes.set(store.memory_limit_bytes)
        self.committed_tokens.set(store.committed_tokens)
        self.spill_failures.inc(store.spill_failures_total - self._seen_spill_failures)
        self.kv_dropped.inc(store.kv_dropped_total - self._seen_kv_dropped)
        self._seen_spill_failures, self._seen_kv_dropped = store.spill_failures_total, store.kv_dropped_total
        self.spill_failing.set(1 if store.spill_failing else 0)
