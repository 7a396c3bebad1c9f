"""The Helm chart is secure by default: TLS on, its certificates made by its own hook Job (`phalanx certs kube-secrets`)
without cert-manager, and the bundled NATS and etcd serving TLS with client certificates and authorization.

The Job's command runs here against a real HTTP server that keeps Secrets as the API server does (404, 409), through the
official client, with the arguments the chart renders; every call it makes must be one the chart's Role allows."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from phalanx.common.control_plane_acl import nats_tls_config
from phalanx.launch.kube_certs import KubeSecretsError, ensure_tls_secrets
from phalanx.testing import helm
from phalanx.testing.kube_api import SecretsApiServer

BUNDLED = ("nats.bundled.enabled=true", "etcd.bundled.enabled=true")
# The switches whose pods carry the identities the defaults do not run (planner, expert-worker, ert-manager).
EVERY_IDENTITY = ("planner.enabled=true", "moe.enabled=true")


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _pod_specs(objects: dict) -> Iterator[tuple[str, dict]]:
    for (kind, name), document in objects.items():
        if kind in ("Deployment", "StatefulSet", "Job"):
            yield name, document["spec"]["template"]["spec"]


def _mounted_secrets(objects: dict) -> set[str]:
    return {v["secret"]["secretName"] for _, spec in _pod_specs(objects) for v in spec.get("volumes", []) if "secret" in v}


def _job_args(job: dict) -> dict[str, list[str]]:
    args: dict[str, list[str]] = {}
    for arg in job["spec"]["template"]["spec"]["containers"][0]["args"][2:]:
        key, _, value = arg.partition("=")
        args.setdefault(key, []).append(value)
    return args


def _hook(document: dict) -> str:
    return document["metadata"].get("annotations", {}).get("helm.sh/hook", "")


@pytest.fixture
def api() -> Iterator[SecretsApiServer]:
    server = SecretsApiServer(helm.NAMESPACE)
    yield server
    server.close()


def test_tls_is_on_by_default_and_the_chart_makes_its_certificates_in_a_hook_job_before_install_and_upgrade() -> None:
    objects = helm.objects()
    job = objects[("Job", "phalanx-certs")]
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Job"):
        assert _hook(objects[(kind, "phalanx-certs")]) == "pre-install,pre-upgrade", kind
    spec = job["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "phalanx-certs" and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["containers"][0]["args"][:2] == ["certs", "kube-secrets"]
    # Every Phalanx container reads its identity's certificate; no cert-manager object without cert-manager.
    assert not [key for key in objects if key[0] == "Certificate"]
    for name, pod in _pod_specs(objects):
        if name.endswith("-certs"):
            continue
        for container in pod["containers"]:
            assert _env(container)["PHALANX_TLS_DIR"] == "/etc/phalanx/tls", (name, container["name"])


def test_the_job_s_role_reads_only_the_chart_s_secrets_and_may_create_secrets_nothing_else() -> None:
    objects = helm.objects(*BUNDLED, *EVERY_IDENTITY)
    rules = objects[("Role", "phalanx-certs")]["rules"]
    assert [(r["resources"], r["verbs"]) for r in rules] == [(["secrets"], ["get"]), (["secrets"], ["create"])]
    assert all(r["apiGroups"] == [""] for r in rules)
    readable = set(rules[0]["resourceNames"])
    # Exactly the Secrets the pods mount with every feature on (each identity's, the servers' and admin's) plus the CA's
    # and the tenants' `client` one.
    assert _mounted_secrets(objects) <= readable
    assert readable - _mounted_secrets(objects) == {"phalanx-ca", "phalanx-client-tls"}


def test_the_job_issues_every_secret_the_pods_mount_calling_only_what_its_role_allows_and_an_upgrade_keeps_them(
    api: SecretsApiServer,
) -> None:
    objects = helm.objects(*BUNDLED, *EVERY_IDENTITY)
    args = _job_args(objects[("Job", "phalanx-certs")])
    rules = objects[("Role", "phalanx-certs")]["rules"]
    identities = args["--services"][0].split(",")
    labels = dict(label.split("=", 1) for label in args["--label"])
    result = ensure_tls_secrets(
        api.core_api(), helm.NAMESPACE, args["--prefix"][0], identities, hosts=args["--host"], days=int(args["--days"][0]), labels=labels
    )
    assert _mounted_secrets(objects) | {"phalanx-ca"} <= set(api.secrets) and result.kept == []
    prefix = f"/api/v1/namespaces/{helm.NAMESPACE}/secrets"
    for method, path in api.requests:
        if method == "GET":
            assert path.removeprefix(prefix + "/") in rules[0]["resourceNames"], path
        else:
            assert (method, path) == ("POST", prefix) and "create" in rules[1]["verbs"]
    # A cert-manager-shaped secret, the CA's included; the etcd certificate names the Service and every member.
    etcd = api.secrets["phalanx-etcd-tls"]
    assert etcd["type"] == "kubernetes.io/tls" and set(etcd["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert etcd["metadata"]["labels"]["app.kubernetes.io/instance"] == helm.RELEASE
    certificate = x509.load_pem_x509_certificate(base64.b64decode(etcd["data"]["tls.crt"]))
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"phalanx-etcd", "*.phalanx-etcd-peers"} <= set(names)
    ca = base64.b64decode(api.secrets["phalanx-ca"]["data"]["ca.crt"])
    assert all(base64.b64decode(s["data"]["ca.crt"]) == ca for n, s in api.secrets.items() if n != "phalanx-ca")
    # An upgrade runs the job again: nothing is overwritten; a deleted Secret is reissued by the same CA.
    before = {name: secret["data"] for name, secret in api.secrets.items()}
    del api.secrets["phalanx-router-tls"]
    again = ensure_tls_secrets(api.core_api(), helm.NAMESPACE, args["--prefix"][0], identities, hosts=args["--host"])
    assert again.created == ["phalanx-router-tls"] and "phalanx-worker-tls" in again.kept
    unchanged = {name: data for name, data in before.items() if name != "phalanx-router-tls"}
    assert {name: secret["data"] for name, secret in api.secrets.items() if name in unchanged} == unchanged
    assert base64.b64decode(api.secrets["phalanx-router-tls"]["data"]["ca.crt"]) == ca
    assert api.secrets["phalanx-router-tls"]["data"]["tls.crt"] != before["phalanx-router-tls"]["tls.crt"]


def test_the_job_refuses_to_mix_its_ca_with_secrets_it_did_not_make(api: SecretsApiServer) -> None:
    api.secrets["phalanx-router-tls"] = {"metadata": {"name": "phalanx-router-tls"}, "data": {}}
    with pytest.raises(KubeSecretsError, match="phalanx-ca, does not"):
        ensure_tls_secrets(api.core_api(), helm.NAMESPACE, "phalanx", ["router", "worker"])
    assert set(api.secrets) == {"phalanx-router-tls"}


def test_the_bundled_nats_and_etcd_serve_tls_with_client_certificates_and_authorization() -> None:
    objects = helm.objects(*BUNDLED)
    nats = objects[("Deployment", "phalanx-nats")]["spec"]["template"]["spec"]
    assert nats["containers"][0]["args"][-2:] == ["-c", "/etc/phalanx/nats/nats.conf"]
    mounts = {m["name"]: m["mountPath"] for m in nats["containers"][0]["volumeMounts"]}
    assert mounts["config"] == "/etc/phalanx/nats" and mounts["tls"] == "/etc/phalanx/nats-tls"
    conf = objects[("ConfigMap", "phalanx-nats-config")]["data"]["nats.conf"]
    tls = Path("/etc/phalanx/nats-tls")
    assert conf == nats_tls_config(cert_file=tls / "tls.crt", key_file=tls / "tls.key", ca_file=tls / "ca.crt")
    etcd = objects[("StatefulSet", "phalanx-etcd")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--client-cert-auth" in etcd and "--peer-client-cert-auth" in etcd and "--peer-cert-allowed-cn=etcd" in etcd
    assert not [flag for flag in etcd if re.search(r"-urls=http://", flag) and "metrics" not in flag]
    assert [flag for flag in etcd if flag.startswith("--initial-cluster=")][0].count("=https://") == 3
    # Every Phalanx container presents its identity to both; the etcd-auth hook turns etcd's authorization on as admin.
    for name, pod in _pod_specs(objects):
        for container in pod["containers"]:
            env = _env(container)
            if "PHALANX_ETCD_ENDPOINT" in env:
                assert env["PHALANX_ETCD_TLS_DIR"] == env["PHALANX_NATS_TLS_DIR"] == "/etc/phalanx/tls", (name, container["name"])
    auth = objects[("Job", "phalanx-etcd-auth")]
    assert _hook(auth) == "post-install,post-upgrade"
    container = auth["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:4] == ["certs", "etcd-auth", "--etcd-endpoint", "phalanx-etcd:2379"]
    assert auth["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "phalanx-admin-tls"


def test_cert_manager_replaces_the_job_and_issues_the_bundled_servers_certificates_too() -> None:
    objects = helm.objects(*helm.REQUIRED_WITH["tls.certManager.enabled=true"], "tls.certManager.enabled=true", *BUNDLED)
    assert ("Job", "phalanx-certs") not in objects and ("Role", "phalanx-certs") not in objects
    certificates = {name for kind, name in objects if kind == "Certificate"}
    assert _mounted_secrets(objects) <= certificates
    etcd = objects[("Certificate", "phalanx-etcd-tls")]["spec"]
    assert etcd["commonName"] == "etcd" and "*.phalanx-etcd-peers" in etcd["dnsNames"] and "server auth" in etcd["usages"]


def test_tls_enabled_false_is_plaintext_everywhere() -> None:
    objects = helm.objects("tls.enabled=false", *BUNDLED)
    assert not [key for key in objects if key[1].endswith(("-certs", "-etcd-auth")) or key[0] == "Certificate"]
    assert ("ConfigMap", "phalanx-nats-config") not in objects
    assert objects[("Deployment", "phalanx-nats")]["spec"]["template"]["spec"]["containers"][0]["args"] == ["-js", "-sd", "/data", "-m", "8222"]
    for name, pod in _pod_specs(objects):
        for container in pod["containers"]:
            assert not [k for k in _env(container) if "TLS" in k], (name, container["name"])
