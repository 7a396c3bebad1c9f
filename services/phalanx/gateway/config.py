"""Gateway settings (env prefix PHALANX_GATEWAY_)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.router.admission import Tier
from phalanx.router.config import TenantPolicy


class GatewayConfig(BaseSettings):
    """The OpenAI-compatible HTTP gateway: where it listens, which routers it calls, whose keys it accepts.

    ``tenants`` and ``api_keys`` have the router's format (PHALANX_ROUTER_TENANTS / _API_KEYS): give both services
    the same values. The gateway checks a key itself and forwards it, so the router runs the request as that tenant.
    """

    # hide_input_in_errors: a refused setting's error would otherwise quote the whole input, API keys included.
    model_config = SettingsConfigDict(
        env_prefix="PHALANX_GATEWAY_", extra="forbid", frozen=True, protected_namespaces=(), hide_input_in_errors=True
    )

    host: str = Field("127.0.0.1", description="Address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    router: str = Field(
        "127.0.0.1:50051", description='Router target of the SDK: "host:port", or "ipv4:h1:p1,h2:p2" for several replicas'
    )
    model: str = Field(
        "",
        description="Built-in model or checkpoint directory the routers serve: its name in /v1/models and its tokenizer's chat "
        "template; empty: the model the router's workers report",
    )
    served_model_name: str = Field("", description="The model id clients name (default: model, or the workers' model)")
    tenants: dict[str, TenantPolicy] = Field(
        default_factory=lambda: {"default": TenantPolicy()},
        description='Known tenants as JSON, as the router\'s: {"default": {}, "batch": {"default_tier": "best_effort", "max_tier": "standard"}}',
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant as JSON, as the router's; when set, every request needs `Authorization: Bearer <key>`; "
        "empty: open, every request runs as tenant default",
    )
    router_api_key: str = Field("", description="Key sent to the router for requests of an open gateway (no api_keys)")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a chat completion that sets none (completions: 16, as OpenAI)")
    request_timeout_s: float = Field(600.0, gt=0, description="Longest one request may take, retries and resumes included")
    retry_max_attempts: int = Field(
        8, ge=1, le=100, description="Router calls in a row without a new token before a request fails (the SDK's RetryPolicy)"
    )
    shutdown_grace_s: float = Field(5.0, ge=0, description="How long requests in flight may finish after SIGTERM")
    responses_api: bool = Field(
        True, description="Serve /v1/responses (needs etcd: PHALANX_ETCD_ENDPOINT); off: the gateway never talks to etcd"
    )
    response_ttl_s: int = Field(
        3600, ge=10, le=30 * 86400, description="How long a response (its status, output and events) is kept, from its creation"
    )
    response_flush_interval_s: float = Field(
        0.05, gt=0, le=5, description="Longest a relayed response's new tokens wait before they are written to etcd"
    )
    response_poll_interval_s: float = Field(
        0.05, gt=0, le=5, description="How often a stream of a response relayed by another gateway reads etcd for new events"
    )
    response_adopt_interval_s: float = Field(
        1.0, gt=0, le=60, description="How often the gateway looks for unfinished responses whose gateway died, to relay them on"
    )

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        unknown = sorted(set(self.api_keys.values()) - set(self.tenants))
        if unknown:
            raise ValueError(f"api_keys name unknown tenants {unknown}")
        for name, policy in self.tenants.items():
            if Tier.from_name(policy.default_tier) < Tier.from_name(policy.max_tier):
                raise ValueError(f"tenant {name!r}: default_tier is above max_tier")
        if self.api_keys and self.router_api_key:
            raise ValueError("router_api_key is for an open gateway; with api_keys each request forwards its own key")
        return self
