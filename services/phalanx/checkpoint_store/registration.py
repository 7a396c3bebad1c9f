"""The checkpoint store's etcd advertisement: where workers stream their KV to and migration restores it from."""

from __future__ import annotations

import os
import time

from phalanx._proto import checkpoint_pb2


def store_registration(store_id: str, *, address: str, channel_endpoint: str, metrics_address: str) -> checkpoint_pb2.CheckpointStoreRegistration:
    """This process's advertisement (read back with ``phalanx.common.discovery.CheckpointStoreDirectory``)."""
    return checkpoint_pb2.CheckpointStoreRegistration(
        store_id=store_id, address=address, channel_endpoint=channel_endpoint, metrics_address=metrics_address,
        pid=os.getpid(), started_at=time.time(),
    )
