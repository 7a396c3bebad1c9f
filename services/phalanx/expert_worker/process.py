"""An expert worker (EW): hosts a set of (layer, expert) MLPs and computes them for attention workers.

Start: gRPC NOT_SERVING -> load the model, keep the experts this worker's
placement slot names (`ert.place`), free the rest -> tensor-channel
endpoint -> advertise `/phalanx/v1/expert-workers/<id>` (with the experts
it hosts) under a lease -> SERVING. Stop (SIGTERM): NOT_SERVING -> stop
gRPC -> revoke the advertisement (the ERT manager drops it at once) ->
close every channel.

An AW calls `Connect` on the control path; the EW accepts the AW's tensor
channel and serves it on a task of its own: receive a layer's rows, compute,
send the outputs back. Calls of different AWs for the same layer that
arrive together are computed as one batch per expert (`expert_batcher`:
a call waits at most `batch_window_s` for the other AWs, and never for one
whose channel closed or that has been silent for `attention_silence_s`), so
a dead or silent AW stalls nobody. Stateless: anything an AW sent can be
replayed here or on another EW.
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
from phalanx.common.errors import InvalidRequestError, UnavailableError
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import expert_worker_key, validate_worker_id
from phalanx.ert_manager.table import place
from phalanx.expert_worker.batcher import Batch, BatchPolicy, LayerBatcher
from phalanx.expert_worker.config import ExpertWorkerConfig
from phalanx.expert_worker.wire import ExpertCall, header_len
from phalanx.model import load
from phalanx.model.expert_split import ExpertHost, MissingExpertError

log = logging.getLogger(__name__)
SERVICE_NAME = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name
# An AW may idle for hours between steps; its death ends the wait sooner (the channel closes).
_IDLE_TIMEOUT_S = timedelta(days=1).total_seconds()
_COMPUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_AW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


class ExpertWorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.calls = Counter("phalanx_expert_calls", "Layer calls computed (one per AW, layer and step)", registry=r)
        self.rows = Counter("phalanx_expert_rows", "Token rows computed, per expert", ["layer", "expert"], registry=r)
        self.compute_seconds = Histogram(
            "phalanx_expert_compute_seconds", "Compute time of one layer batch (one AW's call, or several AWs' batched)", buckets=_COMPUTE_BUCKETS,
            registry=r,
        )
        self.batches = Counter(
            "phalanx_expert_batches",
            "Cross-AW layer batches by what started them: all_delivered, min_rows, or window (a wait that timed out)",
            ["start"],
            registry=r,
        )
        self.batch_rows = Histogram("phalanx_expert_batch_rows", "Rows of one cross-AW layer batch", buckets=_ROW_BUCKETS, registry=r)
        self.batch_attention_workers = Histogram(
            "phalanx_expert_batch_attention_workers", "AWs whose calls one layer batch computes", buckets=_AW_BUCKETS, registry=r
        )
        self.batch_wait_seconds = Histogram(
            "phalanx_expert_batch_wait_seconds", "From a batch's first call to its start", buckets=_WAIT_BUCKETS, registry=r
        )
        self.attention_workers = Gauge("phalanx_expert_attention_workers", "AWs with an open channel here", registry=r)
        self.hosted = Gauge("phalanx_expert_hosted", "Experts hosted here, by role", ["role"], registry=r)


@dataclass(frozen=True)
class _Loaded:
    host: ExpertHost
    hidden_size: int
    num_experts: int
    dtype: torch.dtype
    device: torch.device

    def compute(self, layer: int, call: ExpertCall, activations: torch.Tensor, invariant: bool) -> torch.Tensor:
        """One call's outputs [rows, hidden] on the host: the channel moves host memory, the experts may sit on a GPU."""
        return torch.cat(self.host.compute(layer, call.batches(activations.to(self.device)), invariant)).cpu()


@dataclass(frozen=True)
class _Call:
    """One AW's layer call, received and waiting in a cross-AW batch."""

    call: ExpertCall
    activations: torch.Tensor
    outputs: asyncio.Future[torch.Tensor]


