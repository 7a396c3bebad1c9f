"""Settings of the ERT manager (env prefix PHALANX_ERT_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.model.config import DEFAULT_MODEL


class ErtManagerConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_ERT_", extra="forbid", frozen=True)

    instance_id: str = Field("", description="Unique id; empty means ert-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server (health only) binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    model: str = Field(DEFAULT_MODEL, description="The MoE model whose experts the table places")
    leader_ttl_s: int = Field(2, ge=1, le=60, description="Lease TTL of the leadership key: how long a dead leader's standby waits")
