"""The service shell: one lifecycle order, and domain errors that reach gRPC status in one place."""

from __future__ import annotations

import asyncio
import gc
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry, Counter

from phalanx.common import service
from phalanx.common.config import TelemetryConfig
from phalanx.common.errors import FailedPreconditionError, InvalidRequestError, ResourceExhaustedError, UnavailableError
from phalanx.common.grpc_status import DOMAIN, DomainErrorInterceptor
from phalanx.common.service import ServiceShell

pytestmark = pytest.mark.integration

SERVICE = "phalanx.test.v1.ErrorsService"


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    metrics_port: int = 0


class ErrorsServicer:
    """Raises domain errors from each handler kind; requests and responses are raw bytes."""

    async def unary(self, request: bytes, context) -> bytes:
        if request == b"ok":
            return b"fine"
        if request == b"bug":
            raise RuntimeError("not a domain error")
        raise UnavailableError("draining", retry_after_s=1.5)

    async def stream(self, request: bytes, context):
        yield b"one"
        yield b"two"
        raise ResourceExhaustedError("too much queued", retry_after_s=2.5)

    async def written(self, request: bytes, context) -> None:
        """A streaming handler that writes through the context (the style of grpc.health's Watch)."""
        await context.write(b"first")
        raise InvalidRequestError("prompt.text", "too long")

    async def precondition(self, request: bytes, context) -> bytes:
        raise FailedPreconditionError("only 40 committed", subject="req-a", metadata={"committed": "40"})


def add_errors_service(servicer: ErrorsServicer, server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(servicer.stream),
                    "Written": grpc.unary_stream_rpc_method_handler(servicer.written),
                    "Precondition": grpc.unary_unary_rpc_method_handler(servicer.precondition),
                },
            ),
        )
    )


@pytest.fixture
def undone(monkeypatch) -> list[str]:
    """What the shell undid, in order; telemetry is recorded there instead of touching this process's tracer provider."""
    calls: list[str] = []
    monkeypatch.setattr(service, "setup_telemetry", lambda name, config: calls.append(f"setup {name}"))
    monkeypatch.setattr(service, "shutdown_telemetry", lambda: calls.append("telemetry"))
    return calls


@pytest.fixture
async def shell(undone):
    shell = ServiceShell("phalanx-test", Listen(), TelemetryConfig(), registry=CollectorRegistry())
    async with shell:
        shell.add_service(SERVICE, add_errors_service, ErrorsServicer())
        await shell.start()
        await shell.set_serving(True)
        yield shell
        await shell.stop_server(0)


def details(error: grpc.aio.AioRpcError) -> dict[type, object]:
    status = rpc_status.from_call(error)
    found = {}
    for any_detail in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.BadRequest,
                     error_details_pb2.PreconditionFailure):
            message = kind()
            if any_detail.Unpack(message):
                found[kind] = message
    return found


