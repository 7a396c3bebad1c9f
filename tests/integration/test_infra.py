"""The shared infrastructure against real nats-server and etcd processes, no mocks."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
import textwrap
import urllib.error
import urllib.request
import uuid
from contextlib import aclosing

import aetcd
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from phalanx._proto import common_pb2
from phalanx.chaos.link import DelayLink
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import DirectoryView, WorkerDirectory, decode_registration, encode_registration
from phalanx.common.events import EventBus, MessageTooLargeError
from phalanx.common.lease import EtcdUnavailableError, LeasedKey, connect_etcd
from phalanx.common.subjects import LOAD_ALL, load_subject, worker_key
from phalanx.common.telemetry import (
    get_tracer,
    grpc_client_interceptors,
    grpc_server_interceptors,
    setup_telemetry,
)
from phalanx.launch.infra import EtcdServer, InfraError, NatsServer
from phalanx.launch.ports import free_port
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration


def _worker_id() -> str:
    return f"w-{uuid.uuid4().hex[:10]}"


def _registration(worker_id: str, **fields) -> common_pb2.WorkerRegistration:
    return common_pb2.WorkerRegistration(worker_id=worker_id, address="127.0.0.1:1", pid=os.getpid(), **fields)


async def _etcd_value(config: EtcdConfig, key: str) -> aetcd.rtypes.Get | None:
    async with aetcd.Client(host=config.host, port=config.port, timeout=2) as client:
        return await client.get(key.encode())


async def test_leased_key_is_visible_and_vanishes_at_once_on_close(etcd_config):
    key = worker_key(_worker_id())
    leased = LeasedKey(etcd_config, key, b"v1")
    await leased.start()
    try:
        stored = await _etcd_value(etcd_config, key)
        assert stored is not None and stored.value == b"v1"
        assert stored.lease == leased.lease_id
        await leased.update(b"v2")
        assert (await _etcd_value(etcd_config, key)).value == b"v2"
    finally:
        await leased.close()
    # Revoked, not expired: gone without waiting for the TTL.
    assert await _etcd_value(etcd_config, key) is None
    await leased.close()  # idempotent
    assert leased.lease_id is None


async def test_a_starting_service_waits_for_an_etcd_that_comes_up_late_and_gives_up_on_one_that_never_does():
    late = EtcdServer()  # its port chosen, the server not started yet
    config = EtcdConfig(endpoint=late.endpoint, lease_ttl_s=1, request_timeout_s=0.5, startup_timeout_s=30)
    leased = LeasedKey(config, worker_key(_worker_id()), b"patient")
    starting = asyncio.ensure_future(leased.start())
    try:
        await asyncio.sleep(1.0)
        assert not starting.done()  # still trying, not exited
        await asyncio.to_thread(late.start)
        await asyncio.wait_for(starting, timeout=20)
        assert leased.lease_id is not None
    finally:
        starting.cancel()
        await leased.close()
        late.close()
    never = EtcdConfig(endpoint=f"127.0.0.1:{free_port()}", request_timeout_s=0.2, startup_timeout_s=1)
    with pytest.raises(EtcdUnavailableError):
        await asyncio.wait_for(LeasedKey(never, worker_key(_worker_id()), b"x").start(), timeout=10)


async def test_an_etcd_client_waits_out_a_slow_handshake_instead_of_failing(etcd_config):
    # Every byte 0.3 s late, as on a busy host: the HTTP/2 handshake takes longer than gRPC's reconnect backoff, which
    # must not cut it short (it did when the channel's minimum connect timeout was set to 100 ms).
    host, port = etcd_config.endpoint.rsplit(":", 1)
    with DelayLink(host, int(port)) as link:
        link.delay_s = 0.3
        client = connect_etcd(etcd_config.model_copy(update={"endpoint": link.endpoint, "request_timeout_s": 5.0}))
        try:
            await client.get(b"/phalanx/v1/any")
        finally:
            await client.close()


async def test_leased_key_outlives_one_ttl_while_its_owner_lives(etcd_config):
    key = worker_key(_worker_id())
    async with LeasedKey(etcd_config, key, b"alive") as leased:
        await asyncio.sleep(etcd_config.lease_ttl_s * 2)
        assert (await _etcd_value(etcd_config, key)).value == b"alive"
        assert leased.registrations == 1


async def test_leased_key_vanishes_within_ttl_after_owner_is_sigkilled(etcd_config):
    key = worker_key(_worker_id())
    owner = textwrap.dedent(
        """
        import asyncio, sys
        from phalanx.common.config import EtcdConfig
        from phalanx.common.lease import LeasedKey

        async def main():
            leased = LeasedKey(EtcdConfig(endpoint=sys.argv[1], lease_ttl_s=1), sys.argv[2], b"owner")
            await leased.start()
            print("registered", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", owner, etcd_config.endpoint, key, stdout=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=15)
        assert line.strip() == b"registered"
        assert (await _etcd_value(etcd_config, key)).value == b"owner"
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        loop = asyncio.get_running_loop()
        killed_at = loop.time()

        async def gone():
            return await _etcd_value(etcd_config, key) is None

        await assert_eventually(gone, timeout=etcd_config.lease_ttl_s + 1.0, message="key of a dead owner")
        assert loop.time() - killed_at <= etcd_config.lease_ttl_s + 1.0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_lost_lease_is_regranted_and_key_put_again(etcd_config):
    key = worker_key(_worker_id())
    async with LeasedKey(etcd_config, key, b"back") as leased:
        first = leased.lease_id
        # Revoking from outside is what an expiry after a long pause looks like to the owner.
        async with aetcd.Client(host=etcd_config.host, port=etcd_config.port, timeout=2) as client:
            await client.revoke_lease(first)

        async def back_under_new_lease():
            stored = await _etcd_value(etcd_config, key)
            # The key is visible in etcd before the owner's put call returns and counts it: both are awaited.
            return stored is not None and stored.lease not in (0, first) and stored.value == b"back" and leased.registrations == 2

        await assert_eventually(back_under_new_lease, timeout=3.0)


async def test_lease_and_watch_survive_an_etcd_restart():
    with EtcdServer() as etcd:
        config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        worker_id = _worker_id()
        key = worker_key(worker_id)
        async with WorkerDirectory(config) as directory, LeasedKey(config, key, b"steady") as leased:
            await directory.list()
            async with aclosing(directory.watch()) as events:
                etcd.restart()

                async def present():
                    stored = await _etcd_value(config, key)
                    return stored is not None and stored.value == b"steady"

                await assert_eventually(present, timeout=5.0)
                # Still there after two TTLs: the keepalive stream was re-established.
                await asyncio.sleep(config.lease_ttl_s * 2)
                assert await present()
                # The watch resumed too: it reports the delete made after the restart.
                await leased.close()
                async with asyncio.timeout(5):
                    assert await anext(events) == ("delete", worker_id, None)


def _range_at(etcd: EtcdServer, key: bytes, revision: int) -> dict:
    """etcd's answer to a read of ``key`` at ``revision`` (its JSON gateway): the range, or the error it gives."""
    body = json.dumps({"key": base64.b64encode(key).decode(), "revision": str(revision)}).encode()
    request = urllib.request.Request(f"{etcd.url}/v3/kv/range", data=body, method="POST")  # noqa: S310 - loopback http only
    try:
        with urllib.request.urlopen(request, timeout=2) as response:  # noqa: S310 - loopback only
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


async def test_etcd_compacts_its_history_so_that_a_key_per_request_does_not_grow_it():
    # The router writes a record per request under a key of its own and deletes it (router/records.py): an etcd that
    # keeps every revision grows with every request (a probe: its database 169 MiB after 171 k such requests, and
    # growing; 72 MiB and flat with compaction). The local etcd compacts periodically; here with a 1 s retention.
    with EtcdServer(compaction_retention="1s") as etcd:
        async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=2) as client:
            first = None
            for n in range(20):
                put = await client.put(f"/phalanx/v1/requests/r{n}".encode(), b"record")
                first = first or put.header.revision
                await client.delete(f"/phalanx/v1/requests/r{n}".encode())

        async def compacted() -> bool:  # a read at the first put's revision: etcd no longer has that history
            return "compacted" in (await asyncio.to_thread(_range_at, etcd, b"/phalanx/v1/requests/r0", first)).get("message", "")

        await assert_eventually(compacted, timeout=15, interval=0.5, message="etcd kept its history")


