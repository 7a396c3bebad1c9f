"""Router settings (env prefix PHALANX_ROUTER_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

TierName = Literal["premium", "standard", "best_effort"]


class TenantPolicy(BaseSettings):
    """What one tenant may ask for."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    default_tier: TierName = Field("standard", description="Tier of requests that name none")
    max_tier: TierName = Field("premium", description="Highest tier the tenant may request")
    # Limits (docs/tenants.md); None: the router's tenant_limits default. 0: unlimited.
    max_streams: int | None = Field(None, ge=0, description="Streams the tenant may have in flight across the routers (queued included)")
    tokens_per_minute: int | None = Field(
        None, ge=0, description="Prompt + generated tokens per minute across the routers (a token bucket holding one minute's worth)"
    )
    max_prompt_tokens: int | None = Field(None, ge=0, description="Longest prompt the tenant may send, in tokens")
    weight: int = Field(1, ge=1, le=1000, description="Share of a full router's streams, relative to the other tenants waiting")


class TenantLimitDefaults(BaseSettings):
    """The limits of a tenant whose policy sets none (0: unlimited)."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    max_streams: int = Field(0, ge=0, description="Streams a tenant may have in flight across the routers (queued included)")
    tokens_per_minute: int = Field(0, ge=0, description="Prompt + generated tokens a tenant may use per minute across the routers")
    max_prompt_tokens: int = Field(0, ge=0, description="Longest prompt a tenant may send, in tokens (the router's max_prompt_tokens holds too)")


class RouterConfig(BaseSettings):
    # hide_input_in_errors: a refused setting's error would otherwise quote the whole input, API keys included.
    model_config = SettingsConfigDict(
        env_prefix="PHALANX_ROUTER_", extra="forbid", frozen=True, protected_namespaces=(), hide_input_in_errors=True
    )

    router_id: str = Field("", description="Unique id; empty means router-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host clients reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    model: str = Field(
        "", description="Built-in model, .gguf file or checkpoint directory, for the tokenizer; empty: the workers' built-in model"
    )
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request accepted (RESOURCE_EXHAUSTED beyond)")
    max_prompt_tokens: int = Field(32768, ge=1, description="Longest prompt accepted, in tokens")
    tenants: dict[str, TenantPolicy] = Field(
        default_factory=lambda: {"default": TenantPolicy()},
        description='Known tenants as JSON, e.g. {"default": {}, "batch": {"default_tier": "best_effort", "max_tier": "standard"}}',
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant as JSON; when set, every call needs `authorization: Bearer <key>` and runs as that tenant",
    )
    tenant_limits: TenantLimitDefaults = Field(
        default_factory=TenantLimitDefaults,
        description='Limits of every tenant whose policy in `tenants` sets none, as JSON: {"max_streams": 16, "tokens_per_minute": 60000}',
    )
    max_streams: int = Field(
        0, ge=0,
        description="Streams this router relays at once; past it new requests wait, and the next free slot goes to the waiting "
        "tenant with the fewest streams per unit of weight; 0: no cap (the workers queue)",
    )
    queue_timeout_s: float = Field(
        10.0, ge=0, description="Longest a new request waits for a slot of a full router (max_streams) before RESOURCE_EXHAUSTED; 0: no wait"
    )
    max_queued_per_tenant: int = Field(64, ge=1, description="Requests of one tenant that may wait for a full router's slots")
    tenant_retry_after_s: float = Field(
        1.0, gt=0, description="Retry hint of a request refused for its tenant's streams or a full router's queue"
    )
    tenant_usage_interval_s: float = Field(
        0.2, ge=0, le=10,
        description="How often this router publishes its per-tenant usage (streams, tokens) on NATS (and an eighth of it after "
        "admitting a stream); every router holds the tenant limits for the whole fleet, less the others' last reports, which "
        "expire after 5 of their intervals (a dead router's share frees then). A burst over several routers within one "
        "interval may overshoot a limit by what the others admitted in it. 0: no sharing, each router holds every limit alone",
    )
    tls_cert_file: str = Field("", description="PEM certificate chain; with tls_key_file the router serves TLS only")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    resume_window_s: int = Field(
        30, ge=2, le=3600, description="How long a request stays resumable after its router died or its last token"
    )
    ready_timeout_s: float = Field(30.0, gt=0, description="Longest startup waits for KV snapshots before it serves anyway")
    snapshot_timeout_s: float = Field(2.0, gt=0, description="Deadline of one KvSnapshot call to a worker")
    multiplex_worker_streams: bool = Field(
        True,
        description="Read the tokens of all requests on a worker over one stream (WorkerService.Multiplex, one message per engine"
        " step) instead of a call per request; workers without it get per-request calls either way",
    )
    load_stale_s: float = Field(2.0, gt=0, description="A worker silent for longer is penalised in routing")
    no_worker_retry_after_s: float = Field(1.0, gt=0, description="Retry hint sent when no worker can take a request")
    media_marker: str = Field(
        "<media>", min_length=1,
        description="Where a text prompt puts each media item (in order); a prompt without markers gets its media first",
    )
    media_placeholder_token_id: int = Field(
        0, ge=0, description="Token id of a media position in the prompt sent to workers (a token prompt marks media with it)"
    )
    max_media_tokens: int = Field(
        4096, ge=1, description="Most prompt positions one request's media may take (capped further by the room the context leaves)"
    )
    encode_timeout_s: float = Field(30.0, gt=0, description="Deadline of one Encode call; a timeout tries another encoder")
    embedding_cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="Embeddings of recent images and audio kept by their bytes' digest (a repeat skips the encoder); 0: none"
    )
    media_delivery: Literal["direct", "inline"] = Field(
        "direct",
        description="How media embeddings reach the worker: direct, the encoder keeps them and the worker fetches them over a "
        "tensor channel (gRPC below a size), this router holding only keys and the media bytes; inline, inside the worker "
        "request through this router (the embedding cache applies). A failed direct fetch falls back to inline",
    )
    media_link_bytes_per_s: float = Field(
        1.0e9, gt=0,
        description="Bandwidth joint routing assumes for moving embeddings to a worker: an encoder's measured delivery bandwidth "
        "(advertised in its registration) replaces it for direct delivery; inline delivery pays it twice (encoder to router to worker)",
    )
    media_prefix_overlap: bool = Field(
        True,
        description="Prefill a media request's text before its first media marker on the chosen worker while the encoder runs "
        "(WorkerService.Prefill), instead of after the embeddings come",
    )
    media_prefix_overlap_min_steps: float = Field(
        1.0, ge=0,
        description="Overlap only when the estimated saving (the shorter of the encode and the prefix's prefill) is at least this "
        "many of the worker's engine steps, the prefix's own step being the overlap's cost; 0: whenever a full block is uncached",
    )
    media_prefix_wait_s: float = Field(
        2.0, ge=0,
        description="How long a request whose media are encoded waits for its text prefix's prefill to end; past it the request "
        "goes anyway and the worker computes what is not cached yet (a slow or hung worker does not hold it)",
    )
    quarantine_after_crashes: int = Field(
        2, ge=0, le=8,
        description="Worker crashes a request must have seen, as their one common suspect, before it is ended with "
        "REQUEST_QUARANTINED and its fingerprint refused fleet-wide (docs/migration.md, \"Poison requests\"); 0: never",
    )
    quarantine_ttl_s: int = Field(
        3600, ge=1, le=7 * 24 * 3600,
        description="How long a quarantined fingerprint (model, prompt, media, sampling) is refused by every router (an etcd lease)",
    )
    quarantine_probation_s: float = Field(
        2.0, ge=0, le=60,
        description="After a crash, how long a moved suspect keeps the other suspects of that crash off its new worker (while "
        "another can take them), and how long it must run there without a crash to be cleared of that crash",
    )
    admission: Literal["slo", "off"] = Field(
        "slo",
        description="slo: admit a new request only when its predicted TTFT and its worker's ITL with it fit its tier's SLOs, hold it "
        "(higher tiers first) while it still can, refuse it (RESOURCE_EXHAUSTED, retry hint from the queue's drain rate) when it "
        "cannot (docs/health-and-chaos.md, \"Admission\"); off: admit everything and let the workers queue it, as most engines do",
    )
    admission_max_queued: int = Field(256, ge=1, description="Requests SLO admission holds at once; beyond, the lowest tier's newest is refused")
    admission_headroom: float = Field(
        0.9, gt=0, le=1, description="SLO admission admits when the predicted TTFT and ITL are within this share of the SLOs"
    )
    admission_max_hold_share: float = Field(
        0.5, gt=0, le=1,
        description="SLO admission holds a request at most this share of its TTFT SLO (the client's and the gateway's share of "
        "its TTFT come on top of the router's)",
    )
    admission_hold_confidence: float = Field(
        0.95, ge=0, lt=1,
        description="Where the streams a router relays cannot tell when batch slots free (no max_tokens, other routers' streams), "
        "SLO admission holds a request only when slots freeing at the measured drain rate bring its own within its hold at least "
        "this likely; otherwise it is refused at once rather than after a wait",
    )
    admission_ttft_slo_s: float = Field(2.0, gt=0, description="TTFT SLO of admission while the health service publishes none")
    admission_itl_slo_s: float = Field(0.25, gt=0, description="Inter-token latency SLO of admission while the health service publishes none")
    admission_tier_slo_factors: dict[TierName, float] = Field(
        default_factory=dict,
        description='Each tier\'s SLOs as a multiple of the deployment\'s, as JSON, e.g. {"best_effort": 2.0}; a tier left out gets 1',
    )
    migration: bool = Field(
        True,
        description="Move a stream whose worker failed or hung to another worker (through the migration service); off: the "
        "stream fails, as in engines without migration (the goodput bench's baseline under faults)",
    )
    premium_at_level_4: bool = Field(
        False,
        description="At degradation level 4 keep admitting premium requests while any worker can take them "
        "(off: level 4 rejects every new request, so that the fleet drains the ones in flight)",
    )
    # Disaggregated serving (router/disagg.py): only with prefill workers registered; without them nothing changes.
    disagg_mode: Literal["conditional", "always"] = Field(
        "conditional",
        description="Disaggregation: conditional prefills remotely when that is estimated cheaper; always whenever a prefill "
        "worker can take the prompt and the decode worker has room (short prompts still prefill locally)",
    )
    disagg_min_prompt_tokens: int = Field(
        256, ge=1,
        description="Disaggregation: prompts with fewer tokens uncached on the decode worker prefill there (a short prefill costs "
        "less than moving its KV)",
    )
    disagg_max_prefill_queue: int = Field(
        4, ge=0, description="Disaggregation: a prefill worker with this many requests queued is saturated (0: any queue is)"
    )
    disagg_interference: float = Field(
        0.25, ge=0,
        description="Disaggregation: how much a local prefill's time counts again per sequence decoding on the decode worker "
        "(each of them waits for it); 0 compares times to first token alone",
    )
    disagg_transfer_s_per_token: float = Field(
        2e-5, ge=0, description="Disaggregation: estimated seconds to move one token's KV from a prefill to a decode worker"
    )
    disagg_transfer_timeout_s: float = Field(
        5.0, gt=0,
        description="Disaggregation: longest a decode worker may take to fetch a prefilled request's KV; past it (or on any "
        "failure) the request prefills again on a decode worker",
    )

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        unknown = sorted(set(self.api_keys.values()) - set(self.tenants))
        if unknown:
            raise ValueError(f"api_keys name unknown tenants {unknown}")
        for name, policy in self.tenants.items():
            if _RANK[policy.default_tier] < _RANK[policy.max_tier]:
                raise ValueError(f"tenant {name!r}: default_tier is above max_tier")
        return self


# Lower rank = higher priority.
_RANK = {"premium": 0, "standard": 1, "best_effort": 2}
