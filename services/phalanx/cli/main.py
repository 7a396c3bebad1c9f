"""The `phalanx` command."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import typer

from phalanx.cli.certs import certs_app
from phalanx.cli.chaos import chaos_app
from phalanx.cli.planner import planner_app
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
bench_app = typer.Typer(help="Benchmarks that print JSON and compare side by side in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(certs_app, name="certs")
app.add_typer(chaos_app, name="chaos")
app.add_typer(planner_app, name="planner")


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
        None, help="monolithic (default) or attention: MoE experts on expert workers through the ERT (docs/moe.md) [env PHALANX_ENGINE_ROLE]"
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
    log_level: LogLevel = "INFO",
) -> None:
    """Run the OpenAI-compatible HTTP gateway (/v1/completions, /v1/chat/completions, /v1/models) in front of the routers."""
    from phalanx.common.config import TelemetryConfig
    from phalanx.gateway.config import GatewayConfig
    from phalanx.gateway.process import GatewayProcess

    setup_logging(log_level)
    process = GatewayProcess(GatewayConfig(**given(router=router, host=host, port=port, model=model)), TelemetryConfig())
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
        encoders=encoders, tls=tls, fork_workers=fork_workers,
    )
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
_PLANNER_SETTING_OPTION = typer.Option(
    None, "--planner-setting", help="NAME=VALUE of a planner setting for the planner's live run (PHALANX_PLANNER_NAME), e.g. "
    "surge_confidence=0.8 (repeatable)"
)


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


@bench_app.command("engine")
def bench_engine(
    batches: str = typer.Option(None, help="Comma-separated batch sizes [default: 1,8,32; none for a real model]"),
    tokens: int = typer.Option(64, help="Decode tokens per sequence"),
    prompt_len: int = typer.Option(32, help="Prompt tokens per sequence"),
    model: str = typer.Option(
        "phalanx-tiny-moe", help="Built-in model, .gguf file or HF checkpoint dir; a GGUF one is also compared with transformers"
    ),
    repeats: int = typer.Option(3, help="Runs per measurement; the median is reported"),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, cuda:1 …"),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16"),
    as_json: AsJson = False,
) -> None:
    """Engine decode tokens/s vs the model's bare forward loop and (GGUF models, on the CPU) transformers' generate."""
    from phalanx.bench.engine import default_batches, run_engine_bench

    sizes = [int(b) for b in batches.split(",")] if batches else default_batches(model)
    result = run_engine_bench(
        model=model, batches=sizes, decode_tokens=tokens, prompt_len=prompt_len, repeats=repeats, device=device, dtype=dtype
    )
    typer.echo(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("route")
def bench_route(
    workers: str = typer.Option("8,64,256", help="Comma-separated worker counts"),
    blocks: int = typer.Option(100_000, help="KV blocks indexed in total"),
    as_json: AsJson = False,
) -> None:
    """Routing decision latency against the KV index, by worker count."""
    from phalanx.bench.route import run_route_bench

    result = run_route_bench(worker_counts=[int(w) for w in workers.split(",")], total_blocks=blocks)
    typer.echo(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("multimodal")
def bench_multimodal(
    image_encoder: str = typer.Option("small-clip", help="Vision tower: tiny-clip, small-clip or a HF CLIP directory"),
    concurrency: int = typer.Option(16, min=1, help="Concurrent image requests"),
    rounds: int = typer.Option(4, min=1, help="Rounds of `concurrency` requests per mode"),
    torch_threads: int = typer.Option(2, min=1, help="torch CPU threads"),
    ttft_rounds: int = typer.Option(6, min=1, help="Requests per mode and prefix length in the overlap TTFT runs"),
    skew_requests: int = typer.Option(20, min=2, help="Requests per mode (joint, round-robin) under skewed encoder load"),
    long_prefix: int = typer.Option(1024, min=16, help="Tokens of text before the image in the long-prefix runs"),
    ttft: bool = typer.Option(True, help="Also measure TTFT (overlap, joint routing under skew, by modality)"),
    model: str = typer.Option("phalanx-tiny-dense", help="LLM of the TTFT runs"),
    device: str = typer.Option("cpu", help="torch device of the LLM (engine and worker) and, unless --encoder-device, the encoders"),
    encoder_device: str = typer.Option("", help="torch device of the encoders (default: --device)"),
    as_json: AsJson = False,
) -> None:
    """Encoder batching throughput and encode time per unit; media TTFT: text prefix overlapped with encoding vs
    sequential, joint (encoder, worker) routing vs round-robin under skewed encoder load, by modality."""
    from phalanx.bench.multimodal import run_multimodal_bench

    result = run_multimodal_bench(
        image_encoder=image_encoder, concurrency=concurrency, rounds=rounds, torch_threads=torch_threads, ttft_rounds=ttft_rounds,
        skew_requests=skew_requests, long_prefix=long_prefix, ttft=ttft, model=model, device=device,
        encoder_device=encoder_device or device,
    )
    typer.echo(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("health")
def bench_health(
    workers: int = typer.Option(3, min=2, help="Chaos-enabled workers"),
    repeats: int = typer.Option(3, min=1, help="Injections per fault (the median is reported)"),
    interval_s: float = typer.Option(1.0, help="Check interval of the detection runs"),
    fp_interval_s: float = typer.Option(
        0.0, help="Check interval of the fault-free run; 0: the detection runs' (the false-positive goal is set at 1 s)"
    ),
    min_checks: int = typer.Option(1000, min=1, help="Checks in the fault-free run"),
    load_streams: int = typer.Option(4, min=0, help="Background streams through the router"),
    as_json: AsJson = False,
) -> None:
    """Detection latency per fault (inject -> weight 0 in the router), false positives, canary share of engine work."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.health import run_health_bench

    result = run_health_bench(
        workers=workers, repeats=repeats, interval_s=interval_s, fp_interval_s=fp_interval_s, min_checks=min_checks,
        load_streams=load_streams,
    )
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("channel")
def bench_channel(
    sizes_mib: str = typer.Option("1,16,64", help="Comma-separated tensor sizes in MiB"),
    repeats: int = typer.Option(5, min=1, help="Transfers per size (the median is reported)"),
    as_json: AsJson = False,
) -> None:
    """Bandwidth of tensor channels (2-rank gloo) vs the gRPC byte-stream fallback vs a local memcpy; setup time, RTT."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.channel import run_channel_bench

    sizes = [int(s) for s in sizes_mib.split(",") if s.strip()]
    result = asyncio.run(run_channel_bench(sizes_mib=sizes, repeats=repeats))
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("serve")
def bench_serve(
    streams: int = typer.Option(16, help="Concurrent streams"),
    tokens: int = typer.Option(128, help="Tokens generated per stream"),
    prompt_len: int = typer.Option(32, help="Prompt tokens per stream"),
    model: str = typer.Option("phalanx-tiny-moe"),
    repeats: int = typer.Option(3, help="Runs per measurement; the median is reported"),
    deterministic: bool = typer.Option(False, "--deterministic/--fast", help="Batch-invariant numerics"),
    compare_per_request: bool = typer.Option(
        False, "--compare-per-request", help="Also through a router reading a call per request (not multiplexed): per_request_ratio"
    ),
    as_json: AsJson = False,
) -> None:
    """End-to-end streaming throughput through a router and workers."""
    # It forks worker and router processes while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.serve import run_serve_bench

    result = run_serve_bench(
        streams=streams, tokens=tokens, prompt_len=prompt_len, model=model, repeats=repeats, deterministic=deterministic,
        compare_per_request=compare_per_request,
    )
    typer.echo(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("moe")
def bench_moe(
    streams: int = typer.Option(8, min=1, help="Concurrent greedy streams per wave"),
    tokens: int = typer.Option(48, min=16, help="Tokens generated per stream"),
    pairs: int = typer.Option(3, min=1, help="Monolithic/split steady-state run pairs, alternating (medians compared)"),
    expert_workers: int = typer.Option(2, min=2, help="Expert workers the experts are spread over"),
    copies: int = typer.Option(2, min=2, help="Copies of each expert (1 primary + shadows)"),
    kill_after: int = typer.Option(16, min=1, help="Tokens every stream has when an expert worker is SIGKILLed"),
    kill_repeats: int = typer.Option(3, min=1, help="Expert-worker kills (one wave each)"),
    aw_kill_repeats: int = typer.Option(2, min=1, help="Attention-worker kills (one wave each, through the router)"),
    replicas: bool = typer.Option(False, "--replicas", help="Copies as active replicas (no shadows): the EW loss lands on replicas that serve"),
    device: str = typer.Option("cpu", help="torch device of every worker (monolithic, attention and expert): cpu, cuda, cuda:1 …"),
    as_json: AsJson = False,
) -> None:
    """Disaggregated MoE: steady-state tokens/s split vs monolithic with the per-layer AW-EW round trip, the stall of an
    expert worker's SIGKILL, and a restart-the-group baseline."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.moe import run_moe_bench

    result = run_moe_bench(
        streams=streams, tokens=tokens, pairs=pairs, expert_workers=expert_workers, copies=copies, kill_after=kill_after,
        kill_repeats=kill_repeats, aw_kill_repeats=aw_kill_repeats, replicas=replicas, device=device,
    )
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@bench_app.command("failover")
def bench_failover(
    streams: int = typer.Option(12, min=1, help="Concurrent greedy streams per wave"),
    tokens: int = typer.Option(64, min=16, help="Tokens generated per stream"),
    prompt_min: int = typer.Option(100, min=1, help="Shortest prompt, in tokens"),
    prompt_max: int = typer.Option(300, min=1, help="Longest prompt, in tokens"),
    kill_after: int = typer.Option(16, min=1, help="Tokens each of the busiest worker's streams has when it is SIGKILLed"),
    repeats: int = typer.Option(2, min=1, help="Kills (one wave each) per strategy"),
    strategies: str = typer.Option(
        "checkpoint,transfer-only,reprefill,sequential-replay,restart", help="Comma-separated migration strategies"
    ),
    restore_tokens: str = typer.Option("64,256,1024", help="Comma-separated tokens generated before a timed restore"),
    restore_repeats: int = typer.Option(3, min=1, help="Timed restores per size (the median is reported)"),
    overhead_pairs: int = typer.Option(8, min=1, help="Checkpointing on/off run pairs, alternating (medians compared)"),
    overhead_waves: int = typer.Option(1, min=1, help="Waves of streams per overhead run"),
    as_json: AsJson = False,
) -> None:
    """Failover per migration strategy (stall, tokens lost, identical output), restore time vs tokens generated,
    and the cost of checkpointing when nothing fails."""
    # It forks worker and service processes while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.failover import run_failover_bench

    result = run_failover_bench(
        streams=streams, max_tokens=tokens, prompt_tokens=(prompt_min, max(prompt_min, prompt_max)), kill_after=kill_after,
        repeats=repeats, strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
        restore_tokens=tuple(int(n) for n in restore_tokens.split(",") if n.strip()), restore_repeats=restore_repeats,
        overhead_pairs=overhead_pairs,
        overhead_waves=overhead_waves,
    )
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("chaos")
def bench_chaos(
    scenarios: str = typer.Option("", help="Comma-separated scenarios [default: every one; `phalanx chaos run --help` lists them]"),
    streams: int = typer.Option(8, min=1, help="Concurrent greedy SDK streams (one more goes through the gateway)"),
    tokens: int = typer.Option(96, min=16, help="Tokens generated per stream"),
    fault_after: int = typer.Option(8, min=1, help="Tokens every SDK stream has when the fault starts"),
    as_json: AsJson = False,
) -> None:
    """Every chaos scenario on a fresh local stack: requests, lost, tokens lost/repeated, identical fraction, stall p99,
    time back to full health."""
    # It forks service processes while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.chaos import run_chaos_bench
    from phalanx.chaos import SCENARIOS

    chosen = tuple(s.strip() for s in scenarios.split(",") if s.strip()) or tuple(SCENARIOS)
    try:
        result = run_chaos_bench(scenarios=chosen, streams=streams, max_tokens=tokens, fault_after=fault_after)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("engine-failover")
