"""gRPC shell of the migration service."""

from __future__ import annotations

import grpc

from phalanx._proto import migration_pb2, migration_pb2_grpc
from phalanx.migration.core import Migrator


class MigrationServicer(migration_pb2_grpc.MigrationServiceServicer):
    def __init__(self, migrator: Migrator) -> None:
        self.migrator = migrator

    async def Migrate(self, request: migration_pb2.MigrateRequest, context: grpc.aio.ServicerContext) -> migration_pb2.MigrateResponse:
        return await self.migrator.migrate(request)

    async def MigrateWorker(
        self, request: migration_pb2.MigrateWorkerRequest, context: grpc.aio.ServicerContext
    ) -> migration_pb2.MigrateWorkerResponse:
        self.migrator.metrics.worker_triggers.labels(trigger="rpc").inc()
        return await self.migrator.migrate_worker(request.worker_id, request.reason or "requested")
