"""`phalanx planner`: the planner service, and the commands that talk to it through etcd."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict

import typer

planner_app = typer.Typer(
    help="The planner: predicts load, sizes the worker fleet, replaces DEAD workers (docs/planner.md). Without a subcommand it runs the service.",
)

_ETCD_HELP = "etcd host:port [env PHALANX_ETCD_ENDPOINT]"


def _given(**values):
    return {k: v for k, v in values.items() if v not in (None, "")}


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
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run a planner instance (one leads and decides, others stand by)."""
    if ctx.invoked_subcommand is not None:
        return
    from phalanx.common.config import EtcdConfig, TelemetryConfig
    from phalanx.common.service import run_until_signalled
    from phalanx.planner.config import PlannerConfig
    from phalanx.planner.service import PlannerProcess

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = PlannerConfig(**_given(
        instance_id=instance_id, host=host, port=port, connector=connector, interval_s=interval_s, min_workers=min_workers,
        max_workers=max_workers, profile=profile, predictor=predictor, correction=correction, prometheus_url=prometheus_url,
    ))
    run_until_signalled(PlannerProcess(config, EtcdConfig(**_given(endpoint=etcd_endpoint)), TelemetryConfig()))


async def _with_etcd(endpoint: str | None, action):
    from phalanx.common.config import EtcdConfig
    from phalanx.common.lease import connect_etcd

    client = connect_etcd(EtcdConfig(**_given(endpoint=endpoint)))
    try:
        return await action(client)
    finally:
        await client.close()


@planner_app.command("set-target")
def set_target(
    workers: int = typer.Argument(None, min=0, help="Workers the planner should ask for (within its min and max)"),
    clear: bool = typer.Option(False, "--clear", help="Remove the operator's target: the planner plans from load again"),
    etcd_endpoint: str = typer.Option(None, help=_ETCD_HELP),
) -> None:
    """Set (or --clear) an operator's worker target; the planner decides on it at its next ready tick."""
    from phalanx.planner.connectors import clear_target, write_target

    if clear:
        asyncio.run(_with_etcd(etcd_endpoint, clear_target))
        typer.echo("cleared the operator's target")
        return
    if workers is None:
        raise typer.BadParameter("give a worker count, or --clear")
    asyncio.run(_with_etcd(etcd_endpoint, lambda client: write_target(client, workers)))
    typer.echo(f"target: {workers} workers")


@planner_app.command("show")
def show(etcd_endpoint: str = typer.Option(None, help=_ETCD_HELP)) -> None:
    """The planner's last decision, the orchestrator's acknowledgement and the operator's target, as JSON."""
    from phalanx.planner.connectors import read_ack, read_decision, read_target

    async def read(client):
        decision, ack, target = await read_decision(client), await read_ack(client), await read_target(client)
        return {"decision": asdict(decision) if decision else None, "ack": asdict(ack) if ack else None, "target": target}

    typer.echo(json.dumps(asyncio.run(_with_etcd(etcd_endpoint, read)), indent=2))
