"""Shared fixtures: one real nats-server and one etcd per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Tests start services with subprocess + preexec_fn (PR_SET_PDEATHSIG) while gRPC
# runs; grpcio >= 1.80's fork handlers then abort the child now and then
# (grpc/grpc#43055). The children exec at once, so the handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from phalanx.common.config import EtcdConfig, NatsConfig
from phalanx.launch.infra import EtcdServer, NatsServer


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
