"""Prometheus metrics of a worker (phalanx_worker_* names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self, worker_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["worker"]
        self.requests = Counter("phalanx_worker_requests", "Generate requests by outcome", ["worker", "status"], registry=self.registry)
        self.generated_tokens = Counter("phalanx_worker_generated_tokens", "Tokens streamed", labels, registry=self.registry)
        self.prompt_tokens = Counter("phalanx_worker_prompt_tokens", "Prompt tokens received", labels, registry=self.registry)
        self.cached_prompt_tokens = Counter(
            "phalanx_worker_cached_prompt_tokens", "Prompt tokens served from the prefix cache", labels, registry=self.registry
        )
        self.detached = Counter(
            "phalanx_worker_detached_requests", "Running requests left by their last reader (the stream broke)", labels, registry=self.registry
        )
        self.detach_timeouts = Counter(
            "phalanx_worker_detach_timeouts", "Detached requests aborted because nobody attached within the grace", labels,
            registry=self.registry,
        )
        self.attaches = Counter("phalanx_worker_attaches", "Attach calls that found their request", labels, registry=self.registry)
        self.cancels = Counter("phalanx_worker_cancels", "Cancel calls that found their request", labels, registry=self.registry)
        self.ttft = Histogram("phalanx_worker_ttft_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("phalanx_worker_itl_seconds", "Inter-token latency", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.step_time = Gauge("phalanx_worker_step_time_seconds", "EMA of the engine step time", labels, registry=self.registry)
        self.running = Gauge("phalanx_worker_running_seqs", "Sequences in the running batch", labels, registry=self.registry)
        self.waiting = Gauge("phalanx_worker_queue_depth", "Requests waiting for admission", labels, registry=self.registry)
        self.free_blocks = Gauge("phalanx_worker_free_kv_blocks", "KV blocks that can be allocated", labels, registry=self.registry)
        self.preemptions = Gauge("phalanx_worker_preemptions", "Sequences preempted for lack of KV blocks", labels, registry=self.registry)
        # Named apart from phalanx_worker_status, which the health service exports (its view of the worker).
        self.serving = Gauge("phalanx_worker_serving", "1 serving, 0.5 draining or quarantined, 0 stopped", labels, registry=self.registry)
        self.batch_scale = Gauge(
            "phalanx_worker_batch_scale",
            "Share of max_num_seqs admitted: 1, 0.75 at degradation levels 1 and 2, 0.5 from level 3 on",
            labels,
            registry=self.registry,
        )
        self.computed_tokens = Counter(
            "phalanx_worker_computed_tokens", "Tokens computed by the engine (prompt, recompute and decode)", labels, registry=self.registry
        )
        self.canary_tokens = Counter(
            "phalanx_worker_canary_tokens", "Tokens computed by the engine for canaries (health checks)", labels, registry=self.registry
        )
        self.canaries = Counter("phalanx_worker_canaries", "Canary requests admitted", labels, registry=self.registry)
        self.faults_active = Gauge(
            "phalanx_worker_faults_active", "1 while a fault of this kind is injected (chaos)", ["worker", "kind"], registry=self.registry
        )
        self.restores = Counter("phalanx_worker_restores", "Requests migrated onto this worker", labels, registry=self.registry)
        self.checkpoint_lag = Gauge(
            "phalanx_checkpoint_lag_tokens", "KV positions computed here and not yet captured for the checkpoint store", labels,
            registry=self.registry,
        )
        self.checkpoint_bytes = Counter(
            "phalanx_checkpoint_sent_bytes", "KV bytes streamed to the checkpoint store", labels, registry=self.registry
        )
        self.checkpoint_skipped = Counter(
            "phalanx_checkpoint_skipped_captures", "Steps whose KV capture waited for the store (backpressure)", labels,
            registry=self.registry,
        )
        self.media_fetch_seconds = Histogram(
            "phalanx_worker_media_fetch_seconds", "Time to fetch one request's media embeddings from an encoder, by transport "
            "(channel, grpc)", [*labels, "transport"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.media_fetch_bytes = Counter(
            "phalanx_worker_media_fetch_bytes", "Media embedding bytes fetched from encoders, by transport (channel, grpc)",
            [*labels, "transport"], registry=self.registry,
        )
        self.media_fetch_failures = Counter(
            "phalanx_worker_media_fetch_failures", "Media fetches that failed (the router encodes again)", labels, registry=self.registry,
        )
        self.kv_sent_bytes = Counter(
            "phalanx_worker_kv_sent_bytes", "KV bytes this worker sent as a KV source (hand-overs to decode workers, "
            "migrations), by transport (channel, grpc)", [*labels, "transport"], registry=self.registry,
        )
        for transport in ("channel", "grpc"):
            self.media_fetch_bytes.labels(worker=worker_id, transport=transport)
            self.kv_sent_bytes.labels(worker=worker_id, transport=transport)
        self.worker_id = worker_id
        # This worker's series from the start: a dashboard shows zeros, and rate() sees the first event.
        for metric in (self.restores, self.checkpoint_bytes, self.checkpoint_skipped):
            self.for_worker(metric)

    def for_worker(self, metric):
        return metric.labels(worker=self.worker_id)
