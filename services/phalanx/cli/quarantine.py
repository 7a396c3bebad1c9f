"""`phalanx quarantine`: the request fingerprints the routers refuse because the request crashed the workers that ran it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

import typer
from google.protobuf import json_format

from phalanx.cli.shared import AsJson, EtcdEndpoint, with_etcd

quarantine_app = typer.Typer(
    help="Poison requests: fingerprints refused fleet-wide after the request crashed K workers (docs/migration.md, \"Poison requests\").",
    no_args_is_help=True,
)


@quarantine_app.command("list")
def list_command(etcd_endpoint: EtcdEndpoint = None, as_json: AsJson = False) -> None:
    """The quarantined fingerprints: the request, its crashes and workers, and how long the refusal still lasts."""
    from phalanx.router.quarantine import list_quarantined

    records = asyncio.run(with_etcd(etcd_endpoint, list_quarantined))
    if as_json:
        typer.echo(json.dumps([json_format.MessageToDict(r, preserving_proto_field_name=True) for r in records], indent=2))
        return
    if not records:
        typer.echo("no request is quarantined")
        return
    now = time.time()
    for r in records:
        left = max(r.quarantined_at + r.ttl_s - now, 0.0)
        typer.echo(f"{r.fingerprint}  request {r.request_id}  {r.crashes} crashes ({', '.join(r.worker_ids)})  "
                   f"model {r.model or '-'}  tenant {r.tenant or '-'}  {left:.0f} s left")


@quarantine_app.command("release")
def release_command(
    fingerprints: Annotated[list[str] | None, typer.Argument(help="Fingerprints to release (from `phalanx quarantine list`)")] = None,
    release_all: bool = typer.Option(False, "--all", help="Release every quarantined fingerprint"),
    etcd_endpoint: EtcdEndpoint = None,
) -> None:
    """Lift quarantines: every router serves the request again at once (it may crash workers again)."""
    from phalanx.router.quarantine import list_quarantined, release_quarantined

    async def release(client) -> list[tuple[str, bool]]:
        names = [r.fingerprint for r in await list_quarantined(client)] if release_all else list(fingerprints or [])
        return [(name, await release_quarantined(client, name)) for name in names]

    if not release_all and not fingerprints:
        raise typer.BadParameter("give fingerprints, or --all")
    try:
        results = asyncio.run(with_etcd(etcd_endpoint, release))
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    for name, released in results:
        typer.echo(f"released {name}" if released else f"{name} is not quarantined")
    if not all(released for _, released in results):
        raise typer.Exit(1)
