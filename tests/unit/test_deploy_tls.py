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


def _compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((DEPLOY / "compose" / name).read_text())["services"]


def _phalanx_services(services: dict) -> set[str]:
    return {name for name, service in services.items() if service.get("image") == "phalanx:dev" and name not in ONE_SHOTS}


# The base file's one-shots: the certificates, then etcd's users and roles.
ONE_SHOTS = {"certs", "etcd-auth"}


def test_the_compose_file_gives_every_phalanx_service_its_certificate_from_the_certs_one_shot_by_default() -> None:
    base = _compose()
    phalanx = _phalanx_services(base)
    assert {"worker-1", "router-1", "gateway", "checkpoint-store", "slot-3-memory", "worker-3-e1"} <= phalanx
    for name in phalanx:
        identity = Path(base[name]["environment"]["PHALANX_TLS_DIR"]).name
        command = base[name]["command"][0]
        assert identity == {"memory-service": "memory-service"}.get(command, command), name
        assert identity in SERVICE_IDENTITIES
        assert base[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        # Its own identity's directory only, from that identity's volume: no other key, not the CA's.
        assert [v for v in base[name]["volumes"] if v.startswith("certs")] == [f"certs-{identity}:/certs/{identity}:ro"], name
        # The same identity towards etcd and NATS, which serve mutual TLS in this file.
        environment = base[name]["environment"]
        assert environment["PHALANX_ETCD_TLS_DIR"] == environment["PHALANX_NATS_TLS_DIR"] == environment["PHALANX_TLS_DIR"], name
    assert "phalanx certs init --dir /certs" in base["certs"]["command"][0]
    assert base["certs"]["restart"] == "no" and "certs:/certs" in base["certs"]["volumes"]
    # The volume with the CA's key is the one-shot's alone; it fills one volume per identity.
    assert [name for name, service in base.items() if "certs:/certs" in " ".join(service.get("volumes", []))] == ["certs"]
    identities = {Path(v.split(":")[1]).name for v in base["certs"]["volumes"] if v.startswith("certs-")}
    assert identities == set(SERVICE_IDENTITIES) | {"admin", "etcd", "nats"}
    assert all(f"certs-{i}:/out/{i}" in base["certs"]["volumes"] for i in identities)
    assert "cp -a /certs/$$identity/. /out/$$identity/" in base["certs"]["command"][0]


def test_the_compose_file_runs_etcd_and_nats_with_client_certificate_auth() -> None:
    base = _compose()
    for n in (1, 2, 3):
        member, environment = f"etcd-{n}", base[f"etcd-{n}"]["environment"]
        # etcd takes its client and peer URLs and TLS from ETCD_* variables (the plaintext file overrides them; a flag
        # would shadow the variable).
        assert not [flag for flag in base[member]["command"] if "-client-urls" in flag or "-peer-urls" in flag or "cert" in flag
                    or "initial-cluster=" in flag]
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
        assert "https://127.0.0.1:2379" in " ".join(base[member]["healthcheck"]["test"])
    # The one etcd certificate names every member: clients check it against the first endpoint's host.
    assert all(f"--host etcd-{n}" in base["certs"]["command"][0] for n in (1, 2, 3))
    # NATS reads the config the `certs` one-shot writes (TLS, verify_and_map and the ACL's users: see the test below).
    assert base["nats"]["command"] == ["-js", "-sd", "/data", "-m", "8222", "-c", "/certs/nats/nats.conf"]
    assert "phalanx certs nats-config --dir /certs --out /certs/nats/nats.conf" in base["certs"]["command"][0]
    for server in ("etcd-1", "etcd-2", "etcd-3", "nats"):
        assert base[server]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        identity = server.split("-")[0]
        assert f"certs-{identity}:/certs/{identity}:ro" in base[server]["volumes"]


def test_the_compose_file_turns_etcd_and_nats_authorization_on_before_any_service_starts(tmp_path) -> None:
    from typer.testing import CliRunner

    from phalanx.cli.certs import certs_app
    from phalanx.common.control_plane_acl import nats_authorization

    base = _compose()
    # etcd's RBAC, as admin, once every member serves; every Phalanx service waits for it.
    auth = base["etcd-auth"]
    assert auth["command"][:2] == ["certs", "etcd-auth"] and auth["environment"]["PHALANX_ETCD_TLS_DIR"] == "/certs/admin"
    assert auth["command"][auth["command"].index("--etcd-endpoint") + 1] == "etcd-1:2379,etcd-2:2379,etcd-3:2379"
    assert auth["volumes"] == ["certs-admin:/certs/admin:ro"]
    assert all(auth["depends_on"][f"etcd-{n}"]["condition"] == "service_healthy" for n in (1, 2, 3))
    for name in _phalanx_services(base):
        assert base[name]["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully", name
    # The MoE file's services too (ert-manager, expert-worker identities).
    moe = _compose("docker-compose.moe.yml")
    for name in ("ert-manager", "expert-0", "expert-1"):
        service = {**yaml.safe_load((DEPLOY / "compose" / "docker-compose.moe.yml").read_text())["x-moe"], **moe[name]}
        assert service["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully", name
        identity = Path(moe[name]["environment"]["PHALANX_TLS_DIR"]).name
        assert identity in SERVICE_IDENTITIES and moe[name]["volumes"] == [f"certs-{identity}:/certs/{identity}:ro"]
    # The NATS config the certs one-shot writes: the nats identity's files in the volume, verify_and_map, the ACL's users.
    out = tmp_path / "nats.conf"
    result = CliRunner().invoke(certs_app, ["nats-config", "--dir", "/certs", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert '"/certs/nats/tls.crt"' in text and '"/certs/nats/ca.crt"' in text and "verify_and_map: true" in text
    assert text.endswith(nats_authorization())


def test_the_plaintext_file_turns_every_tls_setting_off_and_the_one_shots_into_no_ops() -> None:
    base, plain = _compose(), _compose("docker-compose.plaintext.yml")
    # Empty is "no TLS" to the services' settings and to the health probe, as unset is.
    for name in _phalanx_services(base):
        assert {k: v for k, v in plain[name]["environment"].items() if "TLS" in k} == {
            k: "" for k in base[name]["environment"] if "TLS" in k
        }, name
    for name in ONE_SHOTS:
        assert plain[name]["entrypoint"] == ["true"] and plain[name]["command"] == []
    assert "-c" not in plain["nats"]["command"]
    for n in (1, 2, 3):
        environment = plain[f"etcd-{n}"]["environment"]
        assert set(environment) == set(base[f"etcd-{n}"]["environment"]), "every TLS variable of the base is overridden"
        assert not [v for v in environment.values() if "https" in v or "/certs" in v or v == "true"]
        assert "http://127.0.0.1:2379" in " ".join(plain[f"etcd-{n}"]["healthcheck"]["test"])
    moe, moe_plain = _compose("docker-compose.moe.yml"), _compose("docker-compose.moe-plaintext.yml")
    assert set(moe_plain) == {name for name, service in moe.items() if "PHALANX_TLS_DIR" in service.get("environment", {})}
