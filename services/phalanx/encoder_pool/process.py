"""An encoder's lifecycle, in one place.

Start: gRPC NOT_SERVING -> load the encoders (seconds for a real tower) ->
advertise ``ENCODERS_PREFIX + encoder_id`` under a lease -> SERVING; then
the batch loop, and a loop that refreshes the advertised backlog (only when
it changed) so joint routing sees it. Stop (SIGTERM): NOT_SERVING -> stop
gRPC (in-flight encodes get the grace) -> revoke the advertisement.

No NATS: routers find encoders in etcd and call them over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time

import torch

from phalanx._proto import encoder_pb2, encoder_pb2_grpc
from phalanx.common.channels import ChannelEndpoint
from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.lease import EtcdUnavailableError, LeasedKey
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import ENCODERS_PREFIX, validate_worker_id
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.encoder_pool.metrics import EncoderMetrics
from phalanx.encoder_pool.pool import EncodePool
from phalanx.encoder_pool.server import EncoderServicer, encoder_load, modality_to_proto

__all__ = ["SERVICE_NAME", "EncoderPoolProcess", "encoder_key"]

log = logging.getLogger(__name__)
SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


def encoder_key(encoder_id: str) -> str:
    """etcd key of an encoder's advertisement: ``/phalanx/v1/encoders/<encoder_id>``."""
    return ENCODERS_PREFIX + validate_worker_id(encoder_id)


class EncoderPoolProcess:
    def __init__(self, config: EncoderPoolConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.etcd_config = etcd
        hostname = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
        self.encoder_id = validate_worker_id(config.encoder_id or f"encoder-{hostname}-{os.getpid()}")
        self.metrics = EncoderMetrics()
        self.shell = ServiceShell(
            "phalanx-encoder", config, telemetry, registry=self.metrics.registry, shutdown_grace_s=config.shutdown_grace_s,
            # Media ride in one message each way (a video in, its frames' embeddings out).
            options=[("grpc.max_receive_message_length", config.max_item_bytes * 4 + (1 << 20)),
                     ("grpc.max_send_message_length", 256 << 20)],
        )
        self.ready = self.shell.ready
        self.started_at = time.time()
        self.pool: EncodePool | None = None
        self.servicer: EncoderServicer | None = None

    @property
    def address(self) -> str:
        return self.shell.address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        torch.set_num_threads(self.config.torch_threads)
        async with self.shell as shell:
            pool = self.pool = await asyncio.to_thread(EncodePool, self.config, on_batch=self.metrics.observe_batch)
            channels = None
            if self.config.channels:
                # Direct delivery: workers take held embeddings over a tensor channel (peers find it in etcd).
                channels = ChannelEndpoint(
                    f"encoder-{self.encoder_id}", self.etcd_config, host=shell.advertised_host, timeout_s=self.config.channel_timeout_s
                )
                shell.push_async_callback(channels.close)
            servicer = self.servicer = EncoderServicer(pool, self.metrics, self.encoder_id, channels=channels)
            shell.add_service(SERVICE_NAME, encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer)
            await shell.start()
            if channels is not None:
                await channels.start()
            self.metrics.observe_load(pool.admission)
            registration = await shell.register(self.etcd_config, encoder_key(self.encoder_id), self._registration(pool))
            await shell.set_serving(True)
            log.info("encoder %s on %s serving %s (metrics %s)", self.encoder_id, self.address,
                     [m.value for m in pool.modalities], shell.metrics_address)
            async with asyncio.TaskGroup() as tasks:
                batching = tasks.create_task(pool.run())
                publishing = tasks.create_task(self._publish_load_forever(pool, registration))
                await shell.wait_for_stop()
                await shell.stop_server()
                publishing.cancel()
                batching.cancel()

    def _registration(self, pool: EncodePool) -> bytes:
        return encode_json(encoder_pb2.EncoderRegistration(
            encoder_id=self.encoder_id, address=self.address, metrics_address=self.shell.metrics_address, pid=os.getpid(),
            started_at=self.started_at, modalities=[modality_to_proto(m) for m in pool.modalities],
            llm_hidden_size=self.config.llm_hidden_size, embedding_dtype=self.config.embedding_dtype,
            image_positions=pool.image.tokens_per_image if pool.image else 0, audio_chunk_positions=pool.audio_chunk_positions,
            load=encoder_load(pool, self.servicer.delivery if self.servicer is not None else None),
        ))

    async def _publish_load_forever(self, pool: EncodePool, registration: LeasedKey) -> None:
        while True:
            await asyncio.sleep(self.config.load_publish_interval_s)
            self.metrics.observe_load(pool.admission)
            if self.servicer is not None:
                self.servicer.observe_held()  # held embeddings expire even when no one asks for them
            value = self._registration(pool)
            if value != registration.value:
                try:
                    await registration.update(value)
                except EtcdUnavailableError as error:  # the value is kept and written at re-registration
                    log.warning("could not refresh the encoder's registration: %s", error)
