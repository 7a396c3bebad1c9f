"""Certificates of `phalanx certs init`, the identity read from them, and the authorization policy table."""

import stat

import pytest
from cryptography import x509

from phalanx._proto import (
    channel_pb2,
    chaos_pb2,
    checkpoint_pb2,
    encoder_pb2,
    expert_pb2,
    health_pb2,
    migration_pb2,
    router_pb2,
    worker_pb2,
)
from phalanx.common.authz import ADMIN, POLICY, allowed
from phalanx.common.config import EtcdConfig, NatsConfig
from phalanx.common.tls import (
    CA_FILE,
    CERT_FILE,
    KEY_FILE,
    SERVICE_IDENTITIES,
    ServiceTls,
    TlsSettings,
    identity_of_certificate,
    init_certs,
    resolve_client_tls,
)

PROTOS = (channel_pb2, chaos_pb2, checkpoint_pb2, encoder_pb2, expert_pb2, health_pb2, migration_pb2, router_pb2, worker_pb2)


def test_init_makes_a_ca_and_one_cert_manager_style_directory_per_identity_with_private_keys(tmp_path):
    written = init_certs(tmp_path, ["worker", "client"], hosts=["worker.phalanx.svc", "10.0.0.7"], days=2)
    assert [p.name for p in written] == ["worker", "client"]
    for name in ("worker", "client"):
        files = {p.name for p in (tmp_path / name).iterdir()}
        assert files == {CERT_FILE, KEY_FILE, CA_FILE}
        assert stat.S_IMODE((tmp_path / name / KEY_FILE).stat().st_mode) == 0o600
        assert (tmp_path / name / CA_FILE).read_bytes() == (tmp_path / "ca.crt").read_bytes()
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600


