"""Encoder pool settings (env prefix PHALANX_ENCODER_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EncoderPoolConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_ENCODER_", extra="forbid", frozen=True)

    encoder_id: str = Field("", description="Unique id; empty means encoder-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")

    image_encoder: str = Field(
        "tiny-clip", description="Vision tower for images and video: a built-in (tiny-clip) or a HF CLIP directory; empty: no images"
    )
    audio_encoder: str = Field(
        "tiny-whisper", description="Audio encoder: a built-in (tiny-whisper) or a HF Whisper directory; empty: no audio"
    )
    llm_hidden_size: int = Field(256, ge=1, description="Hidden size of the LLM the projectors feed (the built-in tiny models: 256)")
    embedding_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="dtype the embeddings leave in: 16-bit halves the bytes through the router to the worker (which casts them to "
        "its model's dtype), at the cost of rounding the encoder's float32 output",
    )
    seed: int = Field(0, ge=0, description="Seed of built-in weights and untrained projectors: equal on every replica")

    max_batch: int = Field(16, ge=1, le=256, description="Units (images, video frames, 30 s audio chunks) per batch, one modality each")
    max_backlog_ms: float = Field(
        5000.0, gt=0, description="Estimated work queued past which new requests get RESOURCE_EXHAUSTED with a retry hint"
    )
    max_queued_units: int = Field(1024, ge=1, description="Units queued past which new requests are refused, whatever their cost")
    cost_ewma_alpha: float = Field(0.2, gt=0, le=1, description="Weight of the newest batch in the per-unit cost estimate")

    max_item_bytes: int = Field(32 * 1024 * 1024, ge=1, description="Largest media item accepted")
    max_image_pixels: int = Field(40_000_000, ge=1, description="Largest decoded image (width x height)")
    default_video_frames: int = Field(8, ge=1, description="Frames taken from a video whose request names no max_frames")
    max_video_frames: int = Field(64, ge=1, description="Most frames one video may ask for")
    max_video_source_frames: int = Field(100_000, ge=1, description="Longest video decoded, in frames")
    max_audio_seconds: float = Field(600.0, gt=0, description="Longest audio accepted")

    torch_threads: int = Field(2, ge=1, description="Threads of torch's CPU ops for encoding")
    device: str = Field(
        "cpu", description="torch device the encoders run on: cpu, cuda, cuda:1 …; the embeddings leave on the CPU either way"
    )
    load_publish_interval_s: float = Field(0.5, gt=0, description="How often the backlog in the etcd registration is refreshed")
    shutdown_grace_s: float = Field(2.0, ge=0, description="How long in-flight encodes may finish at shutdown")
    hold_s: float = Field(
        60.0, gt=0, description="How long an Encode with `deliver` keeps its embeddings for workers to fetch (then a resume re-encodes)"
    )
    max_held_bytes: int = Field(1 << 30, ge=1, description="Embeddings held for direct delivery past which the oldest are dropped")
    channel_timeout_s: float = Field(10.0, gt=0, description="Timeout of tensor-channel setup and transfers to workers")
    channels: bool = Field(True, description="Run a tensor-channel endpoint (advertised in etcd) for direct delivery; off: gRPC only")
