"""The router's way to the migration service: found in etcd (a watched view), called when a worker stream ends early."""

from __future__ import annotations

import logging

import grpc

from phalanx._proto import migration_pb2, migration_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import DirectoryView, MigrationDirectory, addresses_of
from phalanx.common.errors import MEDIA_SOURCE_SUBJECT, FailedPreconditionError, UnavailableError
from phalanx.common.grpc_channels import GrpcChannels
from phalanx.common.lease import TRANSIENT_ERRORS
from phalanx.router.media import media_fetch_failed

log = logging.getLogger(__name__)


class MigrationClient:
    """Calls may run concurrently: one channel per service address, kept for the client's life (never swapped under
    a call in flight), and the address that answered last is tried first."""

    def __init__(self, config: EtcdConfig, *, timeout_s: float = 15.0) -> None:
        self._instances = DirectoryView(MigrationDirectory(config))
        self.timeout_s = timeout_s
        self._preferred = ""
        self._channels = GrpcChannels()

    async def close(self) -> None:
        await self._channels.close()
        await self._instances.close()

    async def follow(self) -> None:
        """Keeps the instances' addresses current (run as a task): a migration then starts without an etcd read."""
        await self._instances.follow()

    async def _addresses(self) -> list[str]:
        try:
            addresses = addresses_of(await self._instances.get())
        except TRANSIENT_ERRORS as exc:
            log.warning("cannot look up the migration service: %r", exc)
            return [self._preferred] if self._preferred else []
        return sorted(addresses, key=lambda a: a != self._preferred)

    def _stub(self, address: str) -> migration_pb2_grpc.MigrationServiceStub:
        return migration_pb2_grpc.MigrationServiceStub(self._channels.get(address))

    async def migrate(self, request: migration_pb2.MigrateRequest) -> migration_pb2.MigrateResponse | None:
        """Where the request runs now; None when no migration service runs (the caller falls back)."""
        addresses = await self._addresses()
        if not addresses:
            return None
        last: grpc.aio.AioRpcError | None = None
        for address in addresses:
            try:
                response = await self._stub(address).Migrate(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                last = error
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    break
                continue
            self._preferred = address
            return response
        assert last is not None
        if media_fetch_failed(last):
            # The target could not fetch the request's media from their encoder: the caller encodes them again.
            raise FailedPreconditionError(f"migration of {request.request_id}: {last.details()}", subject=MEDIA_SOURCE_SUBJECT)
        raise UnavailableError(f"migration of {request.request_id} failed: {last.code().name}: {last.details()}", retry_after_s=0.5)
