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
import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, migration_pb2, migration_pb2_grpc
from phalanx.checkpoint_store.config import CheckpointStoreConfig
from phalanx.checkpoint_store.metrics import CheckpointMetrics
from phalanx.checkpoint_store.registration import store_registration
from phalanx.checkpoint_store.server import CheckpointStoreServicer
from phalanx.checkpoint_store.store import CheckpointStore
from phalanx.common.channels import ChannelEndpoint
from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.lease import LeasedKey
from phalanx.common.subjects import CHECKPOINT_STORES_PREFIX, validate_worker_id
from phalanx.common.telemetry import grpc_server_interceptors, setup_telemetry, shutdown_telemetry

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
        self.health = health.aio.HealthServicer()
        # Made by the store at its first spill, deleted at exit.
        self.spill_dir = Path(config.spill_dir or tempfile.gettempdir()) / f"phalanx-ckpt-{self.store_id}-{os.getpid()}"
        self.store = CheckpointStore(self.spill_dir, memory_limit_bytes=config.memory_limit_bytes, retention_s=config.retention_s)
        self.servicer = CheckpointStoreServicer(self.store, self.metrics, channel_timeout_s=config.channel_timeout_s)
        self.address = ""
        self.metrics_address = ""
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        setup_telemetry("phalanx-checkpoint-store", self.telemetry_config)
        if self.config.nice:
            os.nice(self.config.nice)
        torch.set_num_threads(self.config.torch_threads)
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            interceptors=grpc_server_interceptors(),
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit), ("grpc.so_reuseport", 0)],
        )
        await self._set_serving(False)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server(self.servicer, server)
        migration_pb2_grpc.add_KvSourceServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection([SERVICE_NAME, KV_SOURCE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        host = self.config.advertise_host or self.config.host
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        self.address = f"{host}:{port}"
        await server.start()
        shutil.rmtree(self.spill_dir, ignore_errors=True)  # a leftover of a process that had our id and pid
        metrics_server, metrics_thread = start_http_server(self.config.metrics_port, self.config.host, registry=self.metrics.registry)
        self.metrics_address = f"{host}:{metrics_server.server_port}"
        endpoint = advertisement = None
        try:
            # Kept channels: one per worker it restored into lately (see ChannelEndpoint.keep).
            endpoint = ChannelEndpoint(
                self.channel_endpoint_id, self.etcd_config, host=host, timeout_s=self.config.channel_timeout_s, max_idle_channels=64
            )
            await endpoint.start()
            self.servicer.channel_endpoint = endpoint
            registration = store_registration(
                self.store_id, address=self.address, channel_endpoint=self.channel_endpoint_id, metrics_address=self.metrics_address
            )
            advertisement = LeasedKey(self.etcd_config, checkpoint_store_key(self.store_id), encode_json(registration))
            await advertisement.start()
            await self._set_serving(True)
            self.ready.set()
            log.info("checkpoint store %s on %s (channel endpoint %s, metrics %s, spill %s)",
                     self.store_id, self.address, self.channel_endpoint_id, self.metrics_address, self.spill_dir)  # fmt: skip
            async with asyncio.TaskGroup() as tasks:
                sweeping = tasks.create_task(self._expire_forever())
                await self._stop.wait()
                await self.health.enter_graceful_shutdown()
                await server.stop(self.config.shutdown_grace_s)
                sweeping.cancel()
        finally:
            await server.stop(0)
            if advertisement is not None:
                await advertisement.close(revoke=True)
            self.servicer.channel_endpoint = None
            if endpoint is not None:
                with contextlib.suppress(Exception):
                    await endpoint.close()
            self.store.close()
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            metrics_server.shutdown()
            metrics_thread.join(timeout=2)
            shutdown_telemetry()

    async def _expire_forever(self) -> None:
        interval = min(self.config.retention_s / 4, _MAX_SWEEP_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            expired = self.store.expire()
            if expired:
                log.info("dropped %d requests idle for over %.0f s: %s", len(expired), self.config.retention_s, expired[:10])
                self.metrics.observe_store(self.store)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, KV_SOURCE_NAME):
            await self.health.set(name, status)