async def test_worker_directory_lists_then_watches_put_update_and_delete(etcd_config):
    worker_id = _worker_id()
    async with WorkerDirectory(etcd_config) as directory:
        before = await directory.list()
        assert worker_id not in before
        # Registered after list() but before watch(): the watch must still see it.
        leased = LeasedKey(etcd_config, worker_key(worker_id), encode_registration(_registration(worker_id)))
        await leased.start()
        try:
            async with aclosing(directory.watch()) as events:

                async def next_for_worker():
                    async with asyncio.timeout(5):
                        async for event in events:
                            if event[1] == worker_id:
                                return event
                    raise AssertionError("watch ended")

                assert await next_for_worker() == ("put", worker_id, _registration(worker_id))
                updated = _registration(worker_id, model="tiny", total_blocks=64)
                await leased.update(encode_registration(updated))
                assert await next_for_worker() == ("put", worker_id, updated)
                await leased.close()
                assert await next_for_worker() == ("delete", worker_id, None)
        finally:
            await leased.close()
        assert worker_id not in await directory.list()


async def test_directory_view_follows_the_watch_and_reads_without_etcd(etcd_config, etcd_server):
    worker_id = _worker_id()
    view = DirectoryView(WorkerDirectory(etcd_config))
    leased = LeasedKey(etcd_config, worker_key(worker_id), encode_registration(_registration(worker_id)))
    following: asyncio.Task | None = None
    try:
        await leased.start()
        assert (await view.get())[worker_id] == _registration(worker_id)  # not following yet: one read of etcd
        following = asyncio.create_task(view.follow())
        updated = _registration(worker_id, model="tiny", total_blocks=64)
        await leased.update(encode_registration(updated))

        async def view_has(value) -> bool:
            return (await view.get()).get(worker_id) == value

        await assert_eventually(lambda: view_has(updated))
        await leased.close()
        await assert_eventually(lambda: view_has(None))
        leased = LeasedKey(etcd_config, worker_key(worker_id), encode_registration(_registration(worker_id)))
        await leased.start()
        await assert_eventually(lambda: view_has(_registration(worker_id)))
        # What a migration reads comes from the view, not from etcd: it answers with etcd down.
        etcd_server.stop()
        async with asyncio.timeout(1):
            assert (await view.get())[worker_id] == _registration(worker_id)
    finally:
        if following is not None:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        etcd_server.start()
        await leased.close()
        await view.close()


