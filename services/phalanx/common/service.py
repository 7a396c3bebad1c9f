"""One lifecycle for every Phalanx service, written once: ``ServiceShell``.

Start (in this order):
``async with shell`` -> telemetry -> gRPC server created and bound (``address``
known) -> the service adds its servicers -> ``start()``: every service
NOT_SERVING, reflection, server started, Prometheus /metrics -> the service
connects NATS and etcd, loads, registers (pushing each undo onto the shell)
-> ``set_serving(True)``: SERVING and ``ready`` (the first time, in a process of its own,
startup's heap is frozen: ``gc.freeze``, see ``run_until_signalled``).

Stop: ``request_stop()`` (SIGTERM, see ``run_until_signalled``) wakes
``wait_for_stop()`` -> ``stop_server()``: NOT_SERVING for good, then
``server.stop(grace)`` -> leaving the ``async with``: ``server.stop(0)`` (in
case the service left early), the pushed undos in reverse order (revoke the
etcd lease, drain NATS, ...), the metrics server, telemetry.

Every RPC runs under the telemetry interceptor, ``DomainErrorInterceptor``
(handlers raise ``PhalanxError`` and never abort by hand) and, with mutual TLS
on (``PHALANX_TLS_DIR``, see ``phalanx.common.tls``), ``AuthorizationInterceptor``:
the server then accepts only peers with a certificate of the Phalanx CA and
each RPC only from the identities ``phalanx.common.authz.POLICY`` allows.

A new service writes only its own wiring. This one has no RPC of its own
(its interface is etcd and /metrics, like the planner's); one with RPCs adds
each servicer before ``start()``, as the migration service does with
``shell.add_service(SERVICE_NAME, migration_pb2_grpc.add_MigrationServiceServicer_to_server, servicer)``.
NATS and etcd come from ``PHALANX_NATS_URL`` and ``PHALANX_ETCD_ENDPOINT``
(tests/integration/test_docstring_examples.py runs this example):

>>> import asyncio
>>> from dataclasses import dataclass
>>> import grpc
>>> from grpc_health.v1 import health_pb2, health_pb2_grpc
>>> from prometheus_client import CollectorRegistry
>>> from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
>>> from phalanx.common.service import ServiceShell
>>> @dataclass(frozen=True)
... class EchoConfig:  # a ListenConfig; a real service's pydantic settings have these fields
...     host: str = "127.0.0.1"
...     port: int = 0
...     advertise_host: str = ""
...     metrics_port: int = 0
>>> class EchoProcess:
...     def __init__(self, config: EchoConfig, nats: NatsConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
...         self.nats, self.etcd = nats, etcd
...         self.shell = ServiceShell("phalanx-echo", config, telemetry, registry=CollectorRegistry(), mtls=False)
...         self.ready, self.request_stop = self.shell.ready, self.shell.request_stop
...
...     async def run(self) -> None:
...         async with self.shell as shell:
...             await shell.start()  # NOT_SERVING, the gRPC server and /metrics up
...             bus = await shell.connect_nats(self.nats, name="echo-0")  # subscribe and publish on it; drained at exit
...             await shell.register(self.etcd, "/phalanx/v1/echo/echo-0", shell.address.encode())  # lease revoked at exit
...             await shell.set_serving(True)  # SERVING, and ``ready`` set
...             await shell.wait_for_stop()  # request_stop(): SIGTERM under run_until_signalled
...             await shell.stop_server()
>>> async def serve_and_stop() -> str:
...     process = EchoProcess(EchoConfig(), NatsConfig(), EtcdConfig(), TelemetryConfig())
...     running = asyncio.create_task(process.run())
...     await asyncio.wait_for(process.ready.wait(), timeout=30)
...     async with grpc.aio.insecure_channel(process.shell.address) as channel:
...         check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
...     process.request_stop()
...     await running
...     return health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
>>> asyncio.run(serve_and_stop())
'SERVING'

``config`` is any settings object with ``host``, ``port``, ``advertise_host``
and ``metrics_port`` (``ListenConfig``); the CLI runs the process with
``run_until_signalled(process)``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar
from wsgiref.simple_server import make_server

import grpc
from grpc_health.v1 import health as grpc_health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

from phalanx.common.authz import AuthorizationInterceptor
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.events import EventBus
from phalanx.common.grpc_status import DomainErrorInterceptor
from phalanx.common.lease import LeasedKey
from phalanx.common.telemetry import grpc_server_interceptors, setup_telemetry, shutdown_telemetry
from phalanx.common.tls import ServiceTls, process_tls, warn_plaintext

__all__ = ["ListenConfig", "Runnable", "ServerTls", "ServiceShell", "run_until_signalled"]

log = logging.getLogger(__name__)

S = TypeVar("S")
T = TypeVar("T")

# A restarted service must not share its port with a predecessor still shutting down.
_BASE_OPTIONS: tuple[tuple[str, Any], ...] = (("grpc.so_reuseport", 0),)
_METRICS_JOIN_TIMEOUT_S = 2.0
_METRICS_POLL_S = 0.05
# Probe paths a service with ``probes`` answers on its metrics port (Kubernetes startup, liveness, readiness).
PROBE_PATHS = ("/startup", "/live", "/ready")


class ListenConfig(Protocol):
    """Where a service listens: the fields every service config has."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def advertise_host(self) -> str: ...

    @property
    def metrics_port(self) -> int: ...


