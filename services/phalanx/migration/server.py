"""gRPC shell of the migration service."""

from __future__ import annotations

from phalanx._proto import migration_pb2_grpc
from phalanx.migration.core import Migrator


class MigrationServicer(migration_pb2_grpc.MigrationServiceServicer):
    def __init__(self, migrator: Migrator) -> None:
        self.migrator = migrator

    async def Migrate(self, request, context):
        return await self.migrator.migrate(request)

    async def MigrateWorker(self, request, context):
        self.migrator.metrics.worker_triggers.labels(trigger="rpc").inc()
        return await self.migrator.migrate_worker(request.worker_id, request.reason or "requested")
