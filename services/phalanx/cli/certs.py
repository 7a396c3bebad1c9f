"""`phalanx certs`: a development CA and a certificate per service, for mutual TLS (docs/security.md)."""

from __future__ import annotations

import json

import typer

certs_app = typer.Typer(help="Certificates for mutual TLS between the services (docs/security.md).", no_args_is_help=True)


_SERVICES_OPTION = typer.Option(
    None, "--services", help="Identities to issue (repeatable or comma-separated); default: every service, admin, client, etcd and nats"
)
_HOSTS_OPTION = typer.Option(
    None, "--host", help="More DNS names or IPs for the server certificates (repeatable); localhost and 127.0.0.1 are always in"
)


@certs_app.command("init")
def certs_init(
    directory: str = typer.Option(..., "--dir", help="Where the CA (ca.crt, ca.key) and one <identity>/ directory per identity go"),
    services: list[str] = _SERVICES_OPTION,
    hosts: list[str] = _HOSTS_OPTION,
    days: int = typer.Option(365, min=1, max=3650, help="Validity of the CA and the certificates"),
    force: bool = typer.Option(False, "--force", help="Reissue identities that already have a certificate (the CA is kept)"),
) -> None:
    """Make a development CA (kept if DIR has one) and DIR/<identity>/{tls.crt,tls.key,ca.crt}, the layout of a cert-manager
    secret: point a service at its directory with PHALANX_TLS_DIR."""
    from phalanx.common.tls import CLIENT_IDENTITIES, INFRA_IDENTITIES, SERVICE_IDENTITIES, init_certs

    identities = [name.strip() for given in services or () for name in given.split(",") if name.strip()]
    identities = identities or [*SERVICE_IDENTITIES, *CLIENT_IDENTITIES, *INFRA_IDENTITIES]
    try:
        written = init_certs(directory, identities, hosts=list(hosts or ()), days=days, force=force)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    print(json.dumps({"dir": directory, "issued": [p.name for p in written], "kept": sorted({*identities} - {p.name for p in written})}))
