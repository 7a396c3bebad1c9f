"""The worker's lifecycle, in one place.

Start: health NOT_SERVING -> connect NATS and etcd -> load the model ->
engine -> register in etcd -> SERVING. Stop (SIGTERM or Drain): NOT_SERVING
-> drain the engine (finish or hand back) -> stop gRPC -> revoke the lease
-> close NATS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import encode_registration
from phalanx.common.events import EventBus
from phalanx.common.lease import LeasedKey
from phalanx.common.subjects import kv_events_subject, load_subject, validate_worker_id, worker_key
from phalanx.common.telemetry import get_tracer, grpc_server_interceptors, setup_telemetry, shutdown_telemetry
from phalanx.model import load
from phalanx.model.kv_cache import BLOCK_SIZE, KvEvents
from phalanx.worker.async_engine import AsyncEngine
from phalanx.worker.config import EngineConfig, WorkerConfig
from phalanx.worker.engine import Engine
from phalanx.worker.metrics import WorkerMetrics
from phalanx.worker.server import WorkerServicer, drain_engine

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
# Stored hashes per KV event message: ~30 bytes each keeps messages far below NATS's 1 MiB.
_MAX_BLOCKS_PER_EVENT = 8192


class WorkerProcess:
    def __init__(
        self,
        worker: WorkerConfig,
        engine: EngineConfig,
        nats: NatsConfig,
        etcd: EtcdConfig,
        telemetry: TelemetryConfig,
    ) -> None:
        self.config = worker
        self.engine_config = engine
        self.nats_config = nats
        self.etcd_config = etcd
        self.telemetry_config = telemetry
        self.worker_id = validate_worker_id(worker.worker_id or f"{socket.gethostname()}-{os.getpid()}")
        self.metrics = WorkerMetrics(self.worker_id)
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._drained: tuple[int, int] | None = None
        self._kv_outbox: asyncio.Queue[KvEvents] = asyncio.Queue()
        self.kv_sequence = 0  # KV event messages published so far

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        setup_telemetry("phalanx-worker", self.telemetry_config)
        server = grpc.aio.server(
            interceptors=grpc_server_interceptors(),
            options=[
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.so_reuseport", 0),
                # Routers ping every 10 s on open streams to notice a dead worker; the default would GOAWAY them.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ],
        )
        await self._set_serving(False)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        c = self.config
        servicer = WorkerServicer(
            self.worker_id, self.metrics, on_drain=self._drain, kv_sequence=lambda: self.kv_sequence,
            detach_grace_s=c.detach_grace_s, retain_s=c.retain_s, max_retained=c.max_retained,
        )
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        self.address = f"{self.config.advertise_host or self.config.host}:{port}"
        await server.start()
        metrics_server, metrics_thread = start_http_server(self.config.metrics_port, self.config.host, registry=self.metrics.registry)
        bus = registration = engine = None
        try:
            bus = await EventBus.connect(self.nats_config, name=f"worker-{self.worker_id}")
            if self.engine_config.device == "cpu":
                torch.set_num_threads(self.engine_config.effective_torch_threads())
            with get_tracer(__name__).start_as_current_span("worker.load_model"):
                model = await asyncio.to_thread(
                    load, self.engine_config.model, device=self.engine_config.device,
                    dtype=self.engine_config.torch_dtype(), seed=self.engine_config.seed,
                )
                engine = AsyncEngine(Engine(model, self.engine_config), on_kv_events=self._kv_outbox.put_nowait)
            await engine.start()
            servicer.attach(engine)
            registration = LeasedKey(self.etcd_config, worker_key(self.worker_id), self._registration(model, metrics_server.server_port))
            await registration.start()
            await self._set_serving(True)
            self.metrics.for_worker(self.metrics.status).set(1)
            self.ready.set()
            log.info("worker %s serving %s on %s", self.worker_id, model.config.name, self.address)
            async with asyncio.TaskGroup() as tasks:
                publishers = [
                    tasks.create_task(self._publish_kv_events(bus)),
                    tasks.create_task(self._publish_load(bus, engine)),
                ]
                await self._wait_for_stop(engine)
                await self._shutdown(server, engine)
                for task in publishers:
                    task.cancel()
        finally:
            if engine is not None:
                await engine.stop()
            servicer.close()  # no detach timer outlives the loop; readers still waiting see ABORTED
            await server.stop(0)
            if registration is not None:
                await registration.close(revoke=True)
            if bus is not None:
                await bus.close()
            metrics_server.shutdown()
            metrics_thread.join(timeout=2)
            shutdown_telemetry()

    async def _wait_for_stop(self, engine: AsyncEngine) -> None:
        while not self._stop.is_set():
            if engine.dead is not None:
                log.error("engine died; worker exits so that its lease lapses and it is replaced")
                return
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=0.5)
            except TimeoutError:
                pass

    async def _shutdown(self, server: grpc.aio.Server, engine: AsyncEngine) -> None:
        self.metrics.for_worker(self.metrics.status).set(0.5)
        await self.health.enter_graceful_shutdown()
        if self._drained is None:
            await self._drain(engine, self.config.drain_grace_s)
        # Streams already ended (finished or handed back); this only lets their last bytes flush.
        await server.stop(grace=1.0)
        self.metrics.for_worker(self.metrics.status).set(0)

    async def _drain(self, engine: AsyncEngine, grace_s: float) -> tuple[int, int]:
        if self._drained is None:
            await self._set_serving(False)
            self._drained = await drain_engine(engine, grace_s)
            log.info("drained: %d finished, %d handed back", *self._drained)
            self._stop.set()
        return self._drained

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _registration(self, model, metrics_port: int) -> bytes:
        return encode_registration(
            common_pb2.WorkerRegistration(
                worker_id=self.worker_id, address=self.address, pid=os.getpid(), model=model.config.name,
                role="monolithic", block_size=BLOCK_SIZE, total_blocks=self.engine_config.num_kv_blocks,
                metrics_address=f"{self.config.advertise_host or self.config.host}:{metrics_port}",
                started_at=time.time(), max_model_len=self.engine_config.max_model_len,
            )
        )

    async def _publish_kv_events(self, bus: EventBus) -> None:
        subject = kv_events_subject(self.worker_id)
        while True:
            events = await self._kv_outbox.get()
            stored, removed = events.stored, events.removed
            first = True
            # Split so that no message nears NATS's 1 MiB payload limit.
            while first or stored or removed:
                message = common_pb2.KvEvent(
                    worker_id=self.worker_id, sequence=self.kv_sequence + 1, cleared=events.cleared and first, timestamp=time.time()
                )
                message.removed.extend(removed[:_MAX_BLOCKS_PER_EVENT])
                message.stored.extend(
                    common_pb2.KvBlockStored(block_hash=h, parent_hash=p, num_tokens=n) for h, p, n in stored[:_MAX_BLOCKS_PER_EVENT]
                )
                stored, removed = stored[_MAX_BLOCKS_PER_EVENT:], removed[_MAX_BLOCKS_PER_EVENT:]
                first = False
                self.kv_sequence += 1
                await bus.publish(subject, message)

    async def _publish_load(self, bus: EventBus, engine: AsyncEngine) -> None:
        subject = load_subject(self.worker_id)
        m = self.metrics
        while True:
            load = engine.load()
            await bus.publish(
                subject,
                common_pb2.LoadReport(
                    worker_id=self.worker_id, queue_depth=load.queue_depth, running_seqs=load.running_seqs,
                    free_blocks=load.free_blocks, total_blocks=load.total_blocks, step_time_ms=load.step_time_ms,
                    prefill_tokens_per_s=load.prefill_tokens_per_s, decode_tokens_per_s=load.decode_tokens_per_s,
                    timestamp=time.time(), draining=engine.draining,
                ),
            )
            m.for_worker(m.step_time).set(load.step_time_ms / 1e3)
            m.for_worker(m.running).set(load.running_seqs)
            m.for_worker(m.waiting).set(load.queue_depth)
            m.for_worker(m.free_blocks).set(load.free_blocks)
            m.for_worker(m.preemptions).set(engine.engine.preemptions)
            await asyncio.sleep(self.config.load_interval_s)
