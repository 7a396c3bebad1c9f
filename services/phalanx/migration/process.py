"""The migration service's lifecycle.

Start: connect NATS and etcd -> gRPC SERVING -> advertise the address in
etcd (leased, so routers find a live instance) -> follow health events
(a DEAD worker's requests move at once). Stop (SIGTERM): NOT_SERVING ->
stop gRPC (in-flight migrations get a second) -> revoke the lease -> close.
Several instances may run: each call is answered by the one the caller
reached, and a request's concurrent calls meet on one instance only, so
health-triggered migration runs on every instance but the router's call
is what moves a request (the other instance's attempt finds it running).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from phalanx._proto import common_pb2, migration_pb2, migration_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.events import EventBus
from phalanx.common.lease import LeasedKey
from phalanx.common.subjects import HEALTH_EVENTS_ALL, LOAD_ALL, MIGRATIONS_PREFIX, validate_worker_id
from phalanx.common.telemetry import grpc_server_interceptors, setup_telemetry, shutdown_telemetry
from phalanx.migration.config import MigrationConfig
from phalanx.migration.core import Migrator
from phalanx.migration.metrics import MigrationMetrics
from phalanx.migration.registration import migration_registration
from phalanx.migration.server import MigrationServicer

log = logging.getLogger(__name__)
SERVICE_NAME = migration_pb2.DESCRIPTOR.services_by_name["MigrationService"].full_name


class MigrationProcess:
    def __init__(self, config: MigrationConfig, nats: NatsConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.nats_config = nats
        self.etcd_config = etcd
        self.telemetry_config = telemetry
        self.instance_id = validate_worker_id(config.migration_id or f"migration-{socket.gethostname()}-{os.getpid()}")
        self.metrics = MigrationMetrics()
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._triggered: set[tuple[str, float]] = set()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        setup_telemetry("phalanx-migration", self.telemetry_config)
        server = grpc.aio.server(interceptors=grpc_server_interceptors(), options=[("grpc.so_reuseport", 0)])
        await self._set_serving(False)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        self.address = f"{self.config.advertise_host or self.config.host}:{port}"
        metrics_server, metrics_thread = start_http_server(self.config.metrics_port, self.config.host, registry=self.metrics.registry)
        bus = migrator = advertisement = subscription = loads = None
        try:
            bus = await EventBus.connect(self.nats_config, name=f"migration-{self.instance_id}")
            migrator = Migrator(self.config, self.etcd_config, bus, self.metrics)
            migration_pb2_grpc.add_MigrationServiceServicer_to_server(MigrationServicer(migrator), server)
            reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
            await server.start()
            advertisement = LeasedKey(
                self.etcd_config, MIGRATIONS_PREFIX + self.instance_id,
                encode_json(migration_registration(self.instance_id, address=self.address, strategy=self.config.strategy)),
            )
            await advertisement.start()
            loads = await bus.subscribe(LOAD_ALL, common_pb2.LoadReport, migrator.on_load)
            if self.config.trigger_on_dead:
                subscription = await bus.subscribe(HEALTH_EVENTS_ALL, common_pb2.WorkerHealthRecord, self._on_health(migrator))
            await self._set_serving(True)
            self.ready.set()
            log.info("migration %s on %s (strategy %s)", self.instance_id, self.address, self.config.strategy)
            await self._stop.wait()
            await self.health.enter_graceful_shutdown()
        finally:
            for sub in (subscription, loads):
                if sub is not None:
                    await sub.unsubscribe()
            await server.stop(1.0)
            if advertisement is not None:
                await advertisement.close(revoke=True)
            if migrator is not None:
                await migrator.close()
            if bus is not None:
                await bus.close()
            metrics_server.shutdown()
            metrics_thread.join(timeout=2)
            shutdown_telemetry()

    def _on_health(self, migrator: Migrator):
        async def on_record(record: common_pb2.WorkerHealthRecord, subject: str, context) -> None:
            if record.health != common_pb2.WORKER_HEALTH_DEAD:
                return
            key = (record.worker_id, record.worker_started_at)
            if key in self._triggered:
                return
            self._triggered.add(key)
            self.metrics.worker_triggers.labels(trigger="dead").inc()
            # In the background: NATS handlers run one at a time, and a second death must not wait for the first.
            asyncio.ensure_future(self._migrate_worker(migrator, record.worker_id))

        return on_record

    async def _migrate_worker(self, migrator: Migrator, worker_id: str) -> None:
        try:
            result = await migrator.migrate_worker(worker_id, "dead")
            if result.migrated or result.failed:
                log.warning("worker %s died: %d requests migrated, %d failed", worker_id, len(result.migrated), len(result.failed))
        except Exception:
            log.exception("migrating the requests of %s failed", worker_id)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
