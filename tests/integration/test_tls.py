"""Mutual TLS and authorization on a real stack: every service serves mTLS only, and internal RPCs want a service's identity.

One worker, a router, a checkpoint store, migration and health, each with its
own certificate from ``phalanx certs init`` (PHALANX_TLS_DIR). Tenants hold
the ``client`` certificate, operators ``admin``.
"""

import asyncio

import grpc
import pytest

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, common_pb2, migration_pb2, migration_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.client import Client, RetryPolicy, TlsConfig, UnavailableError
from phalanx.common.config import EtcdConfig
from phalanx.common.tls import ServiceTls, init_certs, open_channel, set_process_tls
from phalanx.launch.services import start_checkpoint_store, start_migration
from phalanx.launch.stack import Stack, unique_id
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.cleanup import forget_health_state

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 120
# Health is here for its calls over mTLS (canaries, Watch); a loaded box's slow canaries must not drain the one worker,
# nor its capacity model raise the degradation level that refuses new requests.
HEALTH_ENV = {
    "PHALANX_DEGRADATION_ENABLED": "false", "PHALANX_HEALTH_CHECK_TIMEOUT_S": "30", "PHALANX_HEALTH_MIN_CHECK_TIMEOUT_S": "10",
}
PROMPT = "Mutual TLS keeps tenants out of the workers' internals."


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    init_certs(directory, ["worker", "router", "health", "migration", "checkpoint-store", "admin", "client"], days=1)
    return directory


@pytest.fixture(scope="module")
def secured(nats_server, etcd_server, certs):
    """The stack, every process with its own certificate; the test process itself calls as admin (the launchers' probes)."""
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model="phalanx-tiny-moe")

    def tls(name: str) -> dict[str, str]:
        return {"PHALANX_TLS_DIR": str(certs / name)}

    async def start():
        # Started side by side: each gets longer than the launchers' defaults, as they compete for a loaded box's CPUs.
        store, migration, _ = await asyncio.gather(
            start_checkpoint_store(unique_id("ckpt"), s.etcd_config, env=tls("checkpoint-store"), timeout=START_TIMEOUT_S),
            start_migration(unique_id("mig"), s.nats_url, s.etcd_config, env=tls("migration"), timeout=START_TIMEOUT_S),
            s.add_workers(1, env=tls("worker")),
        )
        s.stores.append(store)
        s.migrations.append(migration)
        await asyncio.gather(s.add_router(env=tls("router")), s.add_health(env={**tls("health"), **HEALTH_ENV}))

    set_process_tls(ServiceTls.from_dir(certs / "admin"))
    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()
        asyncio.run(forget_health_state(s.etcd_config))  # its health records and calibration would mislead a later module's
        set_process_tls(None)


def identity(certs, name: str) -> ServiceTls:
    return ServiceTls.from_dir(certs / name)


async def _denied(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED, raised.value
    return raised.value


async def test_a_tenant_certificate_streams_greedy_tokens_through_the_router(secured, certs):
    async with await Client.connect(secured.routers[0].address, tls=TlsConfig.from_dir(certs / "client"), timeout=60) as client:
        first = await client.complete(PROMPT, max_tokens=12, ignore_eos=True)
        again = await client.complete(PROMPT, max_tokens=12, ignore_eos=True)
    assert len(first.token_ids) == 12
    assert list(again.token_ids) == list(first.token_ids)  # greedy: the same tokens


async def test_a_caller_without_a_client_certificate_is_refused(secured, certs):
    router = secured.routers[0].address
    ca_only = TlsConfig(root_certificates=(certs / "ca.crt").read_bytes(), server_name_override="phalanx.internal")
    for tls in (ca_only, None):  # TLS without a client certificate, and plaintext
        # One attempt: the refusal is the handshake's, not a deadline spent on retries.
        async with await Client.connect(router, tls=tls, timeout=30, retry=RetryPolicy(max_attempts=1)) as client:
            with pytest.raises(UnavailableError):
                await client.list_workers()


async def test_health_canaries_a_worker_over_mtls(secured):
    worker = secured.workers[0].worker_id

    async def healthy():
        records = {r.worker_id: r for r in (await secured.healths[0].list_health()).workers}
        record = records.get(worker)
        # A latency baseline means a canary ran: health called the worker's Canary over mTLS, as "health".
        assert record is not None and record.health == common_pb2.WORKER_HEALTH_HEALTHY and record.latency_baseline_s > 0, record
        return True

    await assert_eventually(healthy, timeout=30, message="health never saw the worker HEALTHY over mTLS")


async def test_a_tenant_may_not_drain_a_worker_or_reach_checkpoints_or_migration(secured, certs):
    tenant = identity(certs, "client")
    worker, store, migration = secured.workers[0], secured.stores[0], secured.migrations[0]
    async with open_channel(worker.address, tls=tenant) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        error = await _denied(stub.Drain(worker_pb2.DrainRequest(grace_s=1, keep_running=True), timeout=5))
        assert "/phalanx.worker.v1.WorkerService/Drain" in error.details() and "'client'" in error.details()
        await _denied(stub.Attach(worker_pb2.AttachRequest(request_id="someone-elses"), timeout=5).read())
        await _denied(stub.Restore(worker_pb2.RestoreRequest(), timeout=5))
    async with open_channel(store.address, tls=tenant) as channel:
        stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
        await _denied(stub.GetCommit(checkpoint_pb2.GetCommitRequest(request_id="someone-elses"), timeout=5))
        writes = stub.Stream()
        await _denied(writes.read())
    async with open_channel(migration.address, tls=tenant) as channel:
        await _denied(migration_pb2_grpc.MigrationServiceStub(channel).MigrateWorker(
            migration_pb2.MigrateWorkerRequest(worker_id=worker.worker_id, reason="tenant"), timeout=5
        ))


async def test_an_admin_may_drain_and_undrain_a_worker(secured, certs):
    async with open_channel(secured.workers[0].address, tls=identity(certs, "admin")) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        await stub.Drain(worker_pb2.DrainRequest(grace_s=1, keep_running=True), timeout=10)
        await stub.Undrain(worker_pb2.UndrainRequest(), timeout=10)
    async with await Client.connect(secured.routers[0].address, tls=TlsConfig.from_dir(certs / "client"), timeout=60) as client:
        completion = await client.complete(PROMPT, max_tokens=4, ignore_eos=True)
    assert len(completion.token_ids) == 4
