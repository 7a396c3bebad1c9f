"""etcd and NATS over mutual TLS: real servers that want a client certificate of the deployment's CA.

The etcd serves only https with --client-cert-auth; the nats-server's ``tls`` block has ``verify: true``. Our lease,
discovery and event-bus code work over them with a certificate of the CA (PHALANX_ETCD_* / PHALANX_NATS_* TLS
settings); a caller without a certificate, with another CA's, or in plaintext is refused with an error that says so;
and a worker and a router serve a request with both connections on TLS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
import uuid
from pathlib import Path

import aetcd.exceptions
import pytest
from aetcd import rpc
from google.protobuf import json_format

from phalanx._proto import common_pb2
from phalanx.client import Client
from phalanx.common.config import EtcdConfig, NatsConfig
from phalanx.common.control_plane_acl import ETCD_MEMBER_USER
from phalanx.common.discovery import WorkerDirectory
from phalanx.common.events import EventBus
from phalanx.common.lease import EtcdPermissionDeniedError, EtcdUnavailableError, LeasedKey, connect_etcd
from phalanx.common.subjects import (
    PLANNER_DECISION_KEY,
    TENANT_USAGE_SUBJECT,
    WORKERS_PREFIX,
    load_subject,
    router_key,
    worker_key,
)
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"


def etcd_tls(server: EtcdServer, certs: Path, identity: str = "admin", **more) -> EtcdConfig:
    return EtcdConfig(endpoint=server.endpoint, lease_ttl_s=1, tls_dir=str(certs / identity), **more)


def nats_tls(server: NatsServer, certs: Path, identity: str = "admin", **more) -> NatsConfig:
    return NatsConfig(url=server.url, tls_dir=str(certs / identity), **{"startup_timeout_s": 5.0, **more})


async def test_leases_and_discovery_work_over_mtls_etcd(tls_etcd_server, control_plane_certs):
    config = etcd_tls(tls_etcd_server, control_plane_certs, "worker")
    # Under the workers' prefix: with etcd's authorization on, a worker may write there and nowhere else of the test's.
    prefix = f"{WORKERS_PREFIX}tls-{uuid.uuid4().hex[:8]}/"
    registration = common_pb2.WorkerRegistration(worker_id="w-tls", address="127.0.0.1:1")
    directory = WorkerDirectory(etcd_tls(tls_etcd_server, control_plane_certs, "router"), prefix=prefix)
    try:
        async with LeasedKey(config, prefix + "w-tls", json_format.MessageToJson(registration).encode()):
            listed = await directory.list()
            assert listed["w-tls"].address == "127.0.0.1:1"

        # Revoked with its lease on close: gone for every reader.
        async def gone() -> bool:
            assert "w-tls" not in await directory.list()
            return True

        await assert_eventually(gone, timeout=5, message="the revoked key stayed in etcd")
    finally:
        await directory.close()


async def test_etcd_refuses_callers_without_a_certificate_of_its_ca_and_plaintext(tls_etcd_server, control_plane_certs):
    certs = control_plane_certs
    quick = {"startup_timeout_s": 0.5}
    cases = {
        # TLS, trusting etcd, but no client certificate: etcd ends the handshake.
        "no certificate": EtcdConfig(endpoint=tls_etcd_server.endpoint, ca_file=str(certs / "ca.crt"), **quick),
        # A client certificate of another CA (the right CA trusted for the server): refused by etcd.
        "another CA's certificate": EtcdConfig(
            endpoint=tls_etcd_server.endpoint, ca_file=str(certs / "ca.crt"), cert_file=str(certs / "other-ca/router/tls.crt"),
            key_file=str(certs / "other-ca/router/tls.key"), **quick,
        ),
        # A client of another deployment: it does not trust etcd's certificate either.
        "another CA entirely": EtcdConfig(endpoint=tls_etcd_server.endpoint, tls_dir=str(certs / "other-ca/router"), **quick),
    }
    for case, config in cases.items():
        with pytest.raises(EtcdUnavailableError) as raised:
            async with LeasedKey(config, f"/test/tls-refused/{uuid.uuid4().hex}", b"x"):
                pass
        message = str(raised.value)
        assert "handshake failed" in message.lower() and "PHALANX_ETCD_" in message, (case, message)
        if case == "another CA entirely":
            assert "CERTIFICATE_VERIFY_FAILED" in message, message

    # Plaintext to the TLS port: etcd closes the connection; the error points at the TLS settings.
    plaintext = EtcdConfig(endpoint=tls_etcd_server.endpoint, **quick)
    with pytest.raises(EtcdUnavailableError, match="if it serves TLS, set PHALANX_ETCD_TLS_DIR"):
        async with LeasedKey(plaintext, f"/test/tls-refused/{uuid.uuid4().hex}", b"x"):
            pass
    # and nothing was written by any of them
    client = connect_etcd(etcd_tls(tls_etcd_server, certs))
    try:
        assert len(await client.get_prefix(b"/test/tls-refused/")) == 0
    finally:
        await client.close()


async def test_a_nats_publisher_and_subscriber_talk_over_mtls(tls_nats_server, control_plane_certs):
    # A worker's load subject: the one kind of subject both identities may use (a worker publishes, a router subscribes).
    worker_id = f"w-tls-{uuid.uuid4().hex[:8]}"
    subject = load_subject(worker_id)
    publisher = await EventBus.connect(nats_tls(tls_nats_server, control_plane_certs, "worker"), name="tls-publisher")
    subscriber = await EventBus.connect(nats_tls(tls_nats_server, control_plane_certs, "router"), name="tls-subscriber")
    received: list[common_pb2.LoadReport] = []

    async def on_message(message, subject, context) -> None:
        received.append(message)

    try:
        await subscriber.subscribe(subject, common_pb2.LoadReport, on_message)
        await subscriber.flush()

        async def delivered() -> bool:
            # Events are best effort (a publish on a loaded box may be dropped after its timeout): published until one arrives.
            await publisher.publish(subject, common_pb2.LoadReport(worker_id=worker_id))
            await asyncio.sleep(0.1)
            assert received and {m.worker_id for m in received} == {worker_id}
            return True

        await assert_eventually(delivered, timeout=5, message="the message did not cross the TLS NATS")
        # Both connections are TLS on the server's side.
        connections = _connections(tls_nats_server)
        for name in ("tls-publisher", "tls-subscriber"):
            assert connections[name].get("tls_version", "").startswith("1.3"), connections[name]
    finally:
        await publisher.close()
        await subscriber.close()


@pytest.mark.slow
async def test_nats_refuses_callers_without_a_certificate_of_its_ca_and_plaintext(tls_nats_server, nats_server, control_plane_certs):
    certs = control_plane_certs
    quick = {"startup_timeout_s": 1.5}
    refusals = {
        "certificate required": NatsConfig(url=tls_nats_server.url, ca_file=str(certs / "ca.crt"), **quick),
        # A client certificate of another CA (the right CA trusted for the server): the server's alert ends the handshake.
        "alert unknown ca": NatsConfig(
            url=tls_nats_server.url, ca_file=str(certs / "ca.crt"), cert_file=str(certs / "other-ca/router/tls.crt"),
            key_file=str(certs / "other-ca/router/tls.key"), **quick,
        ),
        "certificate verify failed": NatsConfig(url=tls_nats_server.url, tls_dir=str(certs / "other-ca/router"), **quick),
        # A plaintext client (nats:// URL, no TLS setting): the server wants TLS; the error says which settings.
        "the server requires TLS; set PHALANX_NATS_TLS_DIR": NatsConfig(url=tls_nats_server.url.replace("tls://", "nats://"), **quick),
        # A TLS client never falls back to a server that offers plaintext only.
        "does not offer TLS, and TLS is configured: refusing plaintext": NatsConfig(
            url=nats_server.url, tls_dir=str(certs / "admin"), **quick
        ),
    }
    nats_server.start()
    for expected, config in refusals.items():
        with pytest.raises(ConnectionError) as raised:
            bus = await EventBus.connect(config, name="tls-refused")
            await bus.close()
        message = str(raised.value)
        if expected == "alert unknown ca" and "alert" not in message:
            # TLS 1.3: the server may close the connection before its alert is read; the error says what to check.
            expected = "the server closed the TLS connection; if it wants a client certificate, does it trust the CA of ours?"
        assert expected in message.lower() or expected in message, (expected, message)
    assert "tls-refused" not in _connections(tls_nats_server)


async def test_a_tenant_certificate_gets_nothing_from_etcd_or_nats(tls_etcd_server, tls_nats_server, control_plane_certs):
    certs = control_plane_certs
    # A long startup timeout: a refusal must end the attempt long before it (not retried), even on a loaded box.
    tenant = etcd_tls(tls_etcd_server, certs, "client", startup_timeout_s=20)
    # etcd: the CN "client" is no user of its authorization: no write (refused at once, not retried), no read.
    started = time.monotonic()
    with pytest.raises(EtcdPermissionDeniedError, match="permission denied.*tenants' `client` certificates get nothing from etcd"):
        async with LeasedKey(tenant, worker_key("fake-worker"), b"{}"):
            pass
    assert time.monotonic() - started < 10
    client = connect_etcd(tenant)
    try:
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await client.get_prefix(WORKERS_PREFIX.encode())
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await client.put(PLANNER_DECISION_KEY.encode(), b"{}")
    finally:
        await client.close()
    # NATS: the certificate is verified, but its identity (URI SAN spiffe://phalanx/client) is no user; refused at once.
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="authorization refused this client's certificate .identity client.") as raised:
        await EventBus.connect(nats_tls(tls_nats_server, certs, "client", startup_timeout_s=20), name="tenant")
    assert "Authorization Violation" in str(raised.value) and time.monotonic() - started < 10
    # Gone once the refused attempt's socket is closed, which the connect abandons to the background on a loaded box (its
    # close waits 1 s at most): waiting here also closes it before this test's loop ends (CI: an unclosed transport of a
    # test ending at once surfaced as a ResourceWarning in the next test of the worker).
    deadline = time.monotonic() + 10
    while "tenant" in await asyncio.to_thread(_connections, tls_nats_server) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert "tenant" not in await asyncio.to_thread(_connections, tls_nats_server)


async def test_the_members_own_certificate_is_a_user_without_a_role(tls_etcd_server, control_plane_certs):
    # The compose members' healthchecks present it: their read is refused (healthy to etcdctl), as a known user's, so
    # etcd logs no "cannot find a user for permission check" error for every check.
    admin = connect_etcd(etcd_tls(tls_etcd_server, control_plane_certs))
    try:
        await admin.connect()
        user = await rpc.AuthStub(admin.channel).UserGet(rpc.AuthUserGetRequest(name=ETCD_MEMBER_USER))
        assert list(user.roles) == []
    finally:
        await admin.close()
    member = connect_etcd(etcd_tls(tls_etcd_server, control_plane_certs, "etcd"))
    try:
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await member.get(b"health")
    finally:
        await member.close()


async def test_a_worker_cannot_write_the_planners_keys_nor_publish_the_routers_usage(
    tls_etcd_server, tls_nats_server, control_plane_certs, caplog
):
    certs = control_plane_certs
    worker = connect_etcd(etcd_tls(tls_etcd_server, certs, "worker"))
    try:
        # Its own prefix it may write; the planner's decision (what an orchestrator carries out) it may not.
        own = worker_key(f"acl-{uuid.uuid4().hex[:8]}")
        await worker.put(own.encode(), b"{}")
        await worker.delete(own.encode())
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await worker.put(PLANNER_DECISION_KEY.encode(), b"{}")
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await worker.put(router_key("router-fake").encode(), b"{}")
    finally:
        await worker.close()
    with pytest.raises(EtcdPermissionDeniedError):
        async with LeasedKey(etcd_tls(tls_etcd_server, certs, "worker"), PLANNER_DECISION_KEY, b"{}"):
            pass

    # NATS: the routers' usage subject is not the worker's; the server drops the message and says so.
    publisher = await EventBus.connect(nats_tls(tls_nats_server, certs, "worker"), name="acl-worker")
    watcher = await EventBus.connect(nats_tls(tls_nats_server, certs, "admin"), name="acl-admin")
    worker_id = f"w-acl-{uuid.uuid4().hex[:8]}"
    usage: list[common_pb2.TenantUsageReport] = []
    loads: list[common_pb2.LoadReport] = []

    async def on_usage(message, subject, context) -> None:
        usage.append(message)

    async def on_load(message, subject, context) -> None:
        loads.append(message)

    try:
        await watcher.subscribe(TENANT_USAGE_SUBJECT, common_pb2.TenantUsageReport, on_usage)
        await watcher.subscribe(load_subject(worker_id), common_pb2.LoadReport, on_load)
        await watcher.flush()

        async def load_after_usage_arrived() -> bool:
            # In order on one connection: once a load report published after it arrives, the usage report would have.
            await publisher.publish(TENANT_USAGE_SUBJECT, common_pb2.TenantUsageReport(router_id="router-fake", incarnation="x"))
            await publisher.publish(load_subject(worker_id), common_pb2.LoadReport(worker_id=worker_id))
            await asyncio.sleep(0.1)
            assert loads
            return True

        with caplog.at_level(logging.WARNING, logger="phalanx.common.events"):
            await assert_eventually(load_after_usage_arrived, timeout=5, message="the worker's own load report did not arrive")
            await assert_eventually(
                lambda: 'permissions violation for publish to "phalanx.tenant_usage"' in caplog.text.lower(), timeout=5,
                message="the worker was not told that its publish was refused",
            )
        assert usage == []
    finally:
        await publisher.close()
        await watcher.close()


def test_a_certificate_without_its_key_is_a_configuration_error(control_plane_certs):
    with pytest.raises(ValueError, match="go together"):
        EtcdConfig(cert_file=str(control_plane_certs / "admin/tls.crt"))
    with pytest.raises(ValueError, match="go together"):
        NatsConfig(key_file=str(control_plane_certs / "admin/tls.key"))
    missing = EtcdConfig(tls_dir=str(control_plane_certs / "nobody"))
    with pytest.raises(FileNotFoundError, match="etcd TLS is configured but these files are missing"):
        connect_etcd(missing)


async def test_a_worker_and_a_router_serve_over_tls_etcd_and_nats(tls_etcd_server, tls_nats_server, control_plane_certs):
    certs = control_plane_certs

    def env(identity: str) -> dict[str, str]:
        return {**etcd_tls(tls_etcd_server, certs, identity).tls_env(), **nats_tls(tls_nats_server, certs, identity).tls_env()}

    stack = Stack(tls_nats_server.url, etcd_tls(tls_etcd_server, certs), model=MODEL)
    try:
        (worker,) = await stack.add_workers(1, "--engine", "sim", env=env("worker"))
        router = await stack.add_router(env=env("router"))
        async with await Client.connect(router.address, timeout=30) as client:
            listed = await client.list_workers()
            completion = await client.complete("over TLS etcd and NATS", max_tokens=8, ignore_eos=True)
        assert [w.worker_id for w in listed] == [worker.worker_id]
        assert len(completion.token_ids) == 8
        # The worker's and the router's NATS connections are TLS ones, each with its own client certificate.
        connections = await asyncio.to_thread(_connections, tls_nats_server)
        tls_names = {name for name, c in connections.items() if c.get("tls_version")}
        assert any(worker.worker_id in name for name in tls_names), connections.keys()
        assert any(router.name in name for name in tls_names), connections.keys()
    finally:
        stack.stop()


def _connections(server: NatsServer) -> dict[str, dict]:
    """The nats-server's client connections by name (its /connz monitoring endpoint)."""
    with urllib.request.urlopen(f"http://{server.host}:{server.monitor_port}/connz?limit=1024", timeout=5) as reply:
        return {c.get("name", ""): c for c in json.loads(reply.read())["connections"]}
