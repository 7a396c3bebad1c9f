"""`phalanx planner`: the planner service, and the commands that talk to it through etcd."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

import typer

from phalanx.cli.shared import LogLevel, given, setup_logging, with_etcd

planner_app = typer.Typer(
    help="The planner: predicts load, sizes the worker fleet, replaces DEAD workers (docs/planner.md). Without a subcommand it runs the service.",
)

_ETCD_HELP = "etcd host:port [env PHALANX_ETCD_ENDPOINT]"


@planner_app.callback(invoke_without_command=True)
def planner_service(
    ctx: typer.Context,
    instance_id: str = typer.Option("", help="Unique instance id (default: planner-<hostname>-<pid>)"),
    host: str = typer.Option(None, help="Bind address [env PHALANX_PLANNER_HOST]"),
    port: int = typer.Option(None, help="gRPC port (health and reflection), 0 for any [env PHALANX_PLANNER_PORT]"),
    connector: str = typer.Option(None, help="virtual or kubernetes [env PHALANX_PLANNER_CONNECTOR]"),
    interval_s: float = typer.Option(None, help="Adjustment interval [env PHALANX_PLANNER_INTERVAL_S]"),
    min_workers: int = typer.Option(None, help="Fewest workers [env PHALANX_PLANNER_MIN_WORKERS]"),
    max_workers: int = typer.Option(None, help="Most workers [env PHALANX_PLANNER_MAX_WORKERS]"),
    profile: str = typer.Option(None, help="Performance profile .npz [env PHALANX_PLANNER_PROFILE]"),
    predictor: str = typer.Option(None, help="constant, arima, kalman or prophet [env PHALANX_PLANNER_PREDICTOR]"),
    correction: bool = typer.Option(None, "--correction/--no-correction", help="Correction factors [env PHALANX_PLANNER_CORRECTION]"),
    prometheus_url: str = typer.Option(None, help="Prometheus base URL; unset: scrape the routers [env PHALANX_PLANNER_PROMETHEUS_URL]"),
    etcd_endpoint: str = typer.Option(None, help=_ETCD_HELP),
    log_level: LogLevel = "INFO",
) -> None:
    """Run a planner instance (one leads and decides, others stand by)."""
    if ctx.invoked_subcommand is not None:
        return
    from phalanx.common.config import EtcdConfig, TelemetryConfig
    from phalanx.common.service import run_until_signalled
    from phalanx.planner.config import PlannerConfig
    from phalanx.planner.service import PlannerProcess

    setup_logging(log_level)
    from pydantic import ValidationError

    from phalanx.planner.errors import PlannerInputError

    try:
        config = PlannerConfig(**given(
            instance_id=instance_id, host=host, port=port, connector=connector, interval_s=interval_s, min_workers=min_workers,
            max_workers=max_workers, profile=profile, predictor=predictor, correction=correction, prometheus_url=prometheus_url,
        ))
        process = PlannerProcess(config, EtcdConfig(**given(endpoint=etcd_endpoint)), TelemetryConfig())
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in error.errors())
        typer.echo(f"error: {problems}", err=True)
        raise typer.Exit(2) from None
    except (PlannerInputError, OSError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    run_until_signalled(process)


@planner_app.command("set-target")
def set_target(
    workers: int = typer.Argument(None, min=0, help="Workers the planner should ask for (within its min and max; a disaggregated "
                                  "fleet's decode workers)"),
    clear: bool = typer.Option(False, "--clear", help="Remove the operator's target: the planner plans from load again"),
    etcd_endpoint: str = typer.Option(None, help=_ETCD_HELP),
) -> None:
    """Set (or --clear) an operator's worker target; the planner decides on it at its next ready tick."""
    from phalanx.planner.connectors import clear_target, write_target

    if clear:
        asyncio.run(with_etcd(etcd_endpoint, clear_target))
        typer.echo("cleared the operator's target")
        return
    if workers is None:
        raise typer.BadParameter("give a worker count, or --clear")
    asyncio.run(with_etcd(etcd_endpoint, lambda client: write_target(client, workers)))
    typer.echo(f"target: {workers} workers")


