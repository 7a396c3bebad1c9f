"""The health service's lifecycle, in one place.

Start: gRPC NOT_SERVING -> connect NATS and etcd -> SERVING (a standby
answers ListWorkerHealth from etcd) -> campaign for the leadership key ->
when elected, monitor the fleet until deposed, then campaign again.
Stop (SIGTERM): NOT_SERVING -> stop monitoring -> revoke the leadership
lease so a standby takes over at once -> stop gRPC -> close NATS and etcd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from phalanx._proto import common_pb2, health_pb2 as phalanx_health_pb2, health_pb2_grpc as phalanx_health_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.events import EventBus
from phalanx.common.leadership import LeaderElection, lead_forever
from phalanx.common.lease import connect_etcd
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import HEALTH_LEADER_KEY, validate_worker_id
from phalanx.health.config import DegradationConfig, HealthConfig
from phalanx.health.metrics import HealthMetrics
from phalanx.health.monitor import FleetMonitor
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
        self.shell = ServiceShell("phalanx-health", config, telemetry, registry=self.metrics.registry)
        self.health = self.shell.health
        self.ready = self.shell.ready
        self.election = LeaderElection(etcd, HEALTH_LEADER_KEY, ttl_s=config.leader_ttl_s)
        self.monitor: FleetMonitor | None = None

    @property
    def address(self) -> str:
        return self.shell.address

    @property
    def metrics_address(self) -> str:
        return self.shell.metrics_address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        async with self.shell as shell:
            client = connect_etcd(self.etcd_config)
            shell.push_async_callback(client.close)
            # Before serving: a standby answers ListWorkerHealth through it.
            self.election.attach(client)
            shell.add_service(SERVICE_NAME, phalanx_health_pb2_grpc.add_HealthServiceServicer_to_server, HealthServicer(self))
            await shell.start()
            bus = await shell.connect_nats(self.nats_config, name=f"health-{self.instance_id}")
            shell.push_async_callback(self._resign)
            await shell.set_serving(True)
            log.info("health instance %s on %s (metrics %s)", self.instance_id, self.address, self.metrics_address)
            async with asyncio.TaskGroup() as tasks:
                leading = tasks.create_task(self._lead_forever(bus))
                await shell.wait_for_stop()
                await shell.stop_serving()
                leading.cancel()  # it resigns: a standby takes over at once, before our gRPC stops
            await shell.stop_server()

    async def _resign(self) -> None:
        try:
            await self.election.resign()
        except Exception:
            log.exception("resigning the leadership failed; the key lapses after its TTL")

    async def _lead_forever(self, bus: EventBus) -> None:
        await lead_forever(self.election, f"health instance {self.instance_id}", self._leader_value, lambda: self._monitor(bus))

    def _leader_value(self) -> bytes:
        return encode_json(common_pb2.HealthLeader(instance_id=self.instance_id, address=self.address, pid=os.getpid(), elected_at=time.time()))

    async def _monitor(self, bus: EventBus) -> None:
        """One leadership term: monitor the fleet until deposed."""
        self.metrics.leader.set(1)
        self.monitor = FleetMonitor(self.config, self.degradation_config, self.etcd_config, self.election, bus, self.metrics)
        try:
            await self.monitor.run()
        finally:
            self.monitor = None
            self.metrics.leader.set(0)
