"""Prometheus metrics of an encoder (``phalanx_encoder_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx.encoder_pool.cost import Admission, Modality

_BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.items = Counter("phalanx_encoder_items", "Media items by modality and outcome (ok, invalid, overloaded, error)",
                             ["modality", "result"], registry=r)
        self.units = Counter("phalanx_encoder_units", "Units encoded (images, video frames, 30 s audio chunks)", ["modality"], registry=r)
        self.batch_seconds = Histogram("phalanx_encoder_batch_seconds", "Time of one encode batch", ["modality"],
                                       buckets=_BATCH_BUCKETS, registry=r)
        self.batch_size = Histogram("phalanx_encoder_batch_size", "Units per batch", ["modality"], buckets=_SIZE_BUCKETS, registry=r)
        self.unit_cost_ms = Gauge("phalanx_encoder_unit_cost_ms", "Learned cost of one unit (EWMA of batch time / units)",
                                  ["modality"], registry=r)
        self.queued_units = Gauge("phalanx_encoder_queued_units", "Units admitted and not yet encoded", ["modality"], registry=r)
        self.backlog_ms = Gauge("phalanx_encoder_backlog_ms", "Estimated time to encode everything queued", registry=r)
        self.request_seconds = Histogram("phalanx_encoder_request_seconds", "Encode RPC time from admission to the last unit",
                                         buckets=_BATCH_BUCKETS, registry=r)
        self.held_results = Gauge("phalanx_encoder_held_results", "Embeddings held for workers to fetch (direct delivery)", registry=r)
        self.held_bytes = Gauge("phalanx_encoder_held_bytes", "Bytes of the embeddings held for workers to fetch", registry=r)
        self.sent_bytes = Counter("phalanx_encoder_sent_bytes", "Held embeddings sent to workers, by transport (channel, grpc)",
                                  ["transport"], registry=r)
        self.expired = Counter("phalanx_encoder_held_expired", "Held embeddings dropped unfetched-or-not at their hold time or "
                               "past max_held_bytes", registry=r)
        for transport in ("channel", "grpc"):
            self.sent_bytes.labels(transport=transport)
        for m in Modality:
            for result in ("ok", "invalid", "overloaded", "error"):
                self.items.labels(modality=m.value, result=result)
            self.units.labels(modality=m.value)

    def observe_batch(self, modality: Modality, units: int, elapsed_ms: float) -> None:
        self.units.labels(modality=modality.value).inc(units)
        self.batch_seconds.labels(modality=modality.value).observe(elapsed_ms / 1000)
        self.batch_size.labels(modality=modality.value).observe(units)

    def observe_load(self, admission: Admission) -> None:
        for m in Modality:
            self.unit_cost_ms.labels(modality=m.value).set(admission.cost.unit_ms(m))
            self.queued_units.labels(modality=m.value).set(admission.queued[m])
        self.backlog_ms.set(admission.backlog_ms)
