"""OpenTelemetry tracing: one provider per process, W3C trace context on gRPC and NATS.

Spans are always created once ``setup_telemetry`` ran, even without a
collector, so trace ids still flow through NATS headers and gRPC metadata
and can be logged; only the export needs an OTLP endpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phalanx.common.config import TelemetryConfig

__all__ = [
    "extract_context",
    "get_tracer",
    "grpc_client_interceptors",
    "grpc_server_interceptors",
    "inject_headers",
    "setup_telemetry",
    "shutdown_telemetry",
]

log = logging.getLogger(__name__)

# NATS headers use this propagator directly rather than the global one, so a
# process that never called setup_telemetry still speaks the same format.
_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])

# An export's time limit, and what a stop waits for the last spans' flush before it leaves them.
_EXPORT_TIMEOUT_S = 3
_SHUTDOWN_WAIT_S = 2.0

_lock = threading.Lock()
_provider: TracerProvider | None = None
_shut_down = False


class _StreamDetachNoise(logging.Filter):
    """Drops opentelemetry-python-contrib#2357: its aio server interceptor keeps a span
    current across a stream's yields, so a stream the client cancels is finalised in
    another Context and OTel logs a harmless "Failed to detach context" at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Failed to detach context"


def setup_telemetry(service_name: str, config: TelemetryConfig) -> None:
    """Install the process-wide tracer provider; later calls are no-ops.

    OpenTelemetry allows one global provider per process, so the first
    caller's service name wins (several services in one test process share it).
    """
    global _provider
    with _lock:
        if _provider is not None:
            return
        provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        if config.otlp_endpoint:
            # Imported lazily: the exporter pulls in its own gRPC channel machinery.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # Bounded: a collector that does not answer costs an export at most this, never a slow stop.
            timeout_s = _EXPORT_TIMEOUT_S
            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=config.otlp_insecure, timeout=timeout_s)
            provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=timeout_s * 1000))
        logging.getLogger("opentelemetry.context").addFilter(_StreamDetachNoise())
        trace.set_tracer_provider(provider)
        propagate.set_global_textmap(_PROPAGATOR)
        _provider = provider
        log.debug("telemetry for %s, export to %s", service_name, config.otlp_endpoint or "nowhere")


def shutdown_telemetry() -> None:
    """Flush and stop the exporter, waiting at most ``_SHUTDOWN_WAIT_S``; idempotent. Spans after this are dropped.

    A collector that is gone must not hold a stopping service past its grace period: the flush goes on in a
    daemon thread, and what it has not sent by then is lost with the process.
    """
    global _shut_down
    with _lock:
        provider, already = _provider, _shut_down
        _shut_down = True
    if provider is not None and not already:
        # The global provider cannot be replaced, so it stays installed, shut down.
        flush = threading.Thread(target=provider.shutdown, name="telemetry-shutdown", daemon=True)
        flush.start()
        flush.join(_SHUTDOWN_WAIT_S)
        if flush.is_alive():
            log.warning("trace export did not finish within %.0f s at shutdown; its last spans are dropped", _SHUTDOWN_WAIT_S)


def get_tracer(name: str) -> trace.Tracer:
    """A tracer from the global provider (a no-op one before ``setup_telemetry``)."""
    return trace.get_tracer(name)


def grpc_server_interceptors() -> list:
    """Interceptors for ``grpc.aio.server(interceptors=...)``: a server span per RPC, except grpc.health's Watch.

    The interceptor breaks Watch (a coroutine that writes, not an async
    generator), which the health service keeps open to every worker.
    """
    return [aio_server_interceptor(filter_=filters.negate(filters.full_method_name("/grpc.health.v1.Health/Watch")))]


def grpc_client_interceptors() -> list:
    """Interceptors for ``grpc.aio.insecure_channel(..., interceptors=...)``, all four call kinds."""
    return list(aio_client_interceptors())


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current trace context (``traceparent``, ``tracestate``, ``baggage``) to headers."""
    carrier: dict[str, str] = {} if headers is None else headers
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by message headers (an empty context when there is none)."""
    return _PROPAGATOR.extract(dict(headers) if headers else {})