def test_registration_round_trips_through_json():
    registration = _registration("w1", model="m", role="attention", started_at=1.5, max_model_len=4096)
    encoded = encode_registration(registration)
    assert b'"workerId": "w1"' in encoded
    assert decode_registration(encoded) == registration
    # A newer writer's extra field does not break an older reader.
    assert decode_registration(encoded[:-1] + b', "futureField": 1}') == registration


async def test_event_bus_delivers_load_report_with_trace_context(nats_config):
    setup_telemetry("phalanx-tests", TelemetryConfig())
    worker_id = _worker_id()
    received: asyncio.Queue = asyncio.Queue()

    async def handler(message, subject, context):
        await received.put((message, subject, context))

    async with await EventBus.connect(nats_config, name="test-bus") as bus:
        assert bus.connected
        await bus.subscribe(LOAD_ALL, common_pb2.LoadReport, handler)
        await bus.flush()
        report = common_pb2.LoadReport(worker_id=worker_id, queue_depth=3, free_blocks=100, step_time_ms=4.5)
        with get_tracer(__name__).start_as_current_span("publish-load") as span:
            await bus.publish(load_subject(worker_id), report)
        while True:
            message, subject, context = await asyncio.wait_for(received.get(), timeout=5)
            if message.worker_id == worker_id:
                break
        assert message == report
        assert subject == load_subject(worker_id)
        remote = trace.get_current_span(context).get_span_context()
        assert remote.is_remote
        assert remote.trace_id == span.get_span_context().trace_id
        assert remote.span_id == span.get_span_context().span_id
        assert bus.dropped == 0


