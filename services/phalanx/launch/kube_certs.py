"""The Helm chart's certificates without cert-manager: ``phalanx certs kube-secrets``, run by the chart's pre-install and
pre-upgrade hook Job (deploy/helm/phalanx/templates/certs-job.yaml).

One Secret per identity, ``<prefix>-<identity>-tls`` (``kubernetes.io/tls`` with ``tls.crt``, ``tls.key`` and
``ca.crt``: the layout of a cert-manager secret, which the pods mount at PHALANX_TLS_DIR), and the CA in
``<prefix>-ca`` (``ca.crt``, ``ca.key``) so that a later run issues what is missing with the same CA. A Secret that
exists is never overwritten: an upgrade keeps every certificate, and rotating one is deleting its Secret and running
the hook again (``helm upgrade``). Identity Secrets without the CA's are someone else's (made by hand, or by
cert-manager before): the run refuses rather than issue the rest from a second CA that the first ones do not trust.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.common.tls import CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE, init_certs

__all__ = ["KubeSecretsError", "KubeSecretsResult", "ensure_tls_secrets", "secret_name"]

_NOT_FOUND, _CONFLICT = 404, 409


class KubeSecretsError(RuntimeError):
    """The Secrets cannot be made without breaking what exists (another CA's Secrets, a concurrent run)."""


def secret_name(prefix: str, identity: str) -> str:
    """The chart's ``phalanx.tls.secretName``: ``<prefix>-<identity>-tls``, cut to 63 characters."""
    return f"{prefix}-{identity}-tls"[:63].rstrip("-")


@dataclass(frozen=True)
class KubeSecretsResult:
    created: list[str]
    kept: list[str]


def _read(api: Any, namespace: str, name: str) -> Any | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return api.read_namespaced_secret(name, namespace)
    except ApiException as error:
        if error.status == _NOT_FOUND:
            return None
        raise


def _create(api: Any, namespace: str, name: str, kind: str, files: dict[str, bytes], labels: dict[str, str]) -> bool:
    """Creates the Secret; False when another run created it first (kept as it is)."""
    import base64

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    data = {key: base64.b64encode(value).decode() for key, value in files.items()}
    body = client.V1Secret(metadata=client.V1ObjectMeta(name=name, labels=labels), type=kind, data=data)
    try:
        api.create_namespaced_secret(namespace, body)
    except ApiException as error:
        if error.status == _CONFLICT:
            return False
        raise
    return True


def ensure_tls_secrets(
    api: Any, namespace: str, prefix: str, identities: Sequence[str], *, hosts: Sequence[str] = (), days: int = 365,
    labels: dict[str, str] | None = None,
) -> KubeSecretsResult:
    """Creates the Secrets of ``identities`` that are missing (and the CA's, first), through ``api`` (the official
    client's ``CoreV1Api``); existing ones are kept as they are."""
    import base64

    labels = labels or {}
    ca_name = f"{prefix}-ca"[:63]
    names = {identity: secret_name(prefix, identity) for identity in identities}
    present = {identity for identity, name in names.items() if _read(api, namespace, name) is not None}
    ca = _read(api, namespace, ca_name)
    if ca is None and present:
        raise KubeSecretsError(
            f"Secrets {sorted(names[i] for i in present)} exist but the CA's, {ca_name}, does not: they were not made by "
            f"this job, whose new CA they would not trust. Create the missing ones the same way, or delete them all."
        )
    created, kept = [], sorted(names[i] for i in present)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if ca is not None:
            for key in (CA_FILE, CA_KEY_FILE):
                (root / key).write_bytes(base64.b64decode(ca.data[key]))
            (root / CA_KEY_FILE).chmod(0o600)
        missing = [identity for identity in identities if identity not in present]
        init_certs(root, missing, hosts=hosts, days=days)
        if ca is None:
            ca_files = {key: (root / key).read_bytes() for key in (CA_FILE, CA_KEY_FILE)}
            if not _create(api, namespace, ca_name, "Opaque", ca_files, labels):
                raise KubeSecretsError(f"another run created {ca_name} meanwhile: run this one again to issue with it")
            created.append(ca_name)
        for identity in missing:
            files = {key: (root / identity / key).read_bytes() for key in (CERT_FILE, KEY_FILE, CA_FILE)}
            made = _create(api, namespace, names[identity], "kubernetes.io/tls", files, labels)
            (created if made else kept).append(names[identity])
    return KubeSecretsResult(created=created, kept=sorted(kept))
