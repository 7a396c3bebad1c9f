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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from phalanx._proto import common_pb2, migration_pb2, migration_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.events import check_load_report
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import HEALTH_EVENTS_ALL, LOAD_ALL, MIGRATIONS_PREFIX, validate_worker_id
from phalanx.migration.config import MigrationConfig
from phalanx.migration.core import Migrator
from phalanx.migration.metrics import MigrationMetrics
from phalanx.migration.rebalancer import Rebalancer
from phalanx.migration.registration import migration_registration
from phalanx.migration.server import MigrationServicer
from phalanx.migration.triggers import DeadWorker, TriggerMemory

if TYPE_CHECKING:
    from opentelemetry.context import Context

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
        self.shell = ServiceShell("phalanx-migration", config, telemetry, registry=self.metrics.registry)
        self.health = self.shell.health
        self.ready = self.shell.ready
        self._triggered = TriggerMemory()
        self._migrations: set[asyncio.Task[None]] = set()  # whole-worker migrations the health events started

    @property
    def address(self) -> str:
        return self.shell.address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        async with self.shell as shell:
            # The servicer needs the Migrator, which needs NATS: connected before the server starts.
            bus = await shell.connect_nats(self.nats_config, name=f"migration-{self.instance_id}")
            migrator = Migrator(self.config, self.etcd_config, bus, self.metrics)
            shell.push_async_callback(migrator.close)
            shell.push_async_callback(self._cancel_migrations)
            shell.add_service(SERVICE_NAME, migration_pb2_grpc.add_MigrationServiceServicer_to_server, MigrationServicer(migrator))
            await shell.start()
            registration = migration_registration(self.instance_id, address=self.address, strategy=self.config.strategy)
            await shell.register(self.etcd_config, MIGRATIONS_PREFIX + self.instance_id, encode_json(registration))
            loads = await bus.subscribe(LOAD_ALL, common_pb2.LoadReport, migrator.on_load, check=check_load_report)
            shell.push_async_callback(loads.unsubscribe)
            if self.config.rebalance:
                rebalancer = Rebalancer(self.config, self.etcd_config, self.metrics, self.instance_id, lambda: migrator.loads)
                await rebalancer.start()
                shell.push_async_callback(rebalancer.close)
                migrator.placement = rebalancer
            if self.config.trigger_on_dead:
                deaths = await bus.subscribe(HEALTH_EVENTS_ALL, common_pb2.WorkerHealthRecord, self._on_health(migrator))
                shell.push_async_callback(deaths.unsubscribe)
            await shell.set_serving(True)
            log.info("migration %s on %s (strategy %s)", self.instance_id, self.address, self.config.strategy)
            async with asyncio.TaskGroup() as tasks:
                following = tasks.create_task(migrator.follow())
                await shell.wait_for_stop()
                await shell.stop_server()
                following.cancel()

    def _on_health(self, migrator: Migrator) -> Callable[[common_pb2.WorkerHealthRecord, str, Context], Awaitable[None]]:
        async def on_record(record: common_pb2.WorkerHealthRecord, subject: str, context: Context) -> None:
            if record.health != common_pb2.WORKER_HEALTH_DEAD:
                return
            worker = DeadWorker(record.worker_id, record.worker_started_at)
            if not self._triggered.claim(worker):
                return
            self.metrics.worker_triggers.labels(trigger="dead").inc()
            # In the background: NATS handlers run one at a time, and a second death must not wait for the first.
            task = asyncio.create_task(self._migrate_worker(migrator, worker), name=f"migrate dead {record.worker_id}")
            self._migrations.add(task)
            task.add_done_callback(self._migrations.discard)

        return on_record

    async def _migrate_worker(self, migrator: Migrator, worker: DeadWorker) -> None:
        try:
            result = await migrator.migrate_worker(worker.worker_id, "dead")
            if result.migrated or result.failed or result.left_to_router:
                log.warning(
                    "worker %s died: %d requests migrated, %d failed, %d with media left to their routers", worker.worker_id,
                    len(result.migrated), len(result.failed), len(result.left_to_router),
                )
        except Exception:
            log.exception("migrating the requests of %s failed", worker.worker_id)
        finally:
            self._triggered.finished(worker)

    async def _cancel_migrations(self) -> None:
        """At exit, before the Migrator closes: what a death started and has not finished stops here."""
        tasks = list(self._migrations)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
