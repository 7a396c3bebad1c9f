"""One trace from the client through the router to the worker, exported over OTLP."""

import asyncio

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from phalanx.client import Client
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC endpoint that keeps what it receives: (service name, span name, trace id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes]] = []

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                self.spans.extend((service, span.name, span.trace_id) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def collector():
    server = grpc.aio.server()
    sink = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield sink, f"http://127.0.0.1:{port}"
    await server.stop(0)


async def test_client_router_and_worker_spans_share_one_trace(nats_config, etcd_config, collector):
    sink, endpoint = collector
    env = {"PHALANX_TELEMETRY_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    stack = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    try:
        await stack.add_workers(1, env=env)
        router = await stack.add_router(env=env)
        tracer = TracerProvider().get_tracer("test-client")
        async with await Client.connect(router.address, timeout=30) as client:
            with tracer.start_as_current_span("client.generate") as span:
                await client.complete("trace me", max_tokens=4)
        trace_id = span.get_span_context().trace_id.to_bytes(16, "big")

        def services_in_trace():
            services = {service for service, _, tid in sink.spans if tid == trace_id}
            assert {"phalanx-router", "phalanx-worker"} <= services, services
            return services

        await assert_eventually(services_in_trace, timeout=10)
        names = {name for _, name, tid in sink.spans if tid == trace_id}
        assert "router.route" in names
        assert any("WorkerService/Generate" in n for n in names), names
    finally:
        await asyncio.to_thread(stack.stop)
