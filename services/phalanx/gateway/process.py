"""The gateway's lifecycle, in one place.

Start: telemetry -> the HTTP socket bound (``address`` known) -> uvicorn
serving the app -> ``ready``. The routers are not called before a request
needs them: the SDK connects on its own and retries while none answers.
Stop (``request_stop``, SIGTERM through ``run_until_signalled``): /health
answers 503, the socket stops accepting, requests in flight get
``shutdown_grace_s`` to finish (then are cancelled, and their router
requests with them), the SDK channels close, telemetry flushes.

The service shell (phalanx.common.service) is the gRPC services' lifecycle;
this one shares its pieces (telemetry, Prometheus registry, signal handling)
but serves HTTP, so it writes its own short order here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import socket
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager

import uvicorn

from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.telemetry import setup_telemetry, shutdown_telemetry
from phalanx.gateway.config import GatewayConfig
from phalanx.gateway.metrics import GatewayMetrics
from phalanx.gateway.response_routes import ResponsesApi, add_response_routes, tenant_client
from phalanx.gateway.response_runs import ResponseRunner
from phalanx.gateway.response_store import ResponseStore
from phalanx.gateway.server import GatewayServer, RouterClients, build_app

__all__ = ["GatewayProcess"]

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers (the process's request_stop owns SIGTERM) and with a started event."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = asyncio.Event()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.started_event.set()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


class GatewayProcess:
    def __init__(self, config: GatewayConfig, telemetry: TelemetryConfig, etcd: EtcdConfig | None = None) -> None:
        self.config = config
        self.telemetry_config = telemetry
        self.etcd_config = etcd or EtcdConfig()
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:12]}"
        self.metrics = GatewayMetrics()
        self.ready = asyncio.Event()
        self.address = ""
        self._stop = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def request_stop(self) -> None:
        """Ask ``run()`` to shut down; safe to call any time, more than once."""
        self._stop.set()

    def _runner(self, gateway: GatewayServer) -> ResponseRunner:
        c = self.config
        return ResponseRunner(
            ResponseStore(self.etcd_config, self.gateway_id, ttl_s=c.response_ttl_s), functools.partial(tenant_client, gateway),
            flush_interval_s=c.response_flush_interval_s, poll_interval_s=c.response_poll_interval_s,
            adopt_interval_s=c.response_adopt_interval_s,
        )

    async def run(self) -> None:
        setup_telemetry("phalanx-gateway", self.telemetry_config)
        async with AsyncExitStack() as stack:
            stack.callback(shutdown_telemetry)
            clients = RouterClients(self.config)
            stack.push_async_callback(clients.close)
            self.metrics.count_wrong_peers(clients.wrong_peers)
            gateway = GatewayServer(self.config, clients, self.metrics)
            app = build_app(gateway)
            if self.config.responses_api:
                runner = self._runner(gateway)
                # Closed before the SDK clients (the stack unwinds in reverse): its relays detach, their requests run on.
                stack.push_async_callback(runner.close)
                adopting = asyncio.create_task(runner.adopt_forever(), name="responses-adopt")
                stack.push_async_callback(_cancelled, adopting)
                add_response_routes(app, ResponsesApi(gateway, runner))
            sock = _listen(self.config.host, self.config.port)
            stack.callback(sock.close)
            host, port = sock.getsockname()[:2]
            self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            server = _Server(uvicorn.Config(
                app, lifespan="off", log_config=None, access_log=False,
                timeout_graceful_shutdown=math.ceil(self.config.shutdown_grace_s),
            ))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            started = asyncio.create_task(server.started_event.wait())
            stopped = asyncio.create_task(self._stop.wait())
            try:
                await asyncio.wait({serving, started}, return_when=asyncio.FIRST_COMPLETED)
                if started.done():
                    self.ready.set()
                    log.info("gateway serving on %s for routers %s", self.url, self.config.router)
                    await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
                gateway.stopping = True
                server.should_exit = True
                await serving
            finally:
                for task in (serving, started, stopped):
                    task.cancel()


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
