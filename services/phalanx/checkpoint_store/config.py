"""Checkpoint store settings (env prefix PHALANX_CHECKPOINT_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CheckpointStoreConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_CHECKPOINT_", extra="forbid", frozen=True)

    store_id: str = Field("", description="Unique id; empty means ckpt-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server and the tensor-channel endpoint bind")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")

    memory_limit_bytes: int = Field(
        1 << 30, ge=1, description="KV and media embeddings held in memory; beyond it the least recently updated requests' spill to spill_dir"
    )
    spill_dir: str = Field(
        "", description="Directory for spilled KV and media embeddings (a private subdirectory is made); empty: the system temp dir"
    )
    spill_retry_s: float = Field(
        5.0, gt=0,
        description="After a failed spill (disk full), how long the store drops what would spill before it tries the disk again",
    )
    retention_s: float = Field(
        600.0, gt=0, description="A request with no segment for this long is dropped (its worker died and nobody restored it)"
    )
    channel_timeout_s: float = Field(30.0, gt=0, description="Default deadline of a restore over a tensor channel (SendKv)")
    max_message_bytes: int = Field(
        256 * 1024 * 1024, ge=4 * 1024 * 1024, description="Largest gRPC message accepted (a segment's KV rides in one message)"
    )
    nice: int = Field(
        10, ge=0, le=19,
        description="Lower CPU priority by this much: checkpointing is background work, and where the store shares "
        "cores with workers (one machine) their decode steps come first; 0 keeps the default priority",
    )
    shutdown_grace_s: float = Field(1.0, ge=0, description="How long in-flight RPCs may finish at shutdown")
    torch_threads: int = Field(
        1, ge=1,
        description="Threads of torch's CPU ops. The store only copies KV, which gains little from more; on cores "
        "shared with workers their spinning cost many times the copy itself",
    )
