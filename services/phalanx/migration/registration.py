"""The migration service's etcd advertisement: where routers call it."""

from __future__ import annotations

import os

from phalanx._proto import migration_pb2


def migration_registration(instance_id: str, *, address: str, strategy: str) -> migration_pb2.MigrationRegistration:
    """This process's advertisement (read back with ``phalanx.common.discovery.MigrationDirectory``)."""
    return migration_pb2.MigrationRegistration(instance_id=instance_id, address=address, pid=os.getpid(), strategy=strategy)
