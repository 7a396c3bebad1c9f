"""Shared fixtures: one real nats-server and one etcd per test session (plaintext), and TLS ones for the tests that ask."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests start services with subprocess + preexec_fn (PR_SET_PDEATHSIG) while gRPC
# runs; grpcio >= 1.80's fork handlers then abort the child now and then
# (grpc/grpc#43055). The children exec at once, so the handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Routers admit by SLO by default (router/overload.py); most tests load a slow worker on a busy box on purpose and expect
# every request served, so they run with admission off. The tests of admission turn it on for their routers.
os.environ.setdefault("PHALANX_ROUTER_ADMISSION", "off")
# Engines (and expert workers) compute in float32 on every machine: `auto` picks bfloat16 where the CPU has AVX512-BF16 or
# AMX, and there a sequence's greedy tokens depend on what else is in its batch (bfloat16 rounding beats the margins), so
# the tests that compare streams token for token across workers and batch sizes would pass or fail by the CPU. The
# bfloat16 and int4 paths have their own tests, which ask for their dtype.
os.environ.setdefault("PHALANX_ENGINE_DTYPE", "float32")
os.environ.setdefault("PHALANX_EXPERT_DTYPE", "float32")

from phalanx.common.config import EtcdConfig, NatsConfig
from phalanx.common.tls import init_certs
from phalanx.launch.infra import EtcdServer, NatsServer, ServerTls


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A nats-server on a free loopback port for the whole session."""
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """A single-member etcd tuned for 1 s leases, for the whole session."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def nats_config(nats_server: NatsServer) -> NatsConfig:
    """Config pointing at the session nats-server (restarted if a test stopped it)."""
    nats_server.start()
    return NatsConfig(url=nats_server.url, startup_timeout_s=5.0)


@pytest.fixture
def etcd_config(etcd_server: EtcdServer) -> EtcdConfig:
    """Config pointing at the session etcd with 1 s leases (restarted if a test stopped it)."""
    etcd_server.start()
    return EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)


@pytest.fixture(scope="session")
def control_plane_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A development CA with certificates for etcd, NATS, services and callers (``<dir>/<identity>/``), and another CA's
    ``router`` certificate in ``<dir>/other-ca/router`` (one the servers must refuse)."""
    directory = tmp_path_factory.mktemp("control-plane-certs")
    init_certs(directory, ["etcd", "nats", "router", "worker", "admin", "client"], days=1)
    init_certs(directory / "other-ca", ["router"], days=1)
    return directory


@pytest.fixture(scope="session")
def tls_etcd_server(control_plane_certs: Path) -> Iterator[EtcdServer]:
    """An etcd that serves only TLS (https client URL) and wants a client certificate of the CA (--client-cert-auth), with
    authorization on: the users and roles of phalanx.common.control_plane_acl, set up as ``admin``."""
    with EtcdServer(tls=ServerTls.from_dir(control_plane_certs / "etcd"), authorize=control_plane_certs / "admin") as server:
        yield server


@pytest.fixture(scope="session")
def tls_nats_server(control_plane_certs: Path) -> Iterator[NatsServer]:
    """A nats-server whose ``tls`` block wants a client certificate of the CA and maps it to a user
    (``verify_and_map: true``): only the identities of phalanx.common.control_plane_acl, each with its own subjects."""
    with NatsServer(tls=ServerTls.from_dir(control_plane_certs / "nats")) as server:
        yield server