async def test_event_bus_survives_nats_restart_on_same_port():
    with NatsServer() as server:
        config = NatsConfig(url=server.url, max_reconnect_wait_s=0.5)
        depths: list[int] = []

        async def handler(message, subject, context):
            depths.append(message.queue_depth)

        async with await EventBus.connect(config, name="restart-bus") as bus:
            await bus.subscribe(load_subject("w1"), common_pb2.LoadReport, handler)
            await bus.flush()
            await bus.publish(load_subject("w1"), common_pb2.LoadReport(worker_id="w1", queue_depth=1))
            await assert_eventually(lambda: 1 in depths)

            server.stop()
            await assert_eventually(lambda: not bus.connected, message="disconnect noticed")
            # While NATS is away a publish neither raises nor blocks for long.
            async with asyncio.timeout(1):
                await bus.publish(load_subject("w1"), common_pb2.LoadReport(worker_id="w1", queue_depth=2))
            server.start()
            await assert_eventually(lambda: bus.connected, timeout=5, message="reconnected")

            await bus.publish(load_subject("w1"), common_pb2.LoadReport(worker_id="w1", queue_depth=3))
            await assert_eventually(lambda: 3 in depths, message="delivery after restart")


async def test_event_bus_counts_publishes_after_close_and_refuses_oversized(nats_config):
    bus = await EventBus.connect(nats_config, name="closing-bus")
    oversized = common_pb2.KvEvent(worker_id="w1", removed=list(range(2**40, 2**40 + 200_000)))
    with pytest.raises(MessageTooLargeError):
        await bus.publish("phalanx.kv.w1", oversized)
    await bus.close()
    await bus.close()
    assert not bus.connected
    await bus.publish(load_subject("w1"), common_pb2.LoadReport(worker_id="w1"))
    assert bus.dropped == 1


async def test_event_bus_connect_fails_fast_without_a_server():
    config = NatsConfig(url="nats://127.0.0.1:1", startup_timeout_s=0.3, connect_timeout_s=0.1)
    with pytest.raises(ConnectionError):
        await EventBus.connect(config, name="nobody-home")


class _TraceProbe(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.seen: list[trace.SpanContext] = []

    async def Check(self, request, context):  # gRPC method name
        self.seen.append(trace.get_current_span().get_span_context())
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def test_grpc_interceptors_carry_the_trace_across_an_aio_call():
    setup_telemetry("phalanx-tests", TelemetryConfig())
    server = grpc.aio.server(interceptors=grpc_server_interceptors())
    probe = _TraceProbe()
    health_pb2_grpc.add_HealthServicer_to_server(probe, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=grpc_client_interceptors()) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with get_tracer(__name__).start_as_current_span("client-call") as span:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        assert len(probe.seen) == 1
        assert probe.seen[0].trace_id == span.get_span_context().trace_id
        assert probe.seen[0].span_id != span.get_span_context().span_id  # the server's own span
    finally:
        await server.stop(None)


@pytest.mark.parametrize("server_type", [NatsServer, EtcdServer])
def test_a_server_whose_picked_port_was_taken_meanwhile_starts_on_fresh_ones(server_type) -> None:
    """free_port's port is free only a moment ago: another process may listen on it before the server does."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        server = server_type()
        server.port = taken.getsockname()[1]  # as if another process had taken the port it picked
        with server:
            assert server.running and server.port != taken.getsockname()[1]
            server.restart()  # a restart keeps the ports it served on
            assert server.running and server.port != taken.getsockname()[1]
        # A port the caller gave is the caller's: taken, the start fails and says why.
        given = server_type(port=taken.getsockname()[1])
        try:
            with pytest.raises(InfraError, match="address already in use"):
                given.start()
        finally:
            given.close()
    finally:
        taken.close()
