"""Prometheus metrics of a router (phalanx_router_* names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx.planner.observations import TOKEN_BUCKETS
from phalanx.router.admission import LEVELS_HELP

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Routing decisions take tens of microseconds.
_ROUTING_BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 1e-3, 2.5e-3, 10e-3)


class RouterMetrics:
    """A router's metrics (in `registry`, else a registry of their own), declared by what they watch."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._requests(self.registry)
        self._routing(self.registry)
        self._streams(self.registry)
        self._media(self.registry)
        self._tenants(self.registry)

    def _requests(self, r: CollectorRegistry) -> None:
        """Requests, their lengths and latencies: what the planner predicts from and what the SLOs judge."""
        self.requests = Counter("phalanx_router_requests", "Requests by tier and final status", ["tier", "status"], registry=r)
        # What the planner predicts from (planner/observations.py): arrivals, prompt and output lengths per request, each
        # counted once per request (a Resume or a client's retry of a running request is not a new arrival).
        self.arrivals = Counter("phalanx_router_arrivals", "Requests admitted and routed, by tier", ["tier"], registry=r)
        self.input_tokens = Histogram(
            "phalanx_router_input_tokens", "Prompt tokens per admitted request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.output_tokens = Histogram(
            "phalanx_router_output_tokens", "Tokens generated per finished request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.ttft = Histogram("phalanx_router_ttft_seconds", "Time to first token seen by the router", ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("phalanx_router_itl_seconds", "Inter-token latency seen by the router", ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.slo_violations = Counter(
            "phalanx_router_slo_violations",
            "First tokens (kind=ttft) and token gaps (kind=itl) slower than the latency SLO in force: the health service's "
            "TTFT / TPOT SLO, x2 from degradation level 3 on",
            ["kind"], registry=r,
        )

    def _routing(self, r: CollectorRegistry) -> None:
        """Routing and what it routes by: the workers, their KV blocks and the degradation level."""
        self.routing = Histogram("phalanx_router_routing_seconds", "Time to pick a worker", buckets=_ROUTING_BUCKETS, registry=r)
        self.cached_tokens = Counter("phalanx_router_routed_cached_tokens", "Prompt tokens the chosen worker held already", registry=r)
        self.workers = Gauge("phalanx_router_workers", "Workers known to routing", registry=r)
        self.indexed_blocks = Gauge("phalanx_router_indexed_blocks", "KV blocks in the routing index", registry=r)
        self.kv_resyncs = Counter("phalanx_router_kv_resyncs", "KvSnapshot re-syncs after gaps or restarts", registry=r)
        self.degradation = Gauge("phalanx_router_degradation_level", f"Degradation level in force ({LEVELS_HELP})", registry=r)
        self.bus_rejected = Counter(
            "phalanx_bus_rejected_messages", "NATS messages refused (undecodable, not from the subject's worker, or failing their checks)",
            ["subject_kind"], registry=r,
        )

    def _streams(self, r: CollectorRegistry) -> None:
        """The relayed streams, and their moves to other workers."""
        self.tokens = Counter("phalanx_router_tokens", "Tokens relayed to clients", registry=r)
        self.active = Gauge("phalanx_router_active_streams", "Streams being relayed", registry=r)
        self.resumes = Counter("phalanx_router_resumes", "Resume calls by outcome", ["status"], registry=r)
        self.unrecorded = Counter(
            "phalanx_router_unrecorded_requests", "Requests served without an etcd record (not resumable elsewhere)", registry=r
        )
        self.migrations = Counter("phalanx_router_migrations", "Streams moved to another worker by the migration service", registry=r)
        self.migration_stall = Histogram(
            "phalanx_migration_stall_seconds", "Gap between the tokens before and after a migration, as the client saw it",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0), registry=r,
        )
        self.worker_crashes = Counter(
            "phalanx_router_worker_crashes", "Worker deaths seen while relaying requests (their streams broke as a dead process's do)",
            registry=r,
        )
        self.quarantined = Counter(
            "phalanx_router_requests_quarantined", "Requests ended as the one common suspect of several worker crashes", registry=r
        )
        self.quarantine_refusals = Counter(
            "phalanx_router_quarantine_refusals", "Requests refused before routing: their fingerprint is quarantined", registry=r
        )
        self.quarantined_fingerprints = Gauge(
            "phalanx_router_quarantined_fingerprints", "Request fingerprints quarantined fleet-wide, as this router follows them", registry=r
        )
        self.handoffs = Counter("phalanx_router_handoffs", "Requests moved to another worker after a drain", registry=r)

    def _media(self, r: CollectorRegistry) -> None:
        """Media requests: the embedding caches, encodes again, encoder retries and prefix prefills."""
        self.embedding_cache_hits = Counter(
            "phalanx_router_embedding_cache_hits", "Media requests whose every item's embeddings came from the router's cache", registry=r
        )
        self.media_reencodes = Counter(
            "phalanx_router_media_reencodes", "Media encoded again inline for a directly delivered request, by cause (fetch_failed: a "
            "worker could not fetch them, the encoder died or dropped them; migration: a migration carries the rows)", ["cause"], registry=r,
        )
        self.media_inline_bytes = Counter(
            "phalanx_router_media_inline_bytes", "Embedding bytes this router received from encoders (inline delivery and fallbacks; "
            "0 on the direct path)", registry=r,
        )
        for cause in ("fetch_failed", "migration"):
            self.media_reencodes.labels(cause=cause)
        self.encode_retries = Counter(
            "phalanx_router_encode_retries", "Encode calls retried on another encoder (gone, overloaded or too slow)", registry=r
        )
        self.prefix_prefills = Counter(
            "phalanx_router_media_prefix_prefills",
            "Text prefixes of media requests prefilled on the chosen worker while the encoder ran, by result (ok; failed; unfinished: "
            "the request went on without it, past media_prefix_wait_s or on an encoding error)", ["result"], registry=r,
        )

    def _tenants(self, r: CollectorRegistry) -> None:
        """Tenant limits, here and (reported by the other routers) across the fleet."""
        # Tenant labels are bounded: the configured tenants by name, any other as "other" (tenant_label).
        self.tenant_rejections = Counter(
            "phalanx_router_tenant_rejections",
            "New requests refused by a tenant limit, by tenant and limit (max_streams, tokens_per_minute, max_prompt_tokens, "
            "queue: waited too long for a full router)", ["tenant", "limit"], registry=r,
        )
        self.tenant_tokens = Counter(
            "phalanx_router_tenant_tokens", "Tokens charged to tenants' tokens per minute (prompt + generated)", ["tenant"], registry=r
        )
        self.fleet_peers = Gauge(
            "phalanx_router_fleet_peers", "Other routers whose tenant usage reports are live (counted against tenant limits)", registry=r
        )
        self.fleet_streams = Gauge(
            "phalanx_router_tenant_fleet_streams", "A tenant's streams at the other live routers, as they last reported them",
            ["tenant"], registry=r,
        )
        self.fleet_tokens = Counter(
            "phalanx_router_tenant_fleet_tokens",
            "Tokens other routers charged to a tenant's tokens_per_minute, taken from this router's bucket as their reports came",
            ["tenant"], registry=r,
        )
        self.queued = Gauge("phalanx_router_queued_requests", "New requests waiting for a slot of a full router (max_streams)", registry=r)
        self.admission = Counter(
            "phalanx_router_admission",
            "SLO admission decisions: outcome admitted or refused, the refusal's reason, and whether it was held first (docs/health-and-chaos.md)",
            ["outcome", "reason", "held"], registry=r,
        )
        self.admission_held = Gauge("phalanx_router_admission_held", "New requests SLO admission holds until a worker has room", registry=r)
        self.admission_wait = Histogram(
            "phalanx_router_admission_wait_seconds", "How long SLO admission held a request before admitting or refusing it",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.admission_hold_late = Histogram(
            "phalanx_router_admission_hold_late_seconds",
            "How much later than predicted a held request's slot opened (negative: sooner; a failed hold: at least its deadline)",
            buckets=(-2.0, -1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0), registry=r,
        )
        self.admission_hold_margin = Gauge(
            "phalanx_router_admission_hold_margin_seconds",
            "How much sooner than its hold ends a request's slot must be predicted to open for it to be held (from hold_late)", registry=r,
        )


def tenant_label(tenant: str, configured: frozenset[str]) -> str:
    """A tenant as a metric label: its name if configured, else "other" (labels stay few, whatever callers send)."""
    return tenant if tenant in configured else "other"
