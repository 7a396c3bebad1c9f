"""Mutual TLS in the deployments: every Phalanx pod and compose service gets its identity's certificate when TLS is on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.common.tls import CLIENT_IDENTITIES, SERVICE_IDENTITIES

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TEMPLATES = DEPLOY / "helm" / "phalanx" / "templates"
# Phalanx pods (not NATS, etcd): the chart template and the identities of its pods.
PODS = {
    "checkpoint-store-deployment.yaml": {"checkpoint-store"}, "encoder-deployment.yaml": {"encoder-pool"},
    "gateway-deployment.yaml": {"gateway"}, "health-deployment.yaml": {"health"}, "migration-deployment.yaml": {"migration"},
    "planner.yaml": {"planner"}, "moe.yaml": {"expert-worker", "ert-manager"}, "router-deployment.yaml": {"router"},
    "worker-statefulset.yaml": {"worker"},
}


def test_tls_is_on_by_default_and_names_the_server_name_the_services_check() -> None:
    values = yaml.safe_load((DEPLOY / "helm" / "phalanx" / "values.yaml").read_text())
    assert values["tls"]["enabled"] is True
    assert values["tls"]["serverName"] == "phalanx.internal"
    assert values["tls"]["certManager"]["enabled"] is False


@pytest.mark.parametrize("template", sorted(PODS))
def test_every_phalanx_container_reads_its_identity_from_a_mounted_secret(template: str) -> None:
    text = (TEMPLATES / template).read_text()
    containers = len(re.findall(r"^\s+image: ", text, re.M))
    assert text.count('include "phalanx.tls.env"') == containers
    assert text.count('include "phalanx.tls.volumeMount"') == containers
    assert set(re.findall(r'include "phalanx.tls.volume" \(list \. "([a-z-]+)"\)', text)) == PODS[template]


def test_cert_manager_issues_every_identity_a_pod_mounts_plus_admin_and_client() -> None:
    text = (TEMPLATES / "certificates.yaml").read_text()
    assert 'splitList " " (include "phalanx.tls.servers" .)' in text
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    servers = set(re.search(r'define "phalanx.tls.servers" -}}\n([a-z -]+)\n', helpers).group(1).split())
    assert set().union(*PODS.values()) <= servers <= set(SERVICE_IDENTITIES)
    assert 'list "admin" "client"' in text and set(CLIENT_IDENTITIES) == {"admin", "client"}
    assert "spiffe://phalanx/{{ $identity }}" in text


def test_the_compose_tls_file_gives_every_phalanx_service_its_certificate_from_the_certs_one_shot() -> None:
    base = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())["services"]
    tls = yaml.safe_load((DEPLOY / "compose" / "docker-compose.tls.yml").read_text())["services"]
    phalanx = {name for name, service in base.items() if service.get("image") == "phalanx:dev" or "build" in service}
    assert phalanx <= tls.keys()
    for name in phalanx:
        identity = Path(tls[name]["environment"]["PHALANX_TLS_DIR"]).name
        command = base[name]["command"][0]
        assert identity == {"memory-service": "memory-service"}.get(command, command), name
        assert identity in SERVICE_IDENTITIES
        assert tls[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        # The same identity towards etcd and NATS, which serve mutual TLS in this file.
        environment = tls[name]["environment"]
        assert environment["PHALANX_ETCD_TLS_DIR"] == environment["PHALANX_NATS_TLS_DIR"] == environment["PHALANX_TLS_DIR"], name
    assert "phalanx certs init --dir /certs" in tls["certs"]["command"][0]


def test_the_compose_tls_file_runs_etcd_and_nats_with_client_certificate_auth() -> None:
    base = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())["services"]
    tls = yaml.safe_load((DEPLOY / "compose" / "docker-compose.tls.yml").read_text())["services"]
    for n in (1, 2, 3):
        member, environment = f"etcd-{n}", tls[f"etcd-{n}"]["environment"]
        # etcd takes its client and peer URLs from ETCD_* variables in both files (a flag would shadow the TLS file's
        # variable).
        assert not [flag for flag in base[member]["command"] if "-client-urls" in flag or "-peer-urls" in flag or "cert" in flag
                    or "initial-cluster=" in flag]
        assert set(base[member]["environment"]) == {"ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
                                                    "ETCD_INITIAL_ADVERTISE_PEER_URLS", "ETCD_INITIAL_CLUSTER"}
        assert base[member]["environment"]["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"http://{member}:2380"
        assert environment == {
            "ETCD_LISTEN_CLIENT_URLS": "https://0.0.0.0:2379", "ETCD_ADVERTISE_CLIENT_URLS": f"https://{member}:2379",
            "ETCD_CLIENT_CERT_AUTH": "true", "ETCD_TRUSTED_CA_FILE": "/certs/etcd/ca.crt", "ETCD_CERT_FILE": "/certs/etcd/tls.crt",
            "ETCD_KEY_FILE": "/certs/etcd/tls.key",
            # The members talk to each other over mutual TLS as well (tests/integration/test_etcd_cluster.py runs it).
            "ETCD_LISTEN_PEER_URLS": "https://0.0.0.0:2380", "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"https://{member}:2380",
            "ETCD_INITIAL_CLUSTER": "etcd-1=https://etcd-1:2380,etcd-2=https://etcd-2:2380,etcd-3=https://etcd-3:2380",
            "ETCD_PEER_CLIENT_CERT_AUTH": "true", "ETCD_PEER_CERT_ALLOWED_CN": "etcd", "ETCD_PEER_TRUSTED_CA_FILE": "/certs/etcd/ca.crt",
            "ETCD_PEER_CERT_FILE": "/certs/etcd/tls.crt", "ETCD_PEER_KEY_FILE": "/certs/etcd/tls.key",
        }
        assert "https://127.0.0.1:2379" in " ".join(tls[member]["healthcheck"]["test"])
    # The one etcd certificate names every member: clients check it against the first endpoint's host.
    assert all(f"--host etcd-{n}" in tls["certs"]["command"][0] for n in (1, 2, 3))
    # NATS reads the config the `certs` one-shot writes (TLS, verify_and_map and the ACL's users: see the test below).
    nats = tls["nats"]["command"]
    assert nats == [*base["nats"]["command"], "-c", "/certs/nats/nats.conf"]
    assert "phalanx certs nats-config --dir /certs --out /certs/nats/nats.conf" in tls["certs"]["command"][0]
    for server in ("etcd-1", "etcd-2", "etcd-3", "nats"):
        assert tls[server]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert "certs:/certs:ro" in tls[server]["volumes"]


def test_the_compose_tls_file_turns_etcd_and_nats_authorization_on_before_any_service_starts(tmp_path) -> None:
    from typer.testing import CliRunner

    from phalanx.cli.certs import certs_app
    from phalanx.common.control_plane_acl import nats_authorization

    base = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())["services"]
    tls = yaml.safe_load((DEPLOY / "compose" / "docker-compose.tls.yml").read_text())["services"]
    # etcd's RBAC, as admin, once every member serves; every Phalanx service waits for it.
    auth = tls["etcd-auth"]
    assert auth["command"][:2] == ["certs", "etcd-auth"] and auth["environment"]["PHALANX_ETCD_TLS_DIR"] == "/certs/admin"
    assert auth["command"][auth["command"].index("--etcd-endpoint") + 1] == "etcd-1:2379,etcd-2:2379,etcd-3:2379"
    assert all(auth["depends_on"][f"etcd-{n}"]["condition"] == "service_healthy" for n in (1, 2, 3))
    phalanx = {name for name, service in base.items() if service.get("image") == "phalanx:dev" or "build" in service}
    for name in phalanx:
        assert tls[name]["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully", name
    # The NATS config the certs one-shot writes: the nats identity's files in the volume, verify_and_map, the ACL's users.
    out = tmp_path / "nats.conf"
    result = CliRunner().invoke(certs_app, ["nats-config", "--dir", "/certs", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert '"/certs/nats/tls.crt"' in text and '"/certs/nats/ca.crt"' in text and "verify_and_map: true" in text
    assert text.endswith(nats_authorization())