@planner_app.command("show")
def show(etcd_endpoint: str = typer.Option(None, help=_ETCD_HELP)) -> None:
    """The planner's last decision, the orchestrator's acknowledgement and the operator's target, as JSON (a disaggregated
    fleet's: workers/spares of the decode pool, prefill_workers/prefill_spares of the prefill pool)."""
    from phalanx.planner.connectors import read_ack, read_decision, read_target

    async def read(client):
        decision, ack, target = await read_decision(client), await read_ack(client), await read_target(client)
        return {"decision": asdict(decision) if decision else None, "ack": asdict(ack) if ack else None, "target": target}

    typer.echo(json.dumps(asyncio.run(with_etcd(etcd_endpoint, read)), indent=2))


@planner_app.command("dryrun")
def dryrun(
    trace: str = typer.Option(
        ..., help="Load trace: intervals (JSON lines or CSV: timestamp, requests, isl, osl) or requests (an Azure or BurstGPT CSV, "
        "a Mooncake JSON-lines trace)"
    ),
    minutes: float = typer.Option(None, min=0.01, help="Compress a request trace's arrivals to this many minutes"),
    interval_s: float = typer.Option(None, min=0.1, help="Planner interval a request trace is counted in [default: 30 s]"),
    profile: str = typer.Option(..., help="Performance profile (.npz)"),
    plot: str = typer.Option(None, help="Write a PNG of load, prediction and workers over time here"),
    predictor: str = typer.Option("arima", help="constant, arima, kalman or prophet"),
    ttft_slo_s: float = typer.Option(2.0, min=0.0, help="Time-to-first-token SLO"),
    itl_slo_s: float = typer.Option(0.25, min=0.0, help="Inter-token latency SLO"),
    min_workers: int = typer.Option(1, min=0, help="Fewest workers"),
    max_gpus: int = typer.Option(None, min=1, help="GPU budget (unset: none)"),
    length_quantile: float = typer.Option(0.9, min=0.0, max=1.0, help="ISL/OSL quantile of the operating point; 0: the mean (Dynamo's)"),
    failure_reserve: int = typer.Option(0, min=0, max=16, help="N+k: workers planned beyond the SLOs' need, so they hold after k are lost"),
    lead_time_s: float = typer.Option(0.0, min=0.0, help="New workers' start-to-routable: plan for the load this far past each interval"),
) -> None:
    """Replay a trace offline through the predictor, the profile and the replica maths; print a JSON summary (and plot it)."""
    from phalanx.planner.dryrun import plot as draw, replay, trace_interval_s
    from phalanx.planner.errors import PlannerInputError
    from phalanx.planner.predictors import PREDICTOR_KINDS
    from phalanx.planner.profile import load_profile
    from phalanx.planner.replicas import ReplicaConfig, SloTargets
    from phalanx.planner.request_traces import load_any_trace

    if predictor not in PREDICTOR_KINDS:
        raise typer.BadParameter(f"{predictor!r}: choose one of {', '.join(PREDICTOR_KINDS)}", param_hint="--predictor")
    if ttft_slo_s <= 0 or itl_slo_s <= 0:
        raise typer.BadParameter("SLOs must be > 0")
    try:
        intervals, kind = load_any_trace(trace, interval_s=interval_s, minutes=minutes)
        loaded = load_profile(profile)
    except (PlannerInputError, OSError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    if not intervals:
        typer.echo(f"error: {trace} holds no interval", err=True)
        raise typer.Exit(2)
    interval_s = trace_interval_s(intervals)
    series = replay(
        intervals, loaded, SloTargets(ttft_s=ttft_slo_s, itl_s=itl_slo_s),
        ReplicaConfig(interval_s=interval_s, min_workers=min_workers, max_gpus=max_gpus, length_quantile=length_quantile or None,
                      failure_reserve=failure_reserve),
        predictor=predictor, lead_time_s=lead_time_s,
    )
    summary = {
        "predictor": predictor, "lead_time_s": lead_time_s, "trace": kind, "requests": sum(i.requests for i in intervals),
        "intervals": len(intervals), "interval_s": interval_s, "worker_intervals": series.worker_intervals,
        "needed_worker_intervals": sum(series.needed_combined), "under_provisioned_intervals": series.under_provisioned_intervals,
        "max_workers": max(series.combined), "pools": series.pools(), "plot": str(draw(series, plot)) if plot else None,
    }
    typer.echo(json.dumps(summary, indent=2))
