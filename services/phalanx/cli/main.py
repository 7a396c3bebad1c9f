"""The `phalanx` command."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import typer

from phalanx.cli.bench import bench_app
from phalanx.cli.certs import certs_app
from phalanx.cli.chaos import chaos_app
from phalanx.cli.planner import planner_app
from phalanx.cli.quarantine import quarantine_app
from phalanx.cli.shared import (
    ApiKey,
    AsJson,
    ClientStateFile,
    EtcdEndpoint,
    LogLevel,
    NatsUrl,
    StateFile,
    Target,
    given,
    setup_logging,
)
from phalanx.model.config import DEFAULT_MODEL

app = typer.Typer(help="Phalanx: LLM inference that keeps serving through failures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(certs_app, name="certs")
app.add_typer(chaos_app, name="chaos")
app.add_typer(planner_app, name="planner")
app.add_typer(quarantine_app, name="quarantine")


@app.command()
def worker(
    worker_id: str = typer.Option("", help="Unique worker id (default: <hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_WORKER_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_WORKER_PORT]"),
    model: str = typer.Option(None, help="Built-in model, .gguf file or HF checkpoint dir [env PHALANX_ENGINE_MODEL]"),
    engine: str = typer.Option(
        None, help="torch (the model) or sim (the simulated engine: profile step times, deterministic tokens; for scale tests, "
        "never correctness) [env PHALANX_ENGINE_ENGINE]",
    ),
    profile: str = typer.Option(None, help="Profile (.npz) the simulated engine follows; default: the shipped one [env PHALANX_ENGINE_PROFILE]"),
    deterministic: bool = typer.Option(None, "--deterministic/--fast", help="Batch-invariant numerics"),
    tensor_parallel_size: int = typer.Option(
        None, min=1, help="Processes the model is split over, started by this worker [env PHALANX_ENGINE_TENSOR_PARALLEL_SIZE]"
    ),
    role: str = typer.Option(
        None, help="monolithic (default), attention (MoE experts on expert workers through the ERT, docs/moe.md), or prefill / "
        "decode (disaggregated serving, docs/disagg.md) [env PHALANX_ENGINE_ROLE]"
    ),
    nats_url: NatsUrl = None,
    etcd_endpoint: EtcdEndpoint = None,
    chaos_token: str = typer.Option(
        None, help="Admin token of fault injection, which PHALANX_WORKER_CHAOS_ENABLED=true turns on [env PHALANX_WORKER_CHAOS_TOKEN]"
    ),
    failover_role: str = typer.Option(
        None, help="none | primary | shadow: an engine of a failover slot, serving while it holds the slot's lock "
        "[env PHALANX_WORKER_FAILOVER_ROLE]",
    ),
    engine_id: int = typer.Option(None, min=0, help="Engine id in the slot: 0 may load the weights, others map them [env PHALANX_WORKER_ENGINE_ID]"),
    failover_lock: str = typer.Option(None, help="The slot's lock file [env PHALANX_WORKER_FAILOVER_LOCK]"),
    memory_socket: str = typer.Option(None, help="The slot's memory service socket [env PHALANX_WORKER_MEMORY_SOCKET]"),
    failover_slot: str = typer.Option(None, help="The slot's id (default: <hostname>:<lock path>) [env PHALANX_WORKER_FAILOVER_SLOT]"),
    metrics_port: int = typer.Option(None, help="/metrics (and a failover engine's probes) port, 0 for any [env PHALANX_WORKER_METRICS_PORT]"),
    log_level: LogLevel = "INFO",
) -> None:
    """Run one engine worker: gRPC WorkerService, etcd lease, NATS load and KV events."""
    from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
    from phalanx.worker.config import EngineConfig, WorkerConfig

    engine_config = EngineConfig(
        **given(
            model=model, engine=engine, profile=profile, deterministic=deterministic, tensor_parallel_size=tensor_parallel_size, role=role
        )
    )
    if engine_config.tensor_parallel_size > 1:
        # It forks its follower ranks while gRPC runs: see run_up for why this is off.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.worker.process import WorkerProcess

    setup_logging(log_level)
    process = WorkerProcess(
        WorkerConfig(**given(
            worker_id=worker_id, host=host, port=port, chaos_token=chaos_token, failover_role=failover_role, engine_id=engine_id,
            failover_lock=failover_lock, memory_socket=memory_socket, failover_slot=failover_slot, metrics_port=metrics_port,
        )),
        engine_config,
        NatsConfig(**given(url=nats_url)),
        EtcdConfig(**given(endpoint=etcd_endpoint)),
        TelemetryConfig(),
    )
    _run_until_signalled(process)
    if process.exit_code:
        raise typer.Exit(process.exit_code)


@app.command("expert-worker")
def expert_worker(
    worker_id: str = typer.Option("", help="Unique id (default: ew-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_EXPERT_HOST]"),
    port: int = typer.Option(None, help="gRPC port of the control path, 0 for any [env PHALANX_EXPERT_PORT]"),
    model: str = typer.Option(None, help="MoE model: built-in or HF Mixtral checkpoint dir [env PHALANX_EXPERT_MODEL]"),
    index: int = typer.Option(None, min=0, help="This worker's placement slot [env PHALANX_EXPERT_INDEX]"),
    num_expert_workers: int = typer.Option(None, min=1, help="Expert workers in the placement [env PHALANX_EXPERT_NUM_EXPERT_WORKERS]"),
    copies: int = typer.Option(None, min=1, help="Copies of each expert: 1 primary + shadows [env PHALANX_EXPERT_COPIES]"),
    replicas: bool = typer.Option(
        None, "--replicas/--shadows", help="Copies are active replicas, not 1 primary + idle shadows [env PHALANX_EXPERT_REPLICAS]"
    ),
    device: str = typer.Option(None, help="torch device of the experts: cpu, cuda, cuda:1 … [env PHALANX_EXPERT_DEVICE]"),
    dtype: str = typer.Option(None, help="auto, float32, bfloat16 or float16: the attention workers' [env PHALANX_EXPERT_DTYPE]"),
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run an expert worker: hosts a slot of the MoE experts and computes them for attention workers (docs/moe.md)."""
    from phalanx.common.config import EtcdConfig, TelemetryConfig
    from phalanx.expert_worker.config import ExpertWorkerConfig
    from phalanx.expert_worker.process import ExpertWorkerProcess

    setup_logging(log_level)
    config = ExpertWorkerConfig(
        **given(
            worker_id=worker_id, host=host, port=port, model=model, index=index, num_expert_workers=num_expert_workers, copies=copies,
            replicas=replicas, device=device, dtype=dtype,
        )
    )
    _run_until_signalled(ExpertWorkerProcess(config, EtcdConfig(**given(endpoint=etcd_endpoint)), TelemetryConfig()))


