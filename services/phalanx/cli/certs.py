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
_LABEL_OPTION = typer.Option(None, "--label", help="key=value put on every Secret created (repeatable)")


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


@certs_app.command("nats-config")
def certs_nats_config(
    directory: str = typer.Option(..., "--dir", help="The directory of `phalanx certs init` as the NATS server sees it (its nats/ identity)"),
    out: str = typer.Option("-", "--out", help="Where to write the config file ('-': stdout)"),
) -> None:
    """nats-server's config for mutual TLS with authorization: the `nats` certificate, a client certificate of the CA
    required and mapped to a user by its URI SAN (verify_and_map), and one user per Phalanx service identity and admin
    with the subjects of the control-plane ACL (phalanx.common.control_plane_acl); tenants' certificates get no user."""
    from pathlib import Path

    from phalanx.common.control_plane_acl import nats_tls_config
    from phalanx.common.tls import CA_FILE, CERT_FILE, KEY_FILE

    nats = Path(directory) / "nats"
    text = nats_tls_config(cert_file=nats / CERT_FILE, key_file=nats / KEY_FILE, ca_file=nats / CA_FILE)
    if out == "-":
        print(text, end="")
    else:
        Path(out).write_text(text)


@certs_app.command("etcd-auth")
def certs_etcd_auth(
    endpoint: str = typer.Option(
        ..., "--etcd-endpoint", envvar="PHALANX_ETCD_ENDPOINT", help="etcd host:port (comma-separated for a cluster)"
    ),
    timeout: float = typer.Option(30.0, min=1, help="Seconds to wait for etcd to answer"),
) -> None:
    """Turn etcd's authorization on: a user per Phalanx service identity and admin (the client certificate's CN is the
    user), each service's role from the control-plane ACL, admin with the root role. Idempotent; run it with the admin
    certificate (PHALANX_ETCD_TLS_DIR=<certs>/admin), which is the one allowed once auth is on."""
    import asyncio

    from phalanx.common.config import EtcdConfig
    from phalanx.launch.control_plane_auth import apply_etcd_auth

    config = EtcdConfig(endpoint=endpoint)
    if config.tls() is None:
        raise typer.BadParameter("etcd takes the user from the client certificate: set PHALANX_ETCD_TLS_DIR to the admin identity")
    try:
        asyncio.run(apply_etcd_auth(config, timeout_s=timeout))
    except Exception as error:  # noqa: BLE001 - any refusal or outage: say it and fail the one-shot
        details = getattr(error, "details", None)  # a gRPC error: its status and etcd's text, not its repr
        why = f"{error.code().name}: {details()}" if callable(details) else str(error)  # type: ignore[attr-defined]  # details() goes with code()
        typer.echo(f"error: cannot set up etcd's authorization at {endpoint}: {why} (is PHALANX_ETCD_TLS_DIR the admin identity?)", err=True)
        raise typer.Exit(1) from None
    print(json.dumps({"etcd": endpoint, "authorization": "enabled"}))


@certs_app.command("kube-secrets")
def certs_kube_secrets(
    prefix: str = typer.Option(..., "--prefix", help="Secret names: <prefix>-<identity>-tls, and <prefix>-ca for the CA"),
    namespace: str = typer.Option(
        "", "--namespace", envvar="POD_NAMESPACE", help="Where the Secrets go (default: the namespace this pod runs in)"
    ),
    services: list[str] = _SERVICES_OPTION,
    hosts: list[str] = _HOSTS_OPTION,
    days: int = typer.Option(365, min=1, max=3650, help="Validity of the CA and the certificates"),
    label: list[str] = _LABEL_OPTION,
) -> None:
    """Inside a Kubernetes pod (the Helm chart's hook Job): create the Secret of every identity that has none, issued by
    the CA kept in <prefix>-ca (made on the first run). Existing Secrets are never overwritten; delete one to reissue it."""
    from pathlib import Path

    from kubernetes import client, config

    from phalanx.common.tls import CLIENT_IDENTITIES, INFRA_IDENTITIES, SERVICE_IDENTITIES
    from phalanx.launch.kube_certs import KubeSecretsError, ensure_tls_secrets

    identities = [name.strip() for given in services or () for name in given.split(",") if name.strip()]
    identities = identities or [*SERVICE_IDENTITIES, *CLIENT_IDENTITIES, *INFRA_IDENTITIES]
    labels = dict(item.split("=", 1) for item in label or () if "=" in item)
    if len(labels) != len(label or ()):
        raise typer.BadParameter(f"--label takes key=value: {label}")
    config.load_incluster_config()
    namespace = namespace or Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
    try:
        result = ensure_tls_secrets(client.CoreV1Api(), namespace, prefix, identities, hosts=list(hosts or ()), days=days, labels=labels)
    except (KubeSecretsError, ValueError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    print(json.dumps({"namespace": namespace, "created": result.created, "kept": result.kept}))
