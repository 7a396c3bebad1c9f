"""The health service's lifecycle, in one place.

Start: gRPC NOT_SERVING -> connect NATS and etcd -> SERVING (a standby
answers ListWorkerHealth from etcd) -> campaign for the leadership key ->
when elected, monitor the fleet until deposed, then campaign again.
Stop (SIGTERM): NOT_SERVING -> stop monitoring -> revoke the leadership
lease so a standby takes over at once -> stop gRPC -> close NATS and etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from phalanx._proto import common_pb2, health_pb2 as phalanx_health_pb2, health_pb2_grpc as phalanx_health_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.events import EventBus
from phalanx.common.lease import Backoff, connect_etcd
from phalanx.common.subjects import HEALTH_LEADER_KEY, validate_worker_id
from phalanx.common.telemetry import grpc_server_interceptors, setup_telemetry, shutdown_telemetry
from phalanx.health.config import DegradationConfig, HealthConfig
from phalanx.health.leader import LeaderElection
from phalanx.health.metrics import HealthMetrics
from phalanx.health.monitor import FleetMonitor, LeadershipLostError
from phalanx.health.server import HealthServicer

log = logging.getLogger(__name__)
SERVICE_NAME = phalanx_health_pb2.DESCRIPTOR.services_by_name["HealthService"].full_name


class HealthProcess:
    def __init__(
        self, config: HealthConfig, degradation: DegradationConfig, nats: NatsConfig, etcd: EtcdConfig, telemetry: TelemetryConfig
    ) -> None:
        self.config = config
        self.degradation_config = degradation
        self.nats_config = nats
        self.etcd_config = etcd
        self.telemetry_config = telemetry
        self.instance_id = validate_worker_id(config.instance_id or f"health-{socket.gethostname()}-{os.getpid()}")
        self.metrics = HealthMetrics()
        self.health = health.aio.HealthServicer()
        self.election = LeaderElection(etcd, HEALTH_LEADER_KEY, ttl_s=config.leader_ttl_s)
        self.monitor: FleetMonitor | None = None
        self.address = ""
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        setup_telemetry("phalanx-health", self.telemetry_config)
        server = grpc.aio.server(interceptors=grpc_server_interceptors(), options=[("grpc.so_reuseport", 0)])
        await self._set_serving(False)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        phalanx_health_pb2_grpc.add_HealthServiceServicer_to_server(HealthServicer(self), server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        self.address = f"{self.config.advertise_host or self.config.host}:{port}"
        await server.start()
        metrics_server, metrics_thread = start_http_server(self.config.metrics_port, self.config.host, registry=self.metrics.registry)
        self.metrics_address = f"{self.config.advertise_host or self.config.host}:{metrics_server.server_port}"
        client = connect_etcd(self.etcd_config)
        bus = None
        try:
            bus = await EventBus.connect(self.nats_config, name=f"health-{self.instance_id}")
            self.election.attach(client)
            await self._set_serving(True)
            self.ready.set()
            log.info("health instance %s on %s (metrics %s)", self.instance_id, self.address, self.metrics_address)
            async with asyncio.TaskGroup() as tasks:
                leading = tasks.create_task(self._lead_forever(bus))
                await self._stop.wait()
                await self.health.enter_graceful_shutdown()
                leading.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self.election.resign()
            await server.stop(1.0)
            if bus is not None:
                await bus.close()
            await client.close()
            metrics_server.shutdown()
            metrics_thread.join(timeout=2)
            shutdown_telemetry()

    async def _lead_forever(self, bus: EventBus) -> None:
        backoff = Backoff(initial=0.2, cap=5.0)
        while True:
            leader = common_pb2.HealthLeader(instance_id=self.instance_id, address=self.address, pid=os.getpid(), elected_at=time.time())
            await self.election.campaign(encode_json(leader))
            log.info("health instance %s leads", self.instance_id)
            self.metrics.leader.set(1)
            self.monitor = FleetMonitor(self.config, self.degradation_config, self.etcd_config, self.election, bus, self.metrics)
            try:
                await self.monitor.run()
            except* LeadershipLostError as lost:
                log.warning("health instance %s lost the leadership: %s", self.instance_id, lost.exceptions[0])
            except* Exception:
                log.exception("monitoring failed; stepping down")
                await asyncio.sleep(backoff.next())
            else:
                backoff.reset()
            finally:
                self.monitor = None
                self.metrics.leader.set(0)
                with contextlib.suppress(Exception):
                    await self.election.resign()

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
