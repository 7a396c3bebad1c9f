"""gRPC shell of the migration service."""

from __future__ import annotations

from phalanx._proto import migration_pb2_grpc
from phalanx.common.errors import PhalanxError
from phalanx.common.grpc_status import abort_with
from phalanx.migration.core import Migrator


class MigrationServicer(migration_pb2_grpc.MigrationServiceServicer):
    def __init__(self, migrator: Migrator) -> None:
        self.migrator = migrator

    async def Migrate(self, request, context):
        try:
            return await self.migrator.migrate(request)
        except PhalanxError as exc:
            await abort_with(context, exc)

    async def MigrateWorker(self, request, context):
        try:
            self.migrator.metrics.worker_triggers.labels(trigger="rpc").inc()
            return await self.migrator.migrate_worker(request.worker_id, request.reason or "requested")
        except PhalanxError as exc:
            await abort_with(context, exc)