class _CrossAwBatches:
    """The I/O shell of `LayerBatcher`: feeds it the AWs' calls and the clock, computes the batches it starts (off the
    loop) and hands each AW its outputs; each AW's task sends its own reply, so an AW that stopped reading holds up
    nobody else's."""

    def __init__(self, policy: BatchPolicy, loaded: _Loaded, metrics: ExpertWorkerMetrics) -> None:
        self.batcher: LayerBatcher[_Call] = LayerBatcher(policy)
        self.loaded = loaded
        self.metrics = metrics
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()

    def connect(self, aw: str) -> None:
        self.batcher.connect(aw)

    def disconnect(self, aw: str) -> None:
        self._start(self.batcher.disconnect(aw, asyncio.get_running_loop().time()))

    async def compute(self, aw: str, call: ExpertCall, activations: torch.Tensor) -> torch.Tensor:
        """The outputs of `call` [rows, hidden], computed in the batch it lands in; raises MissingExpertError."""
        loop = asyncio.get_running_loop()
        item = _Call(call, activations, loop.create_future())
        self._start(self.batcher.deliver(aw, (call.layer, call.invariant), item, call.rows, loop.time()))
        return await item.outputs

    def _on_timer(self) -> None:
        self._timer = None
        self._start(self.batcher.expire(asyncio.get_running_loop().time()))

    def _start(self, batches: list[Batch[_Call]]) -> None:
        loop = asyncio.get_running_loop()
        for batch in batches:
            assert batch.started_by is not None
            self.metrics.batches.labels(start=batch.started_by.value).inc()
            self.metrics.batch_rows.observe(batch.rows)
            self.metrics.batch_attention_workers.observe(len(batch.entries))
            self.metrics.batch_wait_seconds.observe(loop.time() - batch.opened_at)
            task = asyncio.create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        # One timer, at the earliest open batch's deadline.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.batcher.next_deadline()
        if deadline is not None:
            self._timer = loop.call_at(deadline, self._on_timer)

    async def _run(self, batch: Batch[_Call]) -> None:
        items = [item for _, item in batch.entries]
        try:
            results = await asyncio.to_thread(self._compute, batch.key[0], batch.key[1], items)
        except Exception as failure:  # noqa: BLE001 - handed to every caller of the batch, which re-raises it
            results = [failure] * len(items)
        for item, result in zip(items, results, strict=True):
            if item.outputs.done():  # its AW's task was cancelled (shutdown)
                continue
            if isinstance(result, BaseException):
                item.outputs.set_exception(result)
            else:
                item.outputs.set_result(result)

    def _compute(self, layer: int, invariant: bool, items: list[_Call]) -> list[torch.Tensor | BaseException]:
        loaded = self.loaded
        start = time.perf_counter()
        calls = [item.call.batches(item.activations.to(loaded.device)) for item in items]
        results: list[torch.Tensor | BaseException] = []
        try:
            results = [torch.cat(out).cpu() for out in loaded.host.compute_merged(layer, calls, invariant)]
        except MissingExpertError:
            # Some AW's table is wrong about us: only its call fails, the others' are computed alone.
            for item in items:
                try:
                    results.append(loaded.compute(layer, item.call, item.activations, invariant))
                except MissingExpertError as error:
                    results.append(error)
        self.metrics.compute_seconds.observe(time.perf_counter() - start)
        return results

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, worker_id: str, metrics: ExpertWorkerMetrics, timeout_s: float) -> None:
        self.worker_id = worker_id
        self.metrics = metrics
        self.timeout_s = timeout_s
        # Set with `loaded` when batch_window_s > 0; None: every call is computed on arrival, alone.
        self.batches: _CrossAwBatches | None = None
        # Both set once the experts are loaded and the endpoint started (before the worker registers).
        self.loaded: _Loaded | None = None
        self.endpoint: ChannelEndpoint | None = None
        self.serving: set[asyncio.Task[None]] = set()

    async def Connect(self, request: expert_pb2.ConnectRequest, context) -> expert_pb2.ConnectResponse:
        if self.endpoint is None or self.loaded is None:
            raise UnavailableError(f"expert worker {self.worker_id} is still starting")
        try:
            validate_worker_id(request.attention_worker_id)
        except ValueError as error:
            raise InvalidRequestError("attention_worker_id", str(error)) from None
        ours = str(self.loaded.dtype).removeprefix("torch.")
        if request.dtype and request.dtype != ours:
            # Same-sized dtypes (bfloat16, float16) would pass the channel and compute garbage.
            raise InvalidRequestError(
                "dtype", f"attention worker {request.attention_worker_id} sends {request.dtype}, expert worker {self.worker_id} computes"
                f" in {ours}: run both in one dtype (PHALANX_ENGINE_DTYPE, PHALANX_EXPERT_DTYPE)",
            )
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
            if self.batches is None:
                await self._serve(channel)
            else:
                await self._serve_batched(channel, self.batches)
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

    async def _serve_batched(self, channel: TensorChannel, batches: _CrossAwBatches) -> None:
        loaded = batches.loaded
        header = torch.empty(header_len(loaded.num_experts), dtype=torch.int64)
        # Keyed by channel, not AW id: an AW that reconnects is a new participant, its old channel a closed one.
        aw = channel.channel_id
        batches.connect(aw)
        try:
            while True:
                await channel.recv_into(header, timeout_s=_IDLE_TIMEOUT_S)
                call = ExpertCall.parse(header)
                activations = torch.empty((call.rows, loaded.hidden_size), dtype=loaded.dtype)
                await channel.recv_into(activations, timeout_s=self.timeout_s)
                try:
                    outputs = await batches.compute(aw, call, activations)
                except MissingExpertError as error:
                    log.error("%s; closing the channel", error)
                    return
                await channel.send(outputs, timeout_s=self.timeout_s)
                self.metrics.calls.inc()
                for expert, count in zip(call.experts, call.counts, strict=True):
                    self.metrics.rows.labels(layer=str(call.layer), expert=str(expert)).inc(count)
        finally:
            batches.disconnect(aw)

    def _compute(self, channel: TensorChannel, loaded: _Loaded, call: ExpertCall) -> None:
        activations = torch.empty((call.rows, loaded.hidden_size), dtype=loaded.dtype)
        channel.post_exchange([], [activations]).wait(self.timeout_s)
        start = time.perf_counter()
        outputs = loaded.compute(call.layer, call, activations, call.invariant)
        self.metrics.compute_seconds.observe(time.perf_counter() - start)
        channel.post_exchange([outputs], []).wait(self.timeout_s)


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
            servicer.loaded = loaded = _Loaded(host, model_config.hidden_size, model_config.num_experts, dtype, torch.device(c.device))
            if c.batch_window_s > 0:
                policy = BatchPolicy(c.batch_window_s, c.batch_min_rows, c.attention_silence_s, model_config.num_layers)
                servicer.batches = _CrossAwBatches(policy, loaded, self.metrics)
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
            log.info(
                "expert worker %s hosts %d experts of %s (%s, %s) on %s", self.worker_id, len(hosted), model_config.name, c.device,
                loaded.dtype, self.address,
            )
            await shell.wait_for_stop()
            await shell.stop_server()

    def _load(self):
        c = self.config
        # Loaded on the host, in the engines' dtype: only this worker's experts go to its device.
        model = load(c.model, seed=c.seed, dtype=c.torch_dtype())
        mc = model.config
        if not mc.is_moe:
            raise ValueError(f"{mc.name} is dense: an expert worker needs a mixture-of-experts model")
        hosted = place(mc.num_layers, mc.num_experts, c.num_expert_workers, c.copies, replicas=c.replicas)[c.index]
        host = ExpertHost.from_model(model, [h.key for h in hosted], device=c.device)
        for role in ("PRIMARY", "SHADOW", "REPLICA"):
            self.metrics.hosted.labels(role=role.lower()).set(sum(1 for h in hosted if h.role.name == role))
        return hosted, host, mc, model.version, model.dtype

    async def _close(self, endpoint: ChannelEndpoint) -> None:
        if self.servicer is not None:
            for task in list(self.servicer.serving):
                task.cancel()
            if self.servicer.batches is not None:
                self.servicer.batches.close()
        await endpoint.close()