def test_etcd_and_nats_get_server_certificates_named_after_themselves_not_phalanx_internal(tmp_path):
    init_certs(tmp_path, ["etcd", "nats"], hosts=["etcd-0.etcd"])
    for server in ("etcd", "nats"):
        certificate = x509.load_pem_x509_certificate((tmp_path / server / CERT_FILE).read_bytes())
        names = set(certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
        assert server in names and "localhost" in names and "etcd-0.etcd" in names
        assert "phalanx.internal" not in names  # cannot pose as a Phalanx service
        usages = set(certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert usages == {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH}


def test_etcd_and_nats_tls_settings_resolve_a_directory_or_single_files(tmp_path):
    assert EtcdConfig().tls() is None and NatsConfig().tls() is None and not NatsConfig().tls_enabled
    assert NatsConfig(url="tls://nats:4222").tls_enabled  # a tls:// URL alone: TLS with the system's roots
    tls = EtcdConfig(tls_dir=str(tmp_path / "admin"), ca_file=str(tmp_path / "other-ca.crt")).tls()
    assert tls is not None
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (tmp_path / "other-ca.crt", tmp_path / "admin" / CERT_FILE, tmp_path / "admin" / KEY_FILE)
    ca_only = resolve_client_tls("NATS", ca_file=str(tmp_path / "ca.crt"))
    assert ca_only is not None and ca_only.cert_file is None and ca_only.key_file is None
    env = EtcdConfig(tls_dir="/certs/router", tls_server_name="etcd").tls_env()
    assert env == {"PHALANX_ETCD_TLS_DIR": "/certs/router", "PHALANX_ETCD_TLS_SERVER_NAME": "etcd"}
    with pytest.raises(ValueError, match="go together"):
        NatsConfig(cert_file=str(tmp_path / "tls.crt"))


def test_a_service_certificate_names_its_identity_and_the_hosts_a_client_certificate_names_none(tmp_path):
    init_certs(tmp_path, ["router", "client"], hosts=["router.example.com", "10.0.0.7"])
    router = x509.load_pem_x509_certificate((tmp_path / "router" / CERT_FILE).read_bytes())
    san = router.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://phalanx/router"]
    assert {"phalanx.internal", "localhost", "router.example.com"} <= set(san.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.7"}
    client = x509.load_pem_x509_certificate((tmp_path / "client" / CERT_FILE).read_bytes())
    client_san = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert client_san.get_values_for_type(x509.DNSName) == []  # a tenant cannot pose as a server
    assert identity_of_certificate((tmp_path / "router" / CERT_FILE).read_bytes()) == "router"
    assert ServiceTls.from_dir(tmp_path / "client").identity == "client"


def test_a_second_init_keeps_the_ca_and_the_certificates_it_already_issued(tmp_path):
    init_certs(tmp_path, ["worker"])
    ca, cert = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "worker" / CERT_FILE).read_bytes()
    assert init_certs(tmp_path, ["worker", "admin"]) == [tmp_path / "admin"]
    assert (tmp_path / "ca.crt").read_bytes() == ca and (tmp_path / "worker" / CERT_FILE).read_bytes() == cert
    init_certs(tmp_path, ["worker"], force=True)
    assert (tmp_path / "worker" / CERT_FILE).read_bytes() != cert


def test_identity_falls_back_to_the_common_name(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    from phalanx.common.tls import issue_certificate

    init_certs(tmp_path, [])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    pem, _ = issue_certificate(ca, key, "health", server=False)
    assert identity_of_certificate(pem) == "health"
    assert x509.load_pem_x509_certificate(pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "health"


@pytest.mark.parametrize("bad", ["", "../x", ".hidden", "a/b"])
def test_init_refuses_a_name_that_is_not_an_identity(tmp_path, bad):
    with pytest.raises(ValueError, match="identity"):
        init_certs(tmp_path, [bad])


def test_settings_read_the_directory_or_three_files_together():
    assert not TlsSettings().enabled
    assert TlsSettings(dir="/etc/phalanx/tls").files()[0].as_posix() == "/etc/phalanx/tls/tls.crt"
    with pytest.raises(ValueError, match="go together"):
        TlsSettings(cert_file="/a.crt")


def test_every_rpc_of_every_service_has_a_row_in_the_policy():
    methods = {f"/{s.full_name}/{m.name}" for proto in PROTOS for s in proto.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert methods - POLICY.keys() == set()


@pytest.mark.parametrize("method", [
    "/phalanx.worker.v1.WorkerService/Drain", "/phalanx.worker.v1.WorkerService/Attach", "/phalanx.worker.v1.WorkerService/Restore",
    "/phalanx.checkpoint.v1.CheckpointStore/Stream", "/phalanx.migration.v1.MigrationService/MigrateWorker",
    "/phalanx.chaos.v1.ChaosService/InjectFault", "/phalanx.migration.v1.KvSource/FetchKv",
])
def test_tenants_reach_no_internal_rpc_and_admins_reach_every_one(method):
    assert not allowed(method, "client")
    assert not allowed(method, None)
    assert allowed(method, ADMIN)


def test_public_rpcs_take_any_certificate_and_unknown_rpcs_none():
    assert allowed("/phalanx.router.v1.RouterService/Generate", "client")
    assert allowed("/phalanx.router.v1.RouterService/Generate", "tenant-acme")
    assert allowed("/grpc.health.v1.Health/Check", "client")
    assert not allowed("/phalanx.new.v1.NewService/Anything", ADMIN)


def test_only_the_callers_a_service_needs_reach_its_internals():
    assert allowed("/phalanx.worker.v1.WorkerService/Drain", "health")
    assert not allowed("/phalanx.worker.v1.WorkerService/Drain", "router")
    assert allowed("/phalanx.checkpoint.v1.CheckpointStore/Stream", "worker")
    assert not allowed("/phalanx.checkpoint.v1.CheckpointStore/Stream", "migration")
    assert all(allowed("/phalanx.worker.v1.WorkerService/Stats", name) for name in SERVICE_IDENTITIES)


def test_the_private_key_stays_out_of_reprs(tmp_path):
    init_certs(tmp_path, ["worker"])
    tls = ServiceTls.from_dir(tmp_path / "worker")
    assert b"PRIVATE KEY" in tls.private_key
    assert "PRIVATE KEY" not in repr(tls)