@dataclass(frozen=True)
class ServerTls:
    """PEM files of a TLS-only gRPC port that asks no client certificate (a public router behind its own auth).

    Mutual TLS (``PHALANX_TLS_DIR``), when set, takes its place.
    """

    cert_file: str
    key_file: str

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())])


@dataclass(frozen=True)
class _Service:
    name: str
    in_health: bool


class Runnable(Protocol):
    """What ``run_until_signalled`` runs: a service process."""

    def request_stop(self) -> None: ...

    async def run(self) -> None: ...


class ServiceShell:
    """The gRPC server, grpc health and reflection, /metrics, telemetry and the ordered teardown of one service.

    Made in the process's constructor (no event loop needed), entered in its
    ``run()``. See the module docstring for the order and an example.
    """

    def __init__(
        self, name: str, listen: ListenConfig, telemetry: TelemetryConfig, *, registry: CollectorRegistry,
        options: Sequence[tuple[str, Any]] = (), tls: ServerTls | None = None, shutdown_grace_s: float = 1.0,
        probes: Callable[[str], int] | None = None, mtls: ServiceTls | None | bool = True,
    ) -> None:
        """``probes``: the HTTP status of probe "startup", "live" or "ready", served at /startup, /live, /ready beside /metrics.

        ``mtls``: True for the process's mutual TLS (``phalanx.common.tls.process_tls()``, from ``PHALANX_TLS_*``), a
        ServiceTls for that one, None or False for none.
        """
        self.name = name
        self._listen = listen
        self._telemetry = telemetry
        self._registry = registry
        self._options = [*_BASE_OPTIONS, *options]
        self._tls = tls
        self._mtls = process_tls() if mtls is True else (mtls or None)
        self._probes = probes
        self.shutdown_grace_s = shutdown_grace_s
        self.health = grpc_health.aio.HealthServicer()
        self.ready = asyncio.Event()
        self.address = ""
        self.metrics_address = ""
        self._stop = asyncio.Event()
        self._services: list[_Service] = []
        self._server: grpc.aio.Server | None = None
        self._started = False
        self._heap_frozen = False
        # Two stacks: what the service pushes is undone before the metrics server and telemetry, whenever it pushed it.
        self._stack = AsyncExitStack()
        self._own = AsyncExitStack()

    # -- stop requests -------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask ``run()`` to shut down (SIGTERM, a finished drain); safe to call any time, more than once."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    # -- start ---------------------------------------------------------------------------
    @property
    def advertised_host(self) -> str:
        """The host others reach this service at."""
        return self._listen.advertise_host or self._listen.host

    @property
    def server(self) -> grpc.aio.Server:
        """The gRPC server, for services that register handlers of their own (e.g. a channel endpoint)."""
        if self._server is None:
            raise RuntimeError(f"{self.name}: the shell is not entered yet")
        return self._server

    async def __aenter__(self) -> ServiceShell:
        setup_telemetry(self.name, self._telemetry)
        self._own.callback(shutdown_telemetry)
        try:
            # Authorization runs inside the error mapping, so that a denial is a PermissionDeniedError like any other.
            interceptors = [*grpc_server_interceptors(), DomainErrorInterceptor(), AuthorizationInterceptor(enforce=self._mtls is not None)]
            server = self._server = grpc.aio.server(interceptors=interceptors, options=self._options)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            address = f"{self._listen.host}:{self._listen.port}"
            if self._mtls is not None:
                port = server.add_secure_port(address, self._mtls.server_credentials())
            elif self._tls is not None:
                port = server.add_secure_port(address, self._tls.credentials())
            else:
                warn_plaintext(self.name)
                port = server.add_insecure_port(address)
            self.address = f"{self.advertised_host}:{port}"
        except BaseException:
            await self._own.aclose()
            raise
        return self

    def add_service(self, name: str, add_to_server: Callable[[S, grpc.aio.Server], None], servicer: S, *, health: bool = True) -> None:
        """Serve `servicer` (before ``start()``): ``add_to_server`` is the generated ``add_…Servicer_to_server``.

        `name` (the full service name) is listed by reflection and, with
        ``health``, answers grpc.health checks with the shell's serving state.
        """
        if self._started:
            raise RuntimeError(f"{self.name}: add services before start()")
        add_to_server(servicer, self.server)
        self._services.append(_Service(name, health))

    async def start(self) -> None:
        """NOT_SERVING, reflection, the gRPC server and the Prometheus /metrics server up."""
        server = self.server
        await self.set_serving(False)
        reflection.enable_server_reflection([*(s.name for s in self._services), grpc_health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        self._started = True
        await server.start()
        # prometheus_client's start_http_server, with the probes beside /metrics.
        class Server(ThreadingWSGIServer):
            pass

        Server.address_family, host = _get_best_family(self._listen.host, self._listen.metrics_port)
        metrics_server = make_server(
            host, self._listen.metrics_port, _http_app(self._registry, self._probes), Server, handler_class=_SilentHandler
        )
        # shutdown() waits for serve_forever's next poll: at its default 0.5 s that was most of a stopping worker's exit.
        metrics_thread = threading.Thread(
            target=metrics_server.serve_forever, kwargs={"poll_interval": _METRICS_POLL_S}, name=f"{self.name}-metrics", daemon=True
        )
        metrics_thread.start()
        self.metrics_address = f"{self.advertised_host}:{metrics_server.server_port}"

        def stop_metrics() -> None:
            metrics_server.shutdown()
            metrics_server.server_close()
            metrics_thread.join(timeout=_METRICS_JOIN_TIMEOUT_S)

        self._own.callback(stop_metrics)

    async def set_serving(self, serving: bool) -> None:
        """grpc.health status of the whole server ("") and of each health-checked service; SERVING also sets ``ready``."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *(s.name for s in self._services if s.in_health)):
            await self.health.set(name, status)
        if serving:
            if _freeze_heap_when_serving and not self._heap_frozen:
                # What startup built (imports, the model, the engine, channels) lives as long as the process: out of
                # the cyclic collector with it, so that a full (generation-2) collection traverses only what serving
                # allocates. Unfrozen, such a collection took a worker 0.16 s (median; up to 0.8 s on a loaded box)
                # with the GIL held, and every stream of the worker stalled meanwhile (docs/chaos.md).
                self._heap_frozen = True
                gc.freeze()
            self.ready.set()

    # -- what the service connects and registers; undone in reverse at exit ------------------
    def callback(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Call ``fn(*args, **kwargs)`` at exit, before what was pushed earlier."""
        self._stack.callback(fn, *args, **kwargs)

    def push_async_callback(self, fn: Callable[..., Awaitable[Any]], /, *args: Any, **kwargs: Any) -> None:
        """Await ``fn(*args, **kwargs)`` at exit, before what was pushed earlier."""
        self._stack.push_async_callback(fn, *args, **kwargs)

    async def enter_async_context(self, context: AbstractAsyncContextManager[T]) -> T:
        """Enter `context` now, exit it at exit, before what was pushed earlier."""
        return await self._stack.enter_async_context(context)

    async def connect_nats(self, config: NatsConfig, *, name: str) -> EventBus:
        """An EventBus, drained and closed at exit."""
        bus = await EventBus.connect(config, name=name)
        self._stack.push_async_callback(bus.close)
        return bus

    async def register(self, etcd: EtcdConfig, key: str, value: bytes) -> LeasedKey:
        """Put `key` under a lease kept alive from now on; the lease is revoked at exit (the key goes at once)."""
        registration = LeasedKey(etcd, key, value)
        self._stack.push_async_callback(registration.close, revoke=True)
        await registration.start()
        return registration

    # -- stop ------------------------------------------------------------------------------
    async def stop_serving(self) -> None:
        """NOT_SERVING for good (grpc health ignores later changes); idempotent."""
        await self.health.enter_graceful_shutdown()

    async def stop_server(self, grace_s: float | None = None) -> None:
        """NOT_SERVING for good, then stop the server: RPCs in flight get `grace_s` (default ``shutdown_grace_s``)."""
        await self.stop_serving()
        await self.server.stop(self.shutdown_grace_s if grace_s is None else grace_s)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        async with self._own:
            async with self._stack:
                if self._server is not None:
                    await self._server.stop(0)  # a no-op after stop_server(); cancels what still runs after a failure


def _http_app(registry: CollectorRegistry, probes: Callable[[str], int] | None) -> Callable[..., Any]:
    """/metrics (any path, as prometheus_client serves it), and with ``probes`` the PROBE_PATHS: probes(name) is the status."""
    metrics = make_wsgi_app(registry)
    if probes is None:
        return metrics

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path not in PROBE_PATHS:
            return metrics(environ, start_response)
        status = HTTPStatus(probes(path[1:]))
        start_response(f"{status.value} {status.phrase}", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{status.phrase}\n".encode()]

    return app


# Set by run_until_signalled, where the service owns its interpreter: its first set_serving(True) then freezes the
# heap (gc.freeze). A test that runs shells inside its own process keeps its collector as it is.
_freeze_heap_when_serving = False


def run_until_signalled(process: Runnable) -> None:
    """Run `process` in a fresh event loop until it returns; SIGTERM and SIGINT ask it to stop.

    The process owns the interpreter: the first ``set_serving(True)`` freezes what startup allocated (``gc.freeze``).
    """
    global _freeze_heap_when_serving
    _freeze_heap_when_serving = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, process.request_stop)
        await process.run()

    asyncio.run(main())