def bench_engine_failover(
    streams: int = typer.Option(8, min=1, help="Concurrent greedy streams"),
    tokens: int = typer.Option(64, min=16, help="Tokens generated per stream"),
    prompt_min: int = typer.Option(100, min=1, help="Shortest prompt, in tokens"),
    prompt_max: int = typer.Option(200, min=1, help="Longest prompt, in tokens"),
    kill_after: int = typer.Option(16, min=1, help="Tokens each of the victim's streams has when it is SIGKILLed"),
    repeats: int = typer.Option(1, min=1, help="Kills per scenario"),
    scenarios: str = typer.Option("shadow,cold,peer", help="Comma-separated: shadow (takeover), cold (new process), peer (migration)"),
    model: str = typer.Option("phalanx-tiny-moe", help="Model of the engines (the goals are set for the tiny MoE)"),
    as_json: AsJson = False,
) -> None:
    """The primary engine SIGKILLed under load: shadow takeover vs a cold replacement process vs migration to a peer
    (kill to first token, stall, tokens lost, identical output, the standby's memory)."""
    # It forks worker and service processes while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.engine_failover import run_engine_failover_bench

    result = run_engine_failover_bench(
        streams=streams, max_tokens=tokens, prompt_tokens=(prompt_min, max(prompt_min, prompt_max)), kill_after=kill_after,
        repeats=repeats, scenarios=tuple(s.strip() for s in scenarios.split(",") if s.strip()), model=model,
    )
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("planner")
def bench_planner(
    minutes: float = typer.Option(
        10.0, min=0.25, max=30, help="Length of the compressed trace (issue 13: ~10 min); each of the four live runs replays it"
    ),
    peak_rps: float = typer.Option(None, min=0.05, help="Peak diurnal request rate [default: what two simulated workers serve]"),
    hot_spares: int = typer.Option(1, min=1, max=4, help="Hot spares of the planner's second live run (the restoration goal with a spare)"),
    seed: int = typer.Option(13, help="Seed of the arrivals"),
    scale_down_window: float = typer.Option(
        None, min=0, help="The planner's scale-down window in seconds [default: the planner's, three intervals: 6 s]"
    ),
    out: str = typer.Option(None, help="JSON result path (the plot goes beside it as .png) [default: a temporary directory]"),
    compare_rebalance: bool = typer.Option(
        False, "--compare-rebalance", help="Also replay the planner's run with the migration service's rebalancing off, side by side"
    ),
    planner_setting: list[str] = _PLANNER_SETTING_OPTION,
    fork_workers: bool = typer.Option(
        True, "--fork-workers/--spawn-workers", help="Every live run's workers forked from a pre-imported server (`phalanx up --fork-workers`)"
    ),
    as_json: AsJson = False,
) -> None:
    """The planner against static-min and static-max fleets of simulated workers on a bursty trace: SLO attainment, worker-seconds,
    burst reaction, and capacity restored after a SIGKILL with and without a hot spare."""
    settings: dict[str, str] = {}
    for item in planner_setting or []:
        name, equals, value = item.partition("=")
        if not equals or not name.strip():
            raise typer.BadParameter(f"expected NAME=VALUE, got {item!r}", param_hint="--planner-setting")
        settings[name.strip().lower()] = value.strip()
    # It forks `phalanx up` while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.planner import run_planner_bench

    result = run_planner_bench(minutes=minutes, peak_rps=peak_rps, seed=seed, out=Path(out).resolve() if out else None, hot_spares=hot_spares,
                               scale_down_window_s=scale_down_window, compare_rebalance=compare_rebalance, planner_settings=settings,
                               fork_workers=fork_workers)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("soak")
def bench_soak(
    minutes: float = typer.Option(30.0, min=0.5, help="Length of the run"),
    kill_every: float = typer.Option(60.0, "--kill-every", min=5, help="Seconds between worker SIGKILLs (each replaced at once)"),
    streams: int = typer.Option(6, min=1, help="Closed-loop clients streaming greedy requests"),
    tokens: int = typer.Option(32, min=1, help="Tokens generated per request"),
    sample: float = typer.Option(5.0, min=0.5, help="Seconds between RSS and fd samples"),
    warmup: float = typer.Option(None, min=0, help="Minutes left out of the trend [default: 1, or a third of a shorter run]"),
    seed: int = typer.Option(0, help="Seed of the prompts"),
    as_json: AsJson = False,
) -> None:
    """Steady load with a worker SIGKILLed every minute: RSS and open fds of every process, latency p99 and losses per
    minute, and their trend after the warm-up."""
    # It forks worker and service processes while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.soak import run_soak_bench

    result = run_soak_bench(minutes=minutes, kill_every_s=kill_every, streams=streams, max_tokens=tokens, sample_s=sample,
                            warmup_minutes=warmup, seed=seed)
    print(json.dumps(result, indent=None if as_json else 2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
