"""A 3-member etcd (EtcdCluster) and clients given every member: they keep working while any one member is down."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from phalanx.common.config import EtcdConfig
from phalanx.common.lease import TRANSIENT_ERRORS, LeasedKey, connect_etcd
from phalanx.launch.infra import EtcdCluster, EtcdServer, ServerTls
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration


async def _in_thread(pool: ThreadPoolExecutor, fn) -> object:
    # Members die with the thread that started them (PR_SET_PDEATHSIG): one long-lived thread starts them all.
    return await asyncio.get_running_loop().run_in_executor(pool, fn)


async def _value(config: EtcdConfig, key: bytes) -> bytes | None:
    client = connect_etcd(config)
    try:
        held = await client.get(key)
    finally:
        await client.close()
    return None if held is None else held.value


async def test_a_killed_leader_is_replaced_and_rejoins_with_its_data():
    with ThreadPoolExecutor(max_workers=1) as pool:
        cluster = EtcdCluster(3)
        try:
            await _in_thread(pool, cluster.start)
            leader = await _in_thread(pool, cluster.leader)
            assert isinstance(leader, EtcdServer)
            key = f"/test/{uuid.uuid4().hex}".encode()
            config = EtcdConfig(endpoint=cluster.endpoint)
            client = connect_etcd(config)
            await client.put(key, b"before")
            await client.close()

            await _in_thread(pool, leader.kill)
            elected = await _in_thread(pool, lambda: cluster.leader(timeout=30))
            assert elected is not None and elected is not leader
            assert not cluster.running

            await _in_thread(pool, leader.start)
            assert cluster.running
            # The rejoined member follows the new leader and holds what was written before it died.
            status = await _in_thread(pool, leader.status)
            assert status is not None and status["leader"] != status["header"]["member_id"]
            assert await _value(EtcdConfig(endpoint=leader.endpoint), key) == b"before"
        finally:
            await _in_thread(pool, cluster.close)


async def test_a_client_of_every_member_keeps_its_lease_and_reads_while_each_member_in_turn_is_down():
    with ThreadPoolExecutor(max_workers=1) as pool:
        cluster = EtcdCluster(3)
        try:
            await _in_thread(pool, cluster.start)
            config = EtcdConfig(endpoint=cluster.endpoint, lease_ttl_s=2)
            key = f"/test/leased/{uuid.uuid4().hex}"
            client = connect_etcd(config)
            try:
                async with LeasedKey(config, key, b"alive") as leased:
                    # The first endpoint first: a client that only ever dialled it would be cut off here.
                    for member in cluster.members:
                        await _in_thread(pool, member.kill)
                        written = f"without {member.member_name}".encode()

                        async def put_and_read(written: bytes = written) -> bool:
                            # A call already on the dead member's connection fails (callers retry those); the next
                            # ones must go to the live members.
                            try:
                                await client.put(b"/test/probe", written)
                                held = await client.get(b"/test/probe")
                            except TRANSIENT_ERRORS:
                                return False
                            return held is not None and held.value == written

                        await assert_eventually(put_and_read, timeout=15.0, interval=0.2)
                        # Longer than the TTL with the member down: the keepalives went through the others.
                        await asyncio.sleep(config.lease_ttl_s * 1.5)
                        assert await _value(config, key.encode()) == b"alive"
                        await _in_thread(pool, member.start)
                    assert leased.registrations == 1  # the lease was never lost, so never granted again
            finally:
                await client.close()
        finally:
            await _in_thread(pool, cluster.close)


def _peer_get(url: str, context: ssl.SSLContext | None) -> int | str:
    """The HTTP status of GET ``url``, or why there was none."""
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:  # noqa: S310 - loopback only
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError) as error:
        return f"{type(error).__name__}: {error}"


async def test_a_tls_cluster_serves_its_clients_and_its_peers_only_over_mutual_tls(control_plane_certs):
    with ThreadPoolExecutor(max_workers=1) as pool:
        cluster = EtcdCluster(3, tls=ServerTls.from_dir(control_plane_certs / "etcd"))
        try:
            await _in_thread(pool, cluster.start)
            assert await _in_thread(pool, cluster.leader) is not None
            config = EtcdConfig(endpoint=cluster.endpoint, tls_dir=str(control_plane_certs / "router"))
            key = f"/test/{uuid.uuid4().hex}".encode()
            client = connect_etcd(config)
            try:
                await client.put(key, b"over tls")
            finally:
                await client.close()
            for member in cluster.members:
                assert await _value(EtcdConfig(endpoint=member.endpoint, tls_dir=str(control_plane_certs / "router")), key) == b"over tls"

            peer = f"127.0.0.1:{cluster.members[0].peer_port}"

            def context(identity_dir: Path | None) -> ssl.SSLContext:
                made = ssl.create_default_context(cafile=str(control_plane_certs / "etcd" / "ca.crt"))
                if identity_dir is not None:
                    made.load_cert_chain(identity_dir / "tls.crt", identity_dir / "tls.key")
                return made

            # What a member presents to its peers is accepted (the control that the path itself answers) ...
            assert _peer_get(f"https://{peer}/version", context(control_plane_certs / "etcd")) == 200
            # ... plaintext, no client certificate, another CA's certificate and another identity of this CA are not.
            assert _peer_get(f"http://{peer}/version", None) != 200
            for identity in (None, control_plane_certs / "admin"):
                refused = _peer_get(f"https://{peer}/version", context(identity))
                assert isinstance(refused, str) and ("CERTIFICATE" in refused or "reset" in refused.lower()), (identity, refused)
            other = ssl.create_default_context(cafile=str(control_plane_certs / "etcd" / "ca.crt"))
            other.load_cert_chain(control_plane_certs / "other-ca" / "router" / "tls.crt", control_plane_certs / "other-ca" / "router" / "tls.key")
            refused = _peer_get(f"https://{peer}/version", other)
            assert isinstance(refused, str), refused
        finally:
            await _in_thread(pool, cluster.close)
