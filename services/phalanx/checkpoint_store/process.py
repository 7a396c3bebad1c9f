"""The checkpoint store's lifecycle, in one place.

Start: gRPC NOT_SERVING -> tensor-channel endpoint (its rendezvous lives in
etcd) -> advertise ``CHECKPOINT_STORES_PREFIX + store_id`` under a lease ->
SERVING; meanwhile a loop drops requests past their retention.
Stop (SIGTERM): NOT_SERVING -> stop gRPC (open worker streams end after the
grace) -> revoke the advertisement -> close the channel endpoint -> delete
the spilled KV.

The store uses no NATS: workers reach it over gRPC and find it in etcd, and
it has nothing to publish, so a NATS connection would only add a way to fail.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import torch

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, migration_pb2, migration_pb2_grpc
from phalanx.checkpoint_store.config import CheckpointStoreConfig
from phalanx.checkpoint_store.metrics import CheckpointMetrics
from phalanx.checkpoint_store.registration import store_registration
from phalanx.checkpoint_store.server import CheckpointStoreServicer
from phalanx.checkpoint_store.store import CheckpointStore
from phalanx.common.channels import ChannelEndpoint
from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import CHECKPOINT_STORES_PREFIX, validate_worker_id

log = logging.getLogger(__name__)
SERVICE_NAME = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name
KV_SOURCE_NAME = migration_pb2.DESCRIPTOR.services_by_name["KvSource"].full_name
# Longest pause between retention sweeps (shorter when the retention is).
_MAX_SWEEP_INTERVAL_S = 10.0


def checkpoint_store_key(store_id: str) -> str:
    """etcd key of a store's advertisement: ``/phalanx/v1/checkpoint-stores/<store_id>``."""
    return CHECKPOINT_STORES_PREFIX + validate_worker_id(store_id)


class CheckpointStoreProcess:
    def __init__(self, config: CheckpointStoreConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.etcd_config = etcd
        self.telemetry_config = telemetry
        hostname = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
        self.store_id = validate_worker_id(config.store_id or f"ckpt-{hostname}-{os.getpid()}")
        self.channel_endpoint_id = f"ckpt-{self.store_id}"
        self.metrics = CheckpointMetrics()
        limit = config.max_message_bytes
        self.shell = ServiceShell(
            "phalanx-checkpoint-store", config, telemetry, registry=self.metrics.registry, shutdown_grace_s=config.shutdown_grace_s,
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        self.health = self.shell.health
        self.ready = self.shell.ready
        # Made by the store at its first spill, deleted at exit.
        self.spill_dir = Path(config.spill_dir or tempfile.gettempdir()) / f"phalanx-ckpt-{self.store_id}-{os.getpid()}"
        self.store = CheckpointStore(self.spill_dir, memory_limit_bytes=config.memory_limit_bytes, retention_s=config.retention_s,
                                     spill_retry_s=config.spill_retry_s)
        self.servicer = CheckpointStoreServicer(self.store, self.metrics, channel_timeout_s=config.channel_timeout_s)

    @property
    def address(self) -> str:
        return self.shell.address

    @property
    def metrics_address(self) -> str:
        return self.shell.metrics_address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        if self.config.nice:
            os.nice(self.config.nice)
        torch.set_num_threads(self.config.torch_threads)
        async with self.shell as shell:
            shell.add_service(SERVICE_NAME, checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server, self.servicer)
            shell.add_service(KV_SOURCE_NAME, migration_pb2_grpc.add_KvSourceServicer_to_server, self.servicer)
            await shell.start()
            shutil.rmtree(self.spill_dir, ignore_errors=True)  # a leftover of a process that had our id and pid
            shell.callback(self._delete_store)
            # Kept channels: one per worker it restored into lately (see ChannelEndpoint.keep).
            endpoint = ChannelEndpoint(
                self.channel_endpoint_id, self.etcd_config, host=shell.advertised_host, timeout_s=self.config.channel_timeout_s,
                max_idle_channels=64,
            )
            shell.push_async_callback(self._close_endpoint, endpoint)
            await endpoint.start()
            self.servicer.channel_endpoint = endpoint
            registration = store_registration(
                self.store_id, address=self.address, channel_endpoint=self.channel_endpoint_id, metrics_address=self.metrics_address
            )
            await shell.register(self.etcd_config, checkpoint_store_key(self.store_id), encode_json(registration))
            await shell.set_serving(True)
            log.info("checkpoint store %s on %s (channel endpoint %s, metrics %s, spill %s)",
                     self.store_id, self.address, self.channel_endpoint_id, self.metrics_address, self.spill_dir)
            async with asyncio.TaskGroup() as tasks:
                sweeping = tasks.create_task(self._expire_forever())
                await shell.wait_for_stop()
                await shell.stop_server()
                sweeping.cancel()

    async def _close_endpoint(self, endpoint: ChannelEndpoint) -> None:
        self.servicer.channel_endpoint = None
        try:
            await endpoint.close()
        except Exception:
            log.exception("closing the channel endpoint %s failed", self.channel_endpoint_id)

    def _delete_store(self) -> None:
        self.store.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    async def _expire_forever(self) -> None:
        interval = min(self.config.retention_s / 4, _MAX_SWEEP_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            expired = self.store.expire()
            if expired:
                log.info("dropped %d requests idle for over %.0f s: %s", len(expired), self.config.retention_s, expired[:10])
                self.metrics.observe_store(self.store)
