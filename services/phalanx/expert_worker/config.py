"""Settings of an expert worker (env prefix PHALANX_EXPERT_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.model.config import DEFAULT_MODEL


class ExpertWorkerConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_EXPERT_", extra="forbid", frozen=True)

    worker_id: str = Field("", description="Unique id; empty means ew-<hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server and the tensor-channel endpoint bind")
    port: int = Field(0, ge=0, le=65535, description="gRPC port of the control path (ExpertService); 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    model: str = Field(DEFAULT_MODEL, description="The MoE model whose experts this worker hosts (built-in, .gguf or HF Mixtral dir)")
    seed: int | None = Field(None, ge=0, description="Seed of a built-in model's weights (default: the model's own)")
    index: int = Field(0, ge=0, description="This worker's slot in the placement: which experts it hosts (ert_manager.table.place)")
    num_expert_workers: int = Field(1, ge=1, description="Expert workers the placement spreads the experts over")
    copies: int = Field(1, ge=1, description="Copies of each expert over the expert workers: 1 primary + copies-1 shadows, each on another worker")
    replicas: bool = Field(
        False, description="Copies are equal active replicas (AWs spread each expert's calls over them) instead of 1 primary + idle shadows"
    )
    device: str = Field(
        "cpu", description="torch device of the expert MLPs: cpu, cuda, cuda:1 … (exchanges with attention workers stage through host memory)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The experts' dtype, the attention workers' engine dtype: auto is theirs (model.ops.auto_dtype)"
    )
    torch_threads: int = Field(
        1,
        ge=1,
        le=1024,
        description="Intra-op threads of the expert MLPs: the attention workers' count keeps outputs bit-identical to a monolith's",
    )
    channel_timeout_s: float = Field(10.0, gt=0, description="Timeout of forming a tensor channel and of one reply")
    batch_window_s: float = Field(
        0.002,
        ge=0,
        le=1.0,
        description="Longest a layer call waits for the other attention workers' calls of that layer, to compute them as one batch"
        " (0: every call on arrival, no batching across attention workers)",
    )
    batch_min_rows: int = Field(256, ge=1, description="A cross-AW batch with this many rows starts at once, whoever has not delivered")
    attention_silence_s: float = Field(
        0.1, gt=0, description="An attention worker that sent nothing for this long is not waited for (dead, hung or idle)"
    )

    @model_validator(mode="after")
    def _check_slot(self) -> ExpertWorkerConfig:
        if self.index >= self.num_expert_workers:
            raise ValueError(f"index {self.index} is outside the {self.num_expert_workers} expert workers")
        if self.copies > self.num_expert_workers:
            raise ValueError(f"{self.copies} copies need as many expert workers, have {self.num_expert_workers}")
        return self

    def torch_dtype(self):
        import torch

        from phalanx.model.ops import auto_dtype

        return auto_dtype(self.device) if self.dtype == "auto" else getattr(torch, self.dtype)