async def test_unary_domain_error_becomes_its_status_with_error_info_and_retry_info(shell):
    async with grpc.aio.insecure_channel(shell.address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Unary")
        assert await call(b"ok") == b"fine"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(b"fail")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and caught.value.details() == "draining"
    found = details(caught.value)
    assert found[error_details_pb2.ErrorInfo].reason == "UNAVAILABLE" and found[error_details_pb2.ErrorInfo].domain == DOMAIN
    assert found[error_details_pb2.RetryInfo].retry_delay.ToNanoseconds() == 1_500_000_000


async def test_stream_that_raises_mid_stream_delivers_what_it_sent_then_the_status(shell):
    received = []
    async with grpc.aio.insecure_channel(shell.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for response in channel.unary_stream(f"/{SERVICE}/Stream")(b""):
                received.append(response)
    assert received == [b"one", b"two"]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = details(caught.value)
    assert found[error_details_pb2.ErrorInfo].reason == "RESOURCE_EXHAUSTED"
    assert found[error_details_pb2.RetryInfo].retry_delay.ToNanoseconds() == 2_500_000_000


async def test_streaming_coroutine_that_writes_through_the_context_gets_the_status_too():
    # Without the shell: OpenTelemetry's interceptor breaks such handlers (the shell exempts the one it has, health's Watch).
    server = grpc.aio.server(interceptors=[DomainErrorInterceptor()])
    add_errors_service(ErrorsServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    received = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for response in channel.unary_stream(f"/{SERVICE}/Written")(b""):
                    received.append(response)
    finally:
        await server.stop(0)
    assert received == [b"first"]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = details(caught.value)[error_details_pb2.BadRequest].field_violations
    assert [(v.field, v.description) for v in violations] == [("prompt.text", "too long")]


async def test_failed_precondition_names_its_subject_and_metadata(shell):
    async with grpc.aio.insecure_channel(shell.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Precondition")(b"")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_status.from_call(caught.value).code == code_pb2.FAILED_PRECONDITION
    found = details(caught.value)
    assert found[error_details_pb2.ErrorInfo].metadata["committed"] == "40"
    assert found[error_details_pb2.PreconditionFailure].violations[0].subject == "req-a"


async def test_other_exceptions_stay_unknown_without_details(shell):
    async with grpc.aio.insecure_channel(shell.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Unary")(b"bug")
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert rpc_status.from_call(caught.value) is None


async def test_lifecycle_runs_in_order_and_undoes_in_reverse(undone):
    registry = CollectorRegistry()
    Counter("phalanx_test_calls", "Calls", registry=registry).inc()
    shell = ServiceShell("phalanx-test", Listen(), TelemetryConfig(), registry=registry)
    async with shell:
        assert shell.address.startswith("127.0.0.1:") and not shell.address.endswith(":0")  # bound before any servicer exists
        shell.add_service(SERVICE, add_errors_service, ErrorsServicer())
        shell.callback(undone.append, "first pushed")
        await shell.start()
        async with grpc.aio.insecure_channel(shell.address) as channel:
            checks = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                assert (await checks.Check(health_pb2.HealthCheckRequest(service=name))).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await _listed_services(channel) == {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
            assert b"phalanx_test_calls_total 1.0" in await asyncio.to_thread(_get, f"http://{shell.metrics_address}/metrics")
            watch = checks.Watch(health_pb2.HealthCheckRequest(service=SERVICE))  # a coroutine handler: the interceptor keeps it working
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            shell.push_async_callback(_append_later, undone, "last pushed")
            assert not shell.ready.is_set()
            await shell.set_serving(True)
            assert shell.ready.is_set()
            assert (await checks.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == health_pb2.HealthCheckResponse.SERVING
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()

            shell.request_stop()
            await asyncio.wait_for(shell.wait_for_stop(), 1.0)
            await shell.stop_serving()
            assert (await checks.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await shell.set_serving(True)  # after a graceful shutdown began, nothing brings SERVING back
            assert (await checks.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await shell.stop_server(0)
    assert undone == ["setup phalanx-test", "last pushed", "first pushed", "telemetry"]
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(_get, f"http://{shell.metrics_address}/metrics")


async def test_a_failed_start_still_undoes_what_was_set_up(undone):
    shell = ServiceShell("phalanx-test", Listen(), TelemetryConfig(), registry=CollectorRegistry())
    with pytest.raises(ConnectionError):
        async with shell:
            shell.add_service(SERVICE, add_errors_service, ErrorsServicer())
            await shell.start()
            shell.callback(undone.append, "connected")
            raise ConnectionError("NATS is away")
    assert undone == ["setup phalanx-test", "connected", "telemetry"]
    assert not shell.ready.is_set()


async def test_services_are_added_before_start_only(undone):
    async with ServiceShell("phalanx-test", Listen(), TelemetryConfig(), registry=CollectorRegistry()) as shell:
        await shell.start()
        with pytest.raises(RuntimeError):
            shell.add_service(SERVICE, add_errors_service, ErrorsServicer())


async def _append_later(calls: list[str], name: str) -> None:
    await asyncio.sleep(0)
    calls.append(name)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 - the tests' own http:// URLs
        return reply.read()


async def _listed_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for response in call:
        return {s.name for s in response.list_services_response.service}
    return set()


async def test_a_service_that_owns_its_process_freezes_its_startup_heap_when_it_serves(undone, monkeypatch):
    # What run_until_signalled sets: a full collection must not traverse the model and imports (docs/chaos.md).
    monkeypatch.setattr(service, "_freeze_heap_when_serving", True)
    gc.unfreeze()
    try:
        async with ServiceShell("phalanx-test", Listen(), TelemetryConfig(), registry=CollectorRegistry()) as shell:
            await shell.start()
            assert gc.get_freeze_count() == 0
            await shell.set_serving(True)
            frozen = gc.get_freeze_count()
            assert frozen > 1000  # this test process's modules and objects, at least
            await shell.set_serving(True)  # once per process start: a quarantine lifted later freezes nothing more
            assert gc.get_freeze_count() == frozen
            await shell.stop_server(0)
    finally:
        gc.unfreeze()
