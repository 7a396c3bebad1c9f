"""Engine and worker settings (env prefix PHALANX_ENGINE_ / PHALANX_WORKER_)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.model.config import DEFAULT_MODEL

# Tokens per KV block (phalanx.model.kv_cache.BLOCK_SIZE; not imported: this module stays torch-free).
KV_BLOCK_TOKENS = 16
# A budget-sized cache never has more blocks than this (enough for the tiny models at 128 MB).
AUTO_MAX_KV_BLOCKS = 2048


class EngineConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_ENGINE_", protected_namespaces=())

    model: str = Field(
        DEFAULT_MODEL,
        description=(
            "Built-in model (smollm2-135m-instruct; phalanx-tiny-moe and phalanx-tiny-dense have random weights and load at once), "
            "a .gguf file or a Hugging Face checkpoint directory"
        ),
    )
    engine: Literal["torch", "sim"] = Field(
        "torch",
        description=(
            "torch runs the model; sim is the simulated engine (no weights, no forward): the same scheduling, KV accounting "
            "and events, step times from a measured profile, deterministic tokens. For scale tests and the planner, never "
            "for correctness; it registers its model as sim:<profiled model>"
        ),
    )
    profile: str = Field("", description="Performance profile (.npz, `phalanx profile`) the simulated engine follows; empty: the shipped one")
    seed: int | None = Field(None, ge=0, description="Seed of a built-in model's weights (default: the model's own)")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1 …")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "auto is bfloat16 on CUDA and on CPUs that multiply it in hardware (AVX512-BF16 or AMX), where it halves a "
            "step's bytes; float32 on other CPUs, where torch emulates bfloat16 slower than float32"
        ),
    )
    weights: Literal["auto", "int4", "dense"] = Field(
        "auto",
        description=(
            "int4 keeps a GGUF's 4-bit linear weights (Q4_0, Q4_1, Q4_K) as the file's codes for torch's int4 kernel "
            "when the engine runs in bfloat16 on a CPU in one process (an eighth of float32's bytes a step); auto does "
            "that and, where the CPU multiplies bfloat16 in hardware, adds each one's bfloat16 copy prepacked for oneDNN, "
            "which steps of 4 or more rows multiply by (the int4 kernel slows with every row; the copy costs the "
            "weights' bfloat16 bytes again in memory); dense dequantizes every weight to the engine's dtype"
        ),
    )
    num_kv_blocks: int = Field(
        0, ge=0, description="KV cache blocks of 16 tokens each; 0 sizes the cache from kv_cache_bytes (at most AUTO_MAX_KV_BLOCKS)"
    )
    kv_cache_bytes: int = Field(
        512 * 2**20, ge=2**20, description="Memory the KV cache may take when num_kv_blocks is 0 (the model's KV shape decides the blocks)"
    )
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences in one batch")
    max_batched_tokens: int = Field(512, ge=16, description="Most tokens computed in one step (prefill chunks + decodes)")
    max_model_len: int = Field(2048, ge=16, description="Longest prompt + output, in tokens")
    max_waiting: int = Field(1024, ge=1, description="Queued requests beyond which new ones are refused (RESOURCE_EXHAUSTED)")
    prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes")
    deterministic: bool = Field(
        False, description="Batch-invariant numerics: a sequence's logits do not depend on what else is in the batch"
    )

    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description=(
            "Processes on this host that split the model's heads and MLP (Megatron-style); this worker leads and "
            "starts the others. They fail as one: a lost rank stops the whole group, and its requests migrate"
        ),
    )
    tensor_parallel_timeout_s: float = Field(
        30.0, gt=0, description="Longest a tensor-parallel collective waits for a rank before the group fail-stops"
    )

    role: Literal["monolithic", "attention", "prefill", "decode"] = Field(
        "monolithic",
        description=(
            "monolithic: the whole model here, prefill and decode (aggregated). attention: attention, gate and KV here, "
            "the MoE experts on expert workers (`phalanx expert-worker`) found through the expert routing table in etcd "
            "(docs/moe.md). prefill / decode (disaggregated serving, docs/disagg.md): the whole model here; a prefill "
            "worker only computes prompts and hands each request on with its KV after its first token, a decode worker "
            "takes new requests like a monolithic one and the KV of those prefilled elsewhere"
        ),
    )
    handoff_ttl_s: float = Field(
        10.0, gt=0, le=600,
        description="Prefill role: how long a prefilled request's KV waits here for the decode worker's transfer before it is freed",
    )
    expert_timeout_s: float = Field(
        2.0, gt=0, description="Attention role: longest wait for an expert worker's reply before it is probed (and its work replayed)"
    )
    expert_probe_timeout_s: float = Field(0.25, gt=0, description="Attention role: deadline of the control-path probe of an expert worker")
    ert_wait_s: float = Field(60.0, gt=0, description="Attention role: how long start-up waits for a complete expert routing table")

    engine_process: bool = Field(
        True,
        description=(
            "Run the engine loop in a child process of its own (its own GIL; the worker keeps no weights), talking to the "
            "worker over a pipe and shared memory. Applies to the torch engine of a monolithic worker with "
            "tensor_parallel_size 1 and no failover engine; other workers keep the engine on a thread (and log that they "
            "do when it was asked for). false: the engine thread for every worker"
        ),
    )
    torch_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "Intra-op threads of the engine on CPU; 0 means all cores but one, which the gRPC event loop "
            "needs (torch threads that share a core with it spin and slow both)"
        ),
    )

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> EngineConfig:
        if self.engine == "sim" and self.profile and not os.path.isfile(self.profile):
            raise ValueError(f"profile {self.profile!r} is not a file (make one with `phalanx profile`, or leave it empty for the shipped one)")
        if self.engine == "sim" and self.tensor_parallel_size > 1:
            raise ValueError("the simulated engine runs in one process: tensor_parallel_size must be 1")
        if self.tensor_parallel_size > 1 and self.device != "cpu":
            raise ValueError("tensor_parallel_size > 1 runs on CPU (gloo) only so far; set PHALANX_ENGINE_DEVICE=cpu")
        if self.role == "attention" and (self.engine == "sim" or self.tensor_parallel_size > 1):
            raise ValueError("the attention role runs the torch engine in one process (no simulated engine, no tensor parallelism) so far")
        return self

    def sized_for(self, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> EngineConfig:
        """This config with a concrete num_kv_blocks for a model of this KV shape (itself when it has one).

        A fixed block count would give a 135M-parameter model with 30 layers 1.5 GB of KV while
        the tiny models take 128 MB: the budget is in bytes, and long enough for one sequence.
        """
        if self.num_kv_blocks:
            return self
        block_bytes = layers * 2 * KV_BLOCK_TOKENS * kv_heads * head_dim * dtype_bytes
        fits = self.kv_cache_bytes // max(1, block_bytes)
        one_sequence = -(-self.max_model_len // KV_BLOCK_TOKENS)
        return self.model_copy(update={"num_kv_blocks": max(one_sequence, min(AUTO_MAX_KV_BLOCKS, fits))})

    def effective_torch_threads(self) -> int:
        if self.torch_threads:
            return self.torch_threads
        return max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) - 1)

    def torch_dtype(self):
        import torch

        from phalanx.model.ops import auto_dtype

        return auto_dtype(self.device) if self.dtype == "auto" else getattr(torch, self.dtype)

    def load_model(self):
        """The model a worker with this config serves, whole (a tensor-parallel group and an attention worker start
        from it): one place for what the worker, its engine process and the benches load."""
        from phalanx.model import load

        return load(
            self.model, device=self.device, dtype=self.torch_dtype(), seed=self.seed, keep_int4=self.keeps_int4(),
            dense_copy=self.weights == "auto",
        )

    def keeps_int4(self) -> bool:
        """Whether the model's 4-bit GGUF weights stay packed: bfloat16 on a CPU, one process holding the whole model
        (a tensor-parallel shard, an attention worker's split and a failover engine's shared weights are dense)."""
        import torch

        return (
            self.weights != "dense" and self.device == "cpu" and self.torch_dtype() == torch.bfloat16
            and self.whole_model and self.tensor_parallel_size == 1
        )

    @property
    def whole_model(self) -> bool:
        """Whether this worker holds the whole model (every role but attention, whose experts live elsewhere)."""
        return self.role != "attention"


MIN_CHAOS_TOKEN_CHARS = 16


class WorkerConfig(BaseSettings):
    # hide_input_in_errors: a refused setting's error would otherwise quote the whole input, the chaos token included.
    model_config = SettingsConfigDict(env_prefix="PHALANX_WORKER_", hide_input_in_errors=True)

    worker_id: str = Field("", description="Unique id; empty means <hostname>-<pid>")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    load_interval_s: float = Field(0.1, gt=0, le=10, description="Period of load reports on NATS")
    kv_event_interval_s: float = Field(0.02, gt=0, le=5, description="Longest a KV event waits before it is published")
    drain_grace_s: float = Field(10.0, ge=0, description="How long running requests may finish on SIGTERM before they are handed back")
    detach_grace_s: float = Field(
        15.0, ge=0, description="How long a request runs on after its last stream broke, for a caller to Attach again, before it is aborted"
    )
    retain_s: float = Field(30.0, ge=0, description="How long a finished request's output is kept for a late Attach")
    max_retained: int = Field(10_000, ge=0, description="Most finished requests kept for Attach; the oldest go first")
    max_retained_bytes: int = Field(
        256 << 20, ge=0, description="Most memory (estimated) the finished requests kept for Attach may hold; the oldest go first"
    )
    checkpointing: bool = Field(
        True, description="Stream every running request's new KV to the checkpoint store (when one is registered in etcd)"
    )
    checkpoint_interval_tokens: int = Field(
        8, ge=1,
        description="KV goes to the store once this many new positions are due (output tokens go every step; a restore "
        "recomputes the positions in between: with an MoE model each one more may run more experts in that first step)",
    )
    checkpoint_flush_interval_s: float = Field(
        0.05, ge=0, le=1.0,
        description="Steps captured within this of each other go to the store in one message (the store's commits lag "
        "the client by at most this plus a step)",
    )
    checkpoint_max_pending_bytes: int = Field(
        64 << 20, ge=1 << 20, description="KV queued for the store beyond which capture skips steps (coarser segments, never a stall)"
    )
    # Off by default: a SIGKILLed process's memory is torn down before its sockets close, so a resident cache delays
    # its peers' noticing the death (bench failover stall p99 0.42-0.80 s with it on, 0.13-0.17 s off).
    prefault_kv_cache: bool = Field(
        False,
        description="Fault the (CPU) KV cache's pages in on a background thread once serving, so that restores write warm "
        "memory (~3 ms less per 4 MiB); it makes the cache resident, which slows the detection of this worker's death",
    )
    park_ttl_s: float = Field(10.0, gt=0, description="How long a handed-back request's KV waits here for a transfer")
    transfer_on_drain: bool = Field(
        True, description="A drain parks requests with their KV so that migration can transfer it instead of recomputing"
    )
    channel_timeout_s: float = Field(10.0, gt=0, description="Timeout of tensor-channel setup and transfers")
    channel_min_bytes: int = Field(
        32 << 20, ge=0,
        description="KV to restore from a source with no tensor channel kept to it goes over gRPC below this size (and a "
        "channel forms in the background for the next restore): right after a failure, forming one took ~300 ms, against "
        "~70 ms for 32 MiB over gRPC (0.45 GB/s; 3 ms to form and 2.8 GB/s on an idle host, `phalanx bench channel`)",
    )
    media_channel_min_bytes: int = Field(
        4 << 20, ge=0,
        description="Media embeddings fetched from an encoder with no tensor channel kept to it go over gRPC below this size "
        "(and a channel forms in the background for the next request); same trade-off as channel_min_bytes",
    )
    failover_role: Literal["none", "primary", "shadow"] = Field(
        "none",
        description="An engine of a failover slot: weights from the memory service, serves only while it holds the "
        "slot's lock; primary and shadow differ only in what they count (a shadow's takeover is a switch). none: a plain worker",
    )
    engine_id: int = Field(0, ge=0, description="Engine id within the failover slot: 0 may load and publish the weights, others only map them")
    failover_lock: str = Field("", description="The slot's lock file, on a volume both engines see (an emptyDir)")
    memory_socket: str = Field("", description="Unix socket of the slot's memory service (phalanx memory-service)")
    failover_slot: str = Field(
        "", description="The slot's id, in the worker's registration: migration sends a dead engine's requests to its slot's "
        "next engine; empty means <hostname>:<lock path>"
    )
    wake_timeout_s: float = Field(
        30.0, gt=0, description="Longest a takeover (KV allocation, engine start, registration) may take before the engine exits (3)"
    )
    weights_timeout_s: float = Field(30.0, gt=0, description="Longest a read-only engine waits for the weights to be committed")
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest gRPC request accepted")
    chaos_enabled: bool = Field(
        False, description="Serve the ChaosService (fault injection, for tests and game days); needs chaos_token"
    )
    chaos_crash_on_prompt: str = Field(
        "", description="Chaos (needs chaos_enabled): the worker kills itself (SIGKILL) just after its engine takes a request "
        "whose prompt text contains this marker, as a kernel bug on one rare shape would (a poison request for the quarantine's "
        "tests and game days); empty: off",
    )
    chaos_stall_kv_send: str = Field(
        "", description="Chaos (needs chaos_enabled): this worker, as a KV source, stalls for a minute before sending the KV of a "
        "request whose id contains this marker (a hung transfer: the target's deadline must fire); empty: off",
    )
    chaos_token: str = Field(
        "", repr=False, description="Admin token the ChaosService requires as 'authorization: Bearer <token>' (16+ characters)"
    )

    @property
    def failover(self) -> bool:
        return self.failover_role != "none"

    @model_validator(mode="after")
    def _check_failover(self) -> WorkerConfig:
        if self.failover and not (self.failover_lock and self.memory_socket):
            raise ValueError("a failover engine needs failover_lock and memory_socket (PHALANX_WORKER_FAILOVER_LOCK, _MEMORY_SOCKET)")
        if self.chaos_crash_on_prompt and not self.chaos_enabled:
            raise ValueError("chaos_crash_on_prompt is fault injection: it needs chaos_enabled")
        if self.chaos_stall_kv_send and not self.chaos_enabled:
            raise ValueError("chaos_stall_kv_send is fault injection: it needs chaos_enabled")
        return self

    @model_validator(mode="after")
    def _check_chaos(self) -> WorkerConfig:
        if self.chaos_enabled and len(self.chaos_token) < MIN_CHAOS_TOKEN_CHARS:
            raise ValueError(
                f"chaos_enabled needs a chaos_token of at least {MIN_CHAOS_TOKEN_CHARS} characters (PHALANX_WORKER_CHAOS_TOKEN)"
            )
        return self
