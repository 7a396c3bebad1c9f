"""An expert worker (EW): hosts a set of (layer, expert) MLPs and computes them for attention workers.

Start: gRPC NOT_SERVING -> load the model, keep the experts this worker's
placement slot names (`ert.place`), free the rest -> tensor-channel
endpoint -> advertise `/phalanx/v1/expert-workers/<id>` (with the experts
it hosts) under a lease -> SERVING. Stop (SIGTERM): NOT_SERVING -> stop
gRPC -> revoke the advertisement (the ERT manager drops it at once) ->
close every channel.

An AW calls `Connect` on the control path; the EW accepts the AW's tensor
channel and serves it on a task of its own: receive a layer's rows, compute,
send the outputs back. Each AW's channel is served on its own, so a dead or
silent AW stalls nobody (its channel breaks, or it just sends nothing).
Stateless: anything an AW sent can be replayed here or on another EW.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx._proto import expert_pb2, expert_pb2_grpc
from phalanx.common.channels import ChannelEndpoint, ChannelError, TensorChannel
from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.discovery import encode_json
from phalanx.common.errors import UnavailableError
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import expert_worker_key, validate_worker_id
from phalanx.model import load
from phalanx.model.expert_split import ExpertHost, MissingExpertError
from phalanx.worker.ert import place
from phalanx.worker.expert_config import ExpertWorkerConfig
from phalanx.worker.expert_wire import ExpertCall, header_len

log = logging.getLogger(__name__)
SERVICE_NAME = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name
# An AW may idle for hours between steps; its death ends the wait sooner (the channel closes).
_IDLE_TIMEOUT_S = timedelta(days=1).total_seconds()
_COMPUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class ExpertWorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.calls = Counter("phalanx_expert_calls", "Layer calls computed (one per AW, layer and step)", registry=r)
        self.rows = Counter("phalanx_expert_rows", "Token rows computed, per expert", ["layer", "expert"], registry=r)
        self.compute_seconds = Histogram("phalanx_expert_compute_seconds", "Compute time of one layer call", buckets=_COMPUTE_BUCKETS, registry=r)
        self.attention_workers = Gauge("phalanx_expert_attention_workers", "AWs with an open channel here", registry=r)
        self.hosted = Gauge("phalanx_expert_hosted", "Experts hosted here, by role", ["role"], registry=r)


@dataclass(frozen=True)
class _Loaded:
    host: ExpertHost
    hidden_size: int
    num_experts: int
    dtype: torch.dtype


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, worker_id: str, metrics: ExpertWorkerMetrics, timeout_s: float) -> None:
        self.worker_id = worker_id
        self.metrics = metrics
        self.timeout_s = timeout_s
        # Both set once the experts are loaded and the endpoint started (before the worker registers).
        self.loaded: _Loaded | None = None
        self.endpoint: ChannelEndpoint | None = None
        self.serving: set[asyncio.Task[None]] = set()

    async def Connect(self, request: expert_pb2.ConnectRequest, context) -> expert_pb2.ConnectResponse:
        if self.endpoint is None or self.loaded is None:
            raise UnavailableError(f"expert worker {self.worker_id} is still starting")
        validate_worker_id(request.attention_worker_id)
        task = asyncio.create_task(self._accept_and_serve(request.attention_worker_id, request.channel_id))
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)
        return expert_pb2.ConnectResponse(channel_endpoint=self.endpoint.endpoint_id)

    async def Probe(self, request: expert_pb2.ProbeRequest, context) -> expert_pb2.ProbeResponse:
        computed = self.loaded.host.batches_computed if self.loaded is not None else 0
        return expert_pb2.ProbeResponse(worker_id=self.worker_id, batches_computed=computed)

    async def _accept_and_serve(self, aw: str, channel_id: str) -> None:
        assert self.endpoint is not None
        try:
            channel = await self.endpoint.accept(channel_id, timeout_s=self.timeout_s)
        except ChannelError as error:
            log.warning("attention worker %s did not open its channel: %s", aw, error)
            return
        self.metrics.attention_workers.inc()
        try:
            await self._serve(channel)
        except ChannelError as error:
            log.info("channel of attention worker %s ended: %s", aw, error)
        finally:
            self.metrics.attention_workers.dec()
            await channel.close()

    async def _serve(self, channel: TensorChannel) -> None:
        loaded = self.loaded
        assert loaded is not None
        header = torch.empty(header_len(loaded.num_experts), dtype=torch.int64)
        while True:
            await channel.recv_into(header, timeout_s=_IDLE_TIMEOUT_S)
            call = ExpertCall.parse(header)
            # Receive, compute and reply in one hop off the loop (the loop keeps answering probes meanwhile).
            try:
                await asyncio.to_thread(self._compute, channel, loaded, call)
            except MissingExpertError as error:
                # The AW's table is wrong about us: break the channel (it replays elsewhere) rather than answer garbage.
                log.error("%s; closing the channel", error)
                return
            self.metrics.calls.inc()
            for expert, count in zip(call.experts, call.counts, strict=True):
                self.metrics.rows.labels(layer=str(call.layer), expert=str(expert)).inc(count)

    def _compute(self, channel: TensorChannel, loaded: _Loaded, call: ExpertCall) -> None:
        activations = torch.empty((call.rows, loaded.hidden_size), dtype=loaded.dtype)
        channel.post_exchange([], [activations]).wait(self.timeout_s)
        start = time.perf_counter()
        outputs = loaded.host.compute(call.layer, call.batches(activations), call.invariant)
        self.metrics.compute_seconds.observe(time.perf_counter() - start)
        channel.post_exchange([torch.cat(outputs)], []).wait(self.timeout_s)


class ExpertWorkerProcess:
    def __init__(self, config: ExpertWorkerConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.etcd_config = etcd
        hostname = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())
        self.worker_id = validate_worker_id(config.worker_id or f"ew-{hostname}-{os.getpid()}")
        self.metrics = ExpertWorkerMetrics()
        self.shell = ServiceShell("phalanx-expert-worker", config, telemetry, registry=self.metrics.registry)
        self.ready = self.shell.ready
        self.servicer: ExpertServicer | None = None

    @property
    def address(self) -> str:
        return self.shell.address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        c = self.config
        torch.set_num_threads(c.torch_threads)
        servicer = self.servicer = ExpertServicer(self.worker_id, self.metrics, c.channel_timeout_s)
        async with self.shell as shell:
            shell.add_service(SERVICE_NAME, expert_pb2_grpc.add_ExpertServiceServicer_to_server, servicer)
            await shell.start()
            hosted, host, model_config, version, dtype = await asyncio.to_thread(self._load)
            servicer.loaded = _Loaded(host, model_config.hidden_size, model_config.num_experts, dtype)
            endpoint = ChannelEndpoint(f"expert-{self.worker_id}", self.etcd_config, host=shell.advertised_host, timeout_s=c.channel_timeout_s)
            shell.push_async_callback(self._close, endpoint)
            await endpoint.start()
            servicer.endpoint = endpoint
            registration = expert_pb2.ExpertWorkerRegistration(
                worker_id=self.worker_id,
                address=self.address,
                channel_endpoint=endpoint.endpoint_id,
                metrics_address=shell.metrics_address,
                model=model_config.name,
                model_version=version,
                pid=os.getpid(),
                started_at=time.time(),
                hosted=[expert_pb2.HostedExpert(layer=h.layer, expert=h.expert, role=h.role) for h in hosted],
            )
            await shell.register(self.etcd_config, expert_worker_key(self.worker_id), encode_json(registration))
            await shell.set_serving(True)
            log.info("expert worker %s hosts %d experts of %s on %s", self.worker_id, len(hosted), model_config.name, self.address)
            await shell.wait_for_stop()
            await shell.stop_server()

    def _load(self):
        c = self.config
        model = load(c.model, seed=c.seed)
        mc = model.config
        if not mc.is_moe:
            raise ValueError(f"{mc.name} is dense: an expert worker needs a mixture-of-experts model")
        hosted = place(mc.num_layers, mc.num_experts, c.num_expert_workers, c.copies)[c.index]
        host = ExpertHost.from_model(model, [h.key for h in hosted])
        for role in ("PRIMARY", "SHADOW"):
            self.metrics.hosted.labels(role=role.lower()).set(sum(1 for h in hosted if h.role.name == role))
        return hosted, host, mc, model.version, model.dtype

    async def _close(self, endpoint: ChannelEndpoint) -> None:
        if self.servicer is not None:
            for task in list(self.servicer.serving):
                task.cancel()
        await endpoint.close()
