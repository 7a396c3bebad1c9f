"""`phalanx bench`: the benchmarks, each printing its figures as JSON so that runs compare side by side."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import typer

from phalanx.cli.shared import AsJson

bench_app = typer.Typer(help="Benchmarks that print JSON and compare side by side in one run.", no_args_is_help=True)

# Repeatable: module-level, as its default is a list (ruff B008).
_PLANNER_SETTING_OPTION = typer.Option(
    None, "--planner-setting", help="NAME=VALUE of a planner setting for the planner's live run (PHALANX_PLANNER_NAME), e.g. "
    "surge_confidence=0.8 (repeatable)"
)


@bench_app.command("engine")
def bench_engine(
    batches: str = typer.Option(None, help="Comma-separated batch sizes of the bare-loop matrix (default 1,8,32; none for a real model)"),
    tokens: int = typer.Option(None, help="Decode tokens per sequence (default 64; 32 side by side)"),
    prompt_len: int = typer.Option(32, help="Prompt tokens per sequence"),
    model: str = typer.Option(
        "phalanx-tiny-moe", help="Built-in model, .gguf file or HF checkpoint dir; a GGUF one also runs side by side with "
        "transformers and llama.cpp"
    ),
    repeats: int = typer.Option(None, help="Runs per measurement; the median is reported (default 3; 2 side by side)"),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, cuda:1 …"),
    dtype: str = typer.Option("auto", help="Bare-loop matrix: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16"),
    side_by_side: bool = typer.Option(
        None, "--side-by-side/--no-side-by-side", help="Phalanx (float32 and auto) beside transformers and llama.cpp on the same "
        "GGUF, CPU only (default: on for a GGUF model on the CPU); --no-side-by-side: transformers' generate alone, as before"
    ),
    side_batches: str = typer.Option("1,8,16,32", help="Side by side: comma-separated decode batch sizes"),
    ttft_lens: str = typer.Option("128,1024,4096", help="Side by side: comma-separated prompt lengths of the TTFT runs"),
    ttft_repeats: int = typer.Option(1, min=1, help="Side by side: runs per TTFT measurement"),
    as_json: AsJson = False,
) -> None:
    """Engine decode tokens/s vs the model's bare forward loop and (GGUF models, on the CPU) side by side with transformers
    and llama.cpp: tokens/s and ITL by batch, TTFT by prompt length."""
    from phalanx.bench.engine import default_batches, run_engine_bench
    from phalanx.bench.engine_side_by_side import SideBySideSettings

    def sizes(text: str) -> tuple[int, ...]:
        return tuple(int(n) for n in text.split(",") if n)

    side = SideBySideSettings(
        batches=sizes(side_batches), new_tokens=tokens or 32, prompt_len=prompt_len, repeats=repeats or 2,
        ttft_prompt_lens=sizes(ttft_lens), ttft_repeats=ttft_repeats,
    )
    result = run_engine_bench(
        model=model, batches=list(sizes(batches)) if batches else default_batches(model), decode_tokens=tokens or 64,
        prompt_len=prompt_len, repeats=repeats or 3, device=device, dtype=dtype, side_by_side=side_by_side, side=side,
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
    hogs: int = typer.Option(
        0, min=0, help="CPU-hog processes the bench starts for a second fault-free run and the detection runs (a busy host); "
        "killed at the end"
    ),
    as_json: AsJson = False,
) -> None:
    """Detection latency per fault (inject -> weight 0 in the router), false positives (also on a busy host with --hogs),
    canary share of engine work."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.health import run_health_bench

    result = run_health_bench(
        workers=workers, repeats=repeats, interval_s=interval_s, fp_interval_s=fp_interval_s, min_checks=min_checks,
        load_streams=load_streams, hogs=hogs,
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
        10.0, min=0.25, max=30, help="Length of the compressed trace in minutes (the goals are judged at 10); each of the four live runs replays it"
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
    trace: str = typer.Option(
        None, help="A public production request trace (Azure or BurstGPT CSV, Mooncake JSON lines) "
        "replayed instead of the synthetic one: compressed to --minutes, thinned to --trace-rps",
    ),
    trace_rps: float = typer.Option(None, min=0.05, help="--trace: mean request rate after thinning [default: what two simulated workers serve]"),
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
    if trace and not Path(trace).is_file():
        raise typer.BadParameter(f"{trace}: no such file", param_hint="--trace")
    # It forks `phalanx up` while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.planner import run_planner_bench

    result = run_planner_bench(minutes=minutes, peak_rps=peak_rps, seed=seed, out=Path(out).resolve() if out else None, hot_spares=hot_spares,
                               scale_down_window_s=scale_down_window, compare_rebalance=compare_rebalance, planner_settings=settings,
                               fork_workers=fork_workers, trace_file=Path(trace).resolve() if trace else None, trace_rps=trace_rps)
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


@bench_app.command("goodput")
def bench_goodput(
    workers: int = typer.Option(2, min=1, help="Workers of each stack"),
    seconds: float = typer.Option(20.0, min=2, help="Seconds of arrivals per load"),
    factors: str = typer.Option("0.5,1,2,4", help="Comma-separated loads as multiples of the measured capacity (must include 1)"),
    osl: int = typer.Option(16, min=2, help="Tokens generated per request"),
    ttft_slo: float = typer.Option(1.5, "--ttft-slo", min=0.05, help="TTFT SLO in seconds"),
    itl_slo: float = typer.Option(0.5, "--itl-slo", min=0.005, help="Mean inter-token latency SLO in seconds"),
    engine: str = typer.Option("sim", help="The workers' engine: sim (a synthetic profile, minutes on a laptop) or torch (the real model)"),
    model: str = typer.Option("phalanx-tiny-moe", help="The workers' model (with --engine torch: e.g. smollm2-135m or a checkpoint)"),
    capacity: float = typer.Option(None, min=0.01, help="Requests/s the stack serves within the SLOs [default: measured first]"),
    modes: str = typer.Option("off,slo", help="Comma-separated router admission modes, each on its own stack"),
    seed: int = typer.Option(0, help="Seed of the arrivals"),
    faults: float = typer.Option(
        None, "--faults", min=5, help="Then SIGKILL a worker every this many seconds under load, migration on vs off (goodput, lost, p99 after)"
    ),
    fault_seconds: float = typer.Option(120.0, min=10, help="With --faults: seconds of arrivals of each faulted run"),
    fault_factor: float = typer.Option(1.0, min=0.1, help="With --faults: the load, as a multiple of capacity (a factor of the sweep)"),
    as_json: AsJson = False,
) -> None:
    """Goodput (requests/s meeting both the TTFT and ITL SLOs) at 0.5x-4x the measured capacity, through the OpenAI gateway,
    with the router's SLO-aware admission on and off side by side."""
    # It forks `phalanx up` while its gRPC clients run: see run_up for why this is off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from phalanx.bench.goodput import run_goodput_bench

    try:
        result = run_goodput_bench(
            workers=workers, seconds=seconds, factors=tuple(float(f) for f in factors.split(",") if f.strip()), osl=osl,
            ttft_slo_s=ttft_slo, itl_slo_s=itl_slo, engine=engine, model=model, capacity_rps=capacity,
            modes=tuple(m.strip() for m in modes.split(",") if m.strip()), seed=seed, faults_every_s=faults, fault_seconds=fault_seconds,
            fault_factor=fault_factor,
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("disagg")
def bench_disagg(
    workers: int = typer.Option(8, min=2, help="Workers in each run: all aggregated, or --prefill-workers prefill + the rest decode"),
    prefill_workers: int = typer.Option(2, min=1, help="Prefill workers of the disaggregated run"),
    seconds: float = typer.Option(60.0, min=2, help="Virtual seconds of arrivals per run"),
    warmup: float = typer.Option(5.0, min=0, help="Virtual seconds left out of every figure"),
    steady_rps: float = typer.Option(10.0, min=0, help="Short-prompt (steady decode) arrivals per second (Poisson)"),
    long_rps: float = typer.Option(2.5, min=0.01, help="Long-prompt arrivals per second (Poisson)"),
    long_min: int = typer.Option(2048, min=256, help="Shortest long prompt, in tokens"),
    long_max: int = typer.Option(8192, min=256, max=12_000, help="Longest long prompt, in tokens"),
    max_batched_tokens: int = typer.Option(2048, min=64, help="Tokens per engine step (prefill chunk + decodes)"),
    transfer_s_per_1k: float = typer.Option(0.01, min=0, help="Simulated KV hand-over seconds per 1,024 prompt tokens"),
    ttft_slo: float = typer.Option(2.0, min=0, help="Goodput: TTFT SLO in seconds"),
    itl_slo: float = typer.Option(0.05, min=0, help="Goodput: SLO on a request's mean inter-token gap in seconds"),
    seed: int = typer.Option(0, help="Seed of the arrivals and prompts"),
    real: bool = typer.Option(False, "--real", help="Also measure a real KV transfer (python -m phalanx.bench.disagg: 2 worker processes, minutes)"),
    real_model: str = typer.Option("smollm2-135m-instruct", help="--real: the model of the real transfer"),
    live: bool = typer.Option(
        False, "--live", help="Also run the workload through real worker processes: 2 aggregated against 1 prefill + 1 decode "
        "(phalanx.bench.disagg_live: two `phalanx up` stacks, minutes)",
    ),
    live_seconds: float = typer.Option(60.0, min=10, help="--live: seconds of load per stack"),
    live_long_tokens: int = typer.Option(768, min=256, max=1900, help="--live: tokens of each long prompt"),
    live_long_every: float = typer.Option(10.0, min=1, help="--live: seconds between long prompts"),
    as_json: AsJson = False,
) -> None:
    """Decode ITL during long-prompt arrivals, TTFT and goodput: N aggregated workers against prefill + decode pools of
    the same count, on the simulated engine in virtual time (the output's `simulated` says what is simulated); with
    --live, also through real worker processes."""
    from phalanx.bench.disagg_serving import DisaggBenchSettings, run_disagg_serving_bench

    settings = DisaggBenchSettings(
        workers=workers, prefill_workers=prefill_workers, seconds=seconds, warmup_s=warmup, steady_rps=steady_rps, long_rps=long_rps,
        long_min=long_min, long_max=max(long_min, long_max), max_batched_tokens=max_batched_tokens,
        transfer_s_per_1k=transfer_s_per_1k, ttft_slo_s=ttft_slo, itl_slo_s=itl_slo, seed=seed,
    )
    if not 0 < prefill_workers < workers:
        raise typer.BadParameter("needs 1 <= --prefill-workers < --workers", param_hint="--prefill-workers")
    measured = None
    if real:
        # It forks worker processes while its gRPC clients run: see run_up for why this is off.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        from phalanx.bench.disagg import run_disagg_bench

        measured = asyncio.run(run_disagg_bench(model=real_model, tokens=1024))
    result = run_disagg_serving_bench(settings, real=measured)
    if live:
        from phalanx.bench.disagg_live import LiveSettings, run_disagg_live_bench

        live_settings = LiveSettings(seconds=live_seconds, long_tokens=live_long_tokens, long_every_s=live_long_every, seed=seed)
        result["live"] = run_disagg_live_bench(live_settings)
        result["met"].update({f"live_{name}": met for name, met in result["live"]["met"].items()})
    typer.echo(json.dumps(result, indent=None if as_json else 2))