@app.command("ert-manager")
def ert_manager(
    instance_id: str = typer.Option("", help="Unique id (default: ert-<hostname>-<pid>)"),
    port: int = typer.Option(None, help="gRPC port (health), 0 for any [env PHALANX_ERT_PORT]"),
    model: str = typer.Option(None, help="The MoE model the table places [env PHALANX_ERT_MODEL]"),
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run an ERT manager: the elected one keeps the expert routing table in etcd in step with the expert workers."""
    from phalanx.common.config import EtcdConfig, TelemetryConfig
    from phalanx.ert_manager.config import ErtManagerConfig
    from phalanx.ert_manager.process import ErtManagerProcess

    setup_logging(log_level)
    config = ErtManagerConfig(**given(instance_id=instance_id, port=port, model=model))
    _run_until_signalled(ErtManagerProcess(config, EtcdConfig(**given(endpoint=etcd_endpoint)), TelemetryConfig()))


@app.command("profile")
def profile_command(
    model: str = typer.Option("phalanx-tiny-moe", help="Model to profile (a worker of it is started here unless --target)"),
    out: str = typer.Option(..., help="Where to write the profile (.npz)"),
    quick: bool = typer.Option(False, "--quick", help="A coarse sweep, under a minute for a tiny model"),
    target: str = typer.Option(None, help="host:port of a running worker of MODEL to sweep instead of starting one"),
) -> None:
    """Measure a real worker (prefill TTFT vs ISL, decode ITL vs concurrency and context) and write the planner's profile."""
    # It forks a worker process while its etcd client's gRPC threads run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.launch.profiling import profile_worker
    from phalanx.planner.profile import save_profile
    from phalanx.planner.profiler import FULL, QUICK

    start = time.perf_counter()
    measured = asyncio.run(profile_worker(model, QUICK if quick else FULL, target=target, log=lambda line: typer.echo(line, err=True)))
    save_profile(measured, out)
    typer.echo(json.dumps({
        "model": model, "out": str(out), "seconds": round(time.perf_counter() - start, 1),
        "prefill_isl": measured.prefill_isl.tolist(), "prefill_ttft_ms": [round(v * 1e3, 2) for v in measured.prefill_ttft_s],
        "decode_context": measured.decode_context.tolist(), "decode_concurrency": measured.decode_concurrency.tolist(),
        "decode_itl_ms": [[round(v * 1e3, 2) for v in row] for row in measured.decode_itl_s],
    }))


@app.command()
def router(
    router_id: str = typer.Option("", help="Unique router id (default: router-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_ROUTER_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_ROUTER_PORT]"),
    model: str = typer.Option(None, help=".gguf file or checkpoint directory for the tokenizer (default: the workers' built-in model)"),
    nats_url: NatsUrl = None,
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run a router: the public RouterService with KV-aware routing and resumable streams."""
    from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
    from phalanx.router.config import RouterConfig
    from phalanx.router.process import RouterProcess

    setup_logging(log_level)
    process = RouterProcess(
        RouterConfig(**given(router_id=router_id, host=host, port=port, model=model)),
        NatsConfig(**given(url=nats_url)),
        EtcdConfig(**given(endpoint=etcd_endpoint)),
        TelemetryConfig(),
    )
    _run_until_signalled(process)


@app.command("health")
def health_service(
    instance_id: str = typer.Option("", help="Unique instance id (default: health-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_HEALTH_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_HEALTH_PORT]"),
    check_interval_s: float = typer.Option(None, help="Canary period per worker [env PHALANX_HEALTH_CHECK_INTERVAL_S]"),
    nats_url: NatsUrl = None,
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run a health service instance: canaries, circuit breakers, liveness, degradation (one leads, others stand by)."""
    from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
    from phalanx.health.config import DegradationConfig, HealthConfig
    from phalanx.health.process import HealthProcess

    setup_logging(log_level)
    process = HealthProcess(
        HealthConfig(**given(instance_id=instance_id, host=host, port=port, check_interval_s=check_interval_s)),
        DegradationConfig(),
        NatsConfig(**given(url=nats_url)),
        EtcdConfig(**given(endpoint=etcd_endpoint)),
        TelemetryConfig(),
    )
    _run_until_signalled(process)


@app.command("checkpoint-store")
def checkpoint_store(
    store_id: str = typer.Option("", help="Unique store id (default: ckpt-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_CHECKPOINT_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_CHECKPOINT_PORT]"),
    memory_limit_bytes: int = typer.Option(None, help="KV kept in memory before spilling [env PHALANX_CHECKPOINT_MEMORY_LIMIT_BYTES]"),
    spill_dir: str = typer.Option(None, help="Where spilled KV goes [env PHALANX_CHECKPOINT_SPILL_DIR]"),
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run a KV checkpoint store: workers stream in-flight requests' KV to it; it restores them into other workers."""
    from phalanx.checkpoint_store.config import CheckpointStoreConfig
    from phalanx.checkpoint_store.process import CheckpointStoreProcess
    from phalanx.common.config import EtcdConfig, TelemetryConfig

    setup_logging(log_level)
    config = CheckpointStoreConfig(
        **given(store_id=store_id, host=host, port=port, memory_limit_bytes=memory_limit_bytes, spill_dir=spill_dir)
    )
    process = CheckpointStoreProcess(config, EtcdConfig(**given(endpoint=etcd_endpoint)), TelemetryConfig())
    _run_until_signalled(process)


@app.command("encoder-pool")
def encoder_pool(
    encoder_id: str = typer.Option("", help="Unique encoder id (default: encoder-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_ENCODER_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_ENCODER_PORT]"),
    image_encoder: str = typer.Option(None, help="tiny-clip or a HF CLIP directory; empty: no images [env PHALANX_ENCODER_IMAGE_ENCODER]"),
    audio_encoder: str = typer.Option(
        None, help="tiny-whisper or a HF Whisper directory; empty: no audio [env PHALANX_ENCODER_AUDIO_ENCODER]"
    ),
    llm_hidden_size: int = typer.Option(None, help="Hidden size of the LLM fed [env PHALANX_ENCODER_LLM_HIDDEN_SIZE]"),
    max_batch: int = typer.Option(None, help="Units per batch [env PHALANX_ENCODER_MAX_BATCH]"),
    max_backlog_ms: float = typer.Option(None, help="Backlog past which requests are refused [env PHALANX_ENCODER_MAX_BACKLOG_MS]"),
    device: str = typer.Option(None, help="torch device of the encoders: cpu, cuda, cuda:1 … [env PHALANX_ENCODER_DEVICE]"),
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run a multimodal encoder: images, video frames and audio into embeddings of the LLM's hidden size, batched per modality."""
    from phalanx.common.config import EtcdConfig, TelemetryConfig
    from phalanx.encoder_pool.config import EncoderPoolConfig
    from phalanx.encoder_pool.process import EncoderPoolProcess

    setup_logging(log_level)
    # An empty encoder name is meaningful (no such modality), so those two are passed through when given at all.
    settings = given(encoder_id=encoder_id, host=host, port=port, llm_hidden_size=llm_hidden_size, max_batch=max_batch,
                      max_backlog_ms=max_backlog_ms, device=device)
    settings.update({k: v for k, v in {"image_encoder": image_encoder, "audio_encoder": audio_encoder}.items() if v is not None})
    config = EncoderPoolConfig(**settings)
    _run_until_signalled(EncoderPoolProcess(config, EtcdConfig(**given(endpoint=etcd_endpoint)), TelemetryConfig()))


@app.command("memory-service")
def memory_service(
    socket_path: str = typer.Option(None, help="Unix socket engines connect to [env PHALANX_MEMORY_SOCKET_PATH]"),
    root: str = typer.Option(None, help="Directory of the weight segments, a tmpfs [env PHALANX_MEMORY_ROOT]"),
    port: int = typer.Option(None, help="gRPC health port, 0 for any [env PHALANX_MEMORY_PORT]"),
    device: str = typer.Option(
        None, help="cpu, or the CUDA device that holds the weights for GPU engines (CUDA IPC) [env PHALANX_MEMORY_DEVICE]"
    ),
    log_level: LogLevel = "INFO",
) -> None:
    """Run a weight memory service (engine failover): owns a slot's shared weight segments; one writer or many readers."""
    from phalanx.common.config import TelemetryConfig
    from phalanx.failover.memory_service import MemoryServiceConfig, MemoryServiceProcess

    setup_logging(log_level)
    config = MemoryServiceConfig(**given(socket_path=socket_path, root=root, port=port, device=device))
    _run_until_signalled(MemoryServiceProcess(config, TelemetryConfig()))


@app.command("migration")
def migration_service(
    migration_id: str = typer.Option("", help="Unique instance id (default: migration-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_MIGRATION_HOST]"),
    port: int = typer.Option(None, help="gRPC port, 0 for any [env PHALANX_MIGRATION_PORT]"),
    strategy: str = typer.Option(
        None, help="checkpoint | transfer-only | reprefill | sequential-replay | restart [env PHALANX_MIGRATION_STRATEGY]"
    ),
    transport: str = typer.Option(None, help="channel | grpc [env PHALANX_MIGRATION_TRANSPORT]"),
    nats_url: NatsUrl = None,
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run a migration service: moves in-flight requests off failed or drained workers (KV transfer, checkpoint, re-prefill)."""
    from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
    from phalanx.migration.config import MigrationConfig
    from phalanx.migration.process import MigrationProcess

    setup_logging(log_level)
    process = MigrationProcess(
        MigrationConfig(**given(migration_id=migration_id, host=host, port=port, strategy=strategy, transport=transport)),
        NatsConfig(**given(url=nats_url)),
        EtcdConfig(**given(endpoint=etcd_endpoint)),
        TelemetryConfig(),
    )
    _run_until_signalled(process)


@app.command("gateway")
def gateway_service(
    router: str = typer.Option(None, help='Router target: host:port, or "ipv4:h1:p1,h2:p2" for several [env PHALANX_GATEWAY_ROUTER]'),
    host: str = typer.Option(None, help="Bind address [env PHALANX_GATEWAY_HOST]"),
    port: int = typer.Option(None, help="HTTP port, 0 for any [env PHALANX_GATEWAY_PORT]"),
    model: str = typer.Option(
        None, help="Built-in model or checkpoint dir the routers serve (default: the workers' model) [env PHALANX_GATEWAY_MODEL]"
    ),
    etcd_endpoint: EtcdEndpoint = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run the OpenAI-compatible HTTP gateway (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models) in front of the routers."""
    from phalanx.common.config import EtcdConfig, TelemetryConfig
    from phalanx.gateway.config import GatewayConfig
    from phalanx.gateway.process import GatewayProcess

    setup_logging(log_level)
    process = GatewayProcess(
        GatewayConfig(**given(router=router, host=host, port=port, model=model)), TelemetryConfig(),
        EtcdConfig(**given(endpoint=etcd_endpoint)),
    )
    _run_until_signalled(process)


def _run_until_signalled(process) -> None:
    from phalanx.common.service import run_until_signalled

    run_until_signalled(process)


@app.command()
def up(
    workers: int = typer.Option(2, min=1, max=16, help="Workers of the model"),
    model: str = typer.Option(
        DEFAULT_MODEL, help="Built-in model (phalanx-tiny-moe: random weights, loads at once), .gguf file or HF checkpoint directory"
    ),
    deterministic: bool = typer.Option(True, "--deterministic/--fast", help="Batch-invariant numerics"),
    port: int = typer.Option(50051, min=0, max=65535, help="Router gRPC port; 0 for any free one"),
    gateway_port: int = typer.Option(8000, min=0, max=65535, help="OpenAI-compatible HTTP gateway port; 0 for any free one"),
    nats_url: str = typer.Option(None, envvar="PHALANX_NATS_URL", help="External NATS (default: start one)"),
    etcd_endpoint: str = typer.Option(None, envvar="PHALANX_ETCD_ENDPOINT", help="External etcd host:port[,host:port...] (default: start one)"),
    state_file: StateFile = None,
    detach: bool = typer.Option(False, "--detach", help="Run in the background; stop it with `phalanx down`"),
    log_file: str = typer.Option(None, hidden=True, help="Set by --detach: where this supervisor's output goes"),
    planner: bool = typer.Option(False, "--planner", help="Run the planner; the supervisor starts and drains workers to its targets"),
    failover: bool = typer.Option(
        False, "--failover", help="Every worker slot a primary and a shadow engine on one memory service; a dead engine's "
        "requests continue on its shadow, and the supervisor restarts it as the slot's new shadow",
    ),
    min_workers: int = typer.Option(1, min=0, max=16, help="With --planner: fewest workers"),
    max_workers: int = typer.Option(None, min=1, max=16, help="With --planner: most workers [default: twice --workers, at most 16]"),
    hot_spares: int = typer.Option(0, min=0, max=16, help="With --planner: warm workers kept registered but not routed to; one is "
                                   "promoted at once when a worker dies"),
    engine: str = typer.Option("", help="The workers' engine: torch, or sim (simulated: profile step times; for scale, never correctness)"),
    profile: str = typer.Option("", help="With --engine sim: the profile (.npz) workers follow, and the planner plans with"),
    attention_workers: int = typer.Option(
        None, min=1, max=16, help="With --expert-workers: attention workers (the same as --workers, which they replace)"
    ),
    expert_workers: int = typer.Option(
        0, min=0, max=16, help="Disaggregated MoE: expert workers the experts are spread over (the workers then run the attention role)"
    ),
    shadow_experts: int = typer.Option(1, min=0, max=15, help="With --expert-workers: extra copies of each expert, each on another expert worker"),
    encoders: int = typer.Option(0, min=0, max=8, help="Multimodal encoders (built-in seeded towers): requests may carry media"),
    tls: bool = typer.Option(
        False, "--tls", help="Mutual TLS between every process, with certificates made (if missing) beside the state file (docs/security.md)"
    ),
    prefill_workers: int = typer.Option(
        0, min=0, max=16, help="Disaggregated serving: prefill workers; the workers then run the decode role (docs/disagg.md)"
    ),
    decode_workers: int = typer.Option(
        None, min=1, max=16, help="With --prefill-workers: decode workers (the same as --workers, which they replace)"
    ),
    fork_workers: bool = typer.Option(
        False, "--fork-workers/--spawn-workers", help="Fork new workers from a process that has done their imports: a new or "
        "replacement worker serves in a fraction of the time (docs/local-stack.md)",
    ),
) -> None:
    """Bring Phalanx up on this machine: NATS, etcd, workers, a router, an OpenAI-compatible gateway and the rest, supervised."""
    from dataclasses import replace

    from rich.console import Console

    from phalanx.cli.up import UpOptions, run_detached, run_up

    if Path(model).exists():
        model = str(Path(model).resolve())  # the detached supervisor and its workers may not share our directory
    options = UpOptions(
        workers=workers, model=model, deterministic=deterministic, port=port, gateway_port=gateway_port, state_file=_state_file(state_file),
        nats_url=nats_url, etcd_endpoint=etcd_endpoint, log_file=Path(log_file) if log_file else None,
        planner=planner, min_workers=min_workers, max_workers=max_workers, failover=failover, hot_spares=hot_spares, engine=engine,
        profile=str(Path(profile).resolve()) if profile else "", expert_workers=expert_workers, shadow_experts=shadow_experts,
        encoders=encoders, tls=tls, fork_workers=fork_workers, prefill_workers=prefill_workers,
    )
    if decode_workers is not None:
        if not prefill_workers:
            raise typer.BadParameter("--decode-workers goes with --prefill-workers", param_hint="--decode-workers")
        options = replace(options, workers=decode_workers)
    if hot_spares and not planner:
        raise typer.BadParameter("--hot-spares needs --planner (the planner promotes them)", param_hint="--hot-spares")
    if attention_workers is not None:
        options = replace(options, workers=attention_workers)
    console = Console(soft_wrap=True)  # long lines stay whole in the detached log
    raise typer.Exit(run_detached(options, console) if detach else asyncio.run(run_up(options, console)))


@app.command()
def down(
    state_file: StateFile = None,
) -> None:
    """Stop what `phalanx up` started (SIGTERM to its supervisor, which stops everything in order)."""
    from rich.console import Console

    from phalanx.cli.up import run_down

    raise typer.Exit(run_down(_state_file(state_file), Console(soft_wrap=True)))



# Repeatable options: module-level, as their default is a list (ruff B008).
_IMAGE_OPTION = typer.Option(None, help="Image file (repeatable); the prompt's <media> markers place the media, else they go first")
_AUDIO_OPTION = typer.Option(None, help="PCM WAV file (repeatable), after the images")
_VIDEO_OPTION = typer.Option(None, help="Video file (repeatable), after the audio")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text"),
    target: Target = None,
    max_tokens: int = typer.Option(32, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    seed: int = typer.Option(None, help="Sampling seed (default: the router picks one)"),
    tier: str = typer.Option(None, help="premium, standard or best_effort (default: the tenant's)"),
    tenant: str = typer.Option(None, help="Tenant to run as"),
    api_key: ApiKey = None,
    state_file: ClientStateFile = None,
    image: list[Path] = _IMAGE_OPTION,
    audio: list[Path] = _AUDIO_OPTION,
    video: list[Path] = _VIDEO_OPTION,
) -> None:
    """Stream a completion through the router (with media: through the encoder pool)."""
    from phalanx.cli.state import resolve_target
    from phalanx.cli.status import stream_generate
    from phalanx.client import Media

    target = resolve_target(target, _state_file(state_file))
    _tls_of_local_stack(_state_file(state_file))
    media = [Media.from_file(p, kind) for kind, paths in (("image", image), ("audio", audio), ("video", video)) for p in paths or ()]
    options = {
        "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "tier": tier, "tenant": tenant, "media": media,
    }
    raise typer.Exit(_run_client(stream_generate(target, prompt, api_key=api_key, **options)))


@app.command()
def chat(
    target: Target = None,
    model: str = typer.Option(None, help="The served model, for its chat template [default: what the workers report]"),
    system: str = typer.Option(None, help="A system message to start the conversation with"),
    max_tokens: int = typer.Option(256, min=1, help="Longest answer"),
    temperature: float = typer.Option(0.0, min=0.0, help="0 is greedy"),
    api_key: ApiKey = None,
    state_file: ClientStateFile = None,
) -> None:
    """Chat with the model: each turn rendered with its chat template and streamed through the router."""
    from phalanx.cli.chat import run_chat
    from phalanx.cli.state import resolve_target

    target = resolve_target(target, _state_file(state_file))
    _tls_of_local_stack(_state_file(state_file))
    chatting = run_chat(target, model=model, system=system, api_key=api_key, max_tokens=max_tokens, temperature=temperature)
    raise typer.Exit(_run_client(chatting))


@app.command()
def status(
    target: Target = None,
    as_json: AsJson = False,
    api_key: ApiKey = None,
    state_file: ClientStateFile = None,
) -> None:
    """The workers the router routes to (health, load and KV cache), and what the local `phalanx up` replaced."""
    from phalanx.cli.state import live_state, resolve_target
    from phalanx.cli.status import show_status

    resolved = resolve_target(target, _state_file(state_file))
    supervisor = live_state(_state_file(state_file))
    if supervisor is not None and supervisor.router_address != resolved:
        supervisor = None  # some other router than the local stack's
    _tls_of_local_stack(_state_file(state_file))
    raise typer.Exit(_run_client(show_status(resolved, as_json=as_json, api_key=api_key, supervisor=supervisor)))


def _run_client(call) -> int:
    """Run an SDK coroutine to its exit code; Ctrl-C leaves quietly (leaving a stream cancels its request)."""
    try:
        return asyncio.run(call)
    except KeyboardInterrupt:
        return 130


def _tls_of_local_stack(state_file: Path) -> None:
    """Without PHALANX_TLS_*, a client command talks to a local `phalanx up --tls` with its admin certificate."""
    from phalanx.cli.state import live_state
    from phalanx.common.tls import ServiceTls, TlsSettings, set_process_tls

    if TlsSettings().enabled:
        return
    state = live_state(state_file)
    if state is not None and state.certs_dir:
        set_process_tls(ServiceTls.from_dir(Path(state.certs_dir) / "admin"))


def _state_file(given: str | None) -> Path:
    from phalanx.cli.state import default_state_file

    return (Path(given) if given else default_state_file()).expanduser().absolute()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
