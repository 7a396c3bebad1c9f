"""The forwarding engine of an attention worker (AW): expert calls go to expert workers (EWs) over tensor channels.

`RemoteExperts` is the `ExpertIO` of an AW's split model
(model/expert_split.py). The engine thread calls `compute(layer, batches)`
once per MoE layer of a step; it resolves each expert to an EW in the ERT,
sends every EW all of its rows of that layer in one message (header, then
activations) over the (AW, EW) channel, waits for all replies concurrently
and returns the outputs in order. On open channels the engine thread posts
the gloo ops and waits for them itself (`TensorChannel.post_exchange`): an
asyncio round per tensor would cost a thread hop each. Opening channels,
probes and replays run on the event loop (`compute_async`).

Failure: a channel op that fails (a SIGKILLed EW closes its sockets: tens
of ms) or times out (`expert_timeout_s`: a hung EW) excludes the EW here at
once, before the ERT manager's table says so, and the same activations are
replayed to the next host of each expert (a shadow or replica): experts
are pure functions, so the outputs, and the tokens, are the ones the lost
EW would have given. The replay does not wait for the explicit probe on the
control path (gRPC `Probe`, `expert_probe_timeout_s`), which runs beside
it: a dying process can hold its listening socket a while and let the
probe hang to its deadline. An EW that answers the probe is taken back
(its channel broke, not it) once; a second failure keeps it out.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from contextlib import aclosing

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from phalanx._proto import expert_pb2, expert_pb2_grpc
from phalanx.common.channels import ChannelEndpoint, ChannelError, TensorChannel
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EtcdDirectory
from phalanx.common.errors import UnavailableError
from phalanx.common.subjects import ERT_KEY, MOE_PREFIX
from phalanx.common.telemetry import get_tracer
from phalanx.common.tls import open_channel
from phalanx.ert_manager.table import ExpertRoutingTable
from phalanx.expert_worker.wire import pack
from phalanx.model.expert_split import ExpertBatch

log = logging.getLogger(__name__)
_RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Failures of a live EW's channel (it answers probes) before it counts as dead all the same.
_MAX_CHANNEL_FAILURES = 2
_ERT_NAME = ERT_KEY[len(MOE_PREFIX) :]


class ForwardingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.calls = Counter("phalanx_aw_expert_calls", "Layer calls sent to expert workers", ["expert_worker"], registry=r)
        self.replays = Counter(
            "phalanx_aw_expert_replays", "Expert batches replayed on another EW after a failure of this one", ["expert_worker"], registry=r
        )
        self.probe_failures = Counter("phalanx_aw_expert_probe_failures", "Failed probes of an expert worker", ["expert_worker"], registry=r)
        self.rtt_seconds = Histogram(
            "phalanx_aw_expert_rtt_seconds", "Send-to-reply time of one layer call to one EW", buckets=_RTT_BUCKETS, registry=r
        )
        self.failover_seconds = Histogram(
            "phalanx_aw_expert_failover_seconds",
            "A MoE layer with a failed EW: from its start to every output in (detect + replay)",
            buckets=_RTT_BUCKETS,
            registry=r,
        )
        self.layer_seconds = Histogram(
            "phalanx_aw_expert_layer_seconds",
            "Time of one MoE layer's expert calls (all EWs, replays included)",
            buckets=_RTT_BUCKETS,
            registry=r,
        )


class RemoteExperts:
    """ExpertIO over EWs named in the ERT. `compute` runs on the engine thread; everything else on the event loop."""

    def __init__(
        self,
        worker_id: str,
        endpoint: ChannelEndpoint,
        loop: asyncio.AbstractEventLoop,
        *,
        num_experts: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        timeout_s: float,
        probe_timeout_s: float,
        metrics: ForwardingMetrics,
    ) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.loop = loop
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        # The engine's; the channels move host memory (gloo), so a GPU engine's rows are staged through it.
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.metrics = metrics
        self.table: ExpertRoutingTable | None = None
        # EWs found dead here: excluded until the table drops them.
        self.dead: set[str] = set()
        self.table_changed = asyncio.Event()
        # Recent per-(EW, layer) round trips, seconds (for `phalanx bench moe`).
        self.rtts: deque[float] = deque(maxlen=10_000)
        self._channels: dict[str, TensorChannel] = {}
        self._grpc: dict[str, grpc.aio.Channel] = {}
        self._failures: dict[str, int] = {}
        self._ids = itertools.count()
        self._tracer = get_tracer(__name__)
        self._closing: set[asyncio.Future[None]] = set()  # background closes and probes

    # -- the table ---------------------------------------------------------------------------
    def set_table(self, table: ExpertRoutingTable) -> None:
        if self.table is not None and table.version <= self.table.version:
            return
        self.table = table
        self.dead &= set(table.workers)
        self.table_changed.set()
        log.info("ERT version %d: %d expert workers", table.version, len(table.workers))

    async def follow(self, etcd: EtcdConfig) -> None:
        """Keeps `table` at the newest ERT in etcd (run as a task)."""
        directory = EtcdDirectory(etcd, prefix=MOE_PREFIX, message_type=expert_pb2.ExpertRoutingTable)
        try:
            for name, message in (await directory.list()).items():
                if name == _ERT_NAME:
                    self.set_table(ExpertRoutingTable.from_proto(message))
            async with aclosing(directory.watch()) as events:
                async for _, name, changed in events:
                    if name == _ERT_NAME and changed is not None:
                        self.set_table(ExpertRoutingTable.from_proto(changed))
        finally:
            await directory.close()

    async def wait_complete(self, timeout_s: float) -> ExpertRoutingTable:
        """The table, once every expert has a host; then opens a channel to every EW in it."""
        deadline = time.monotonic() + timeout_s
        while self.table is None or not self.table.complete:
            self.table_changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(f"no complete expert routing table within {timeout_s:g} s (are the expert workers and the ERT manager up?)")
            try:
                await asyncio.wait_for(self.table_changed.wait(), remaining)
            except TimeoutError:
                pass
        table = self.table
        for ew in table.workers:
            try:
                await self._channel(ew)
            except (ChannelError, grpc.aio.AioRpcError) as error:
                log.warning("no channel to expert worker %s yet: %s", ew, error)
        return table

    # -- the engine thread's call --------------------------------------------------------------
    def compute(self, layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        """On the engine thread: every EW's call posted on its open channel at once, then waited for here (no hop through
        the event loop); what fails, or needs a new channel, goes through the event loop (`compute_async`)."""
        with self._tracer.start_as_current_span("moe.expert_calls") as span:
            span.set_attribute("moe.layer", layer)
            span.set_attribute("moe.experts", len(batches))
            return self._compute(layer, batches, invariant, span)

    def _compute(self, layer: int, batches: list[ExpertBatch], invariant: bool, span) -> list[torch.Tensor]:
        start = time.perf_counter()
        table = self.table
        if table is None:
            raise UnavailableError("no expert routing table yet")
        by_ew: dict[str, list[int]] = {}
        for i, batch in enumerate(batches):
            by_ew.setdefault(table.resolve(layer, batch.expert, exclude=self.dead), []).append(i)
        outputs: list[torch.Tensor | None] = [None] * len(batches)
        posted = []
        redo: list[int] = []
        failed: list[tuple[str, ChannelError]] = []
        for ew, indices in by_ew.items():
            channel = self._channels.get(ew)
            if channel is None or channel.broken:
                redo.extend(indices)
                continue
            call, activations = pack(layer, [batches[i] for i in indices], invariant)
            out = torch.empty((call.rows, self.hidden_size), dtype=self.dtype)
            try:
                exchange = channel.post_exchange([call.header(self.num_experts), activations.to("cpu", self.dtype)], [out])
            except ChannelError as error:  # the EW died after the last layer's exchange: gloo refuses the post itself
                failed.append((ew, error))
                self.metrics.replays.labels(expert_worker=ew).inc(len(indices))
                redo.extend(indices)
                continue
            posted.append((ew, indices, call, out, exchange))
        span.set_attribute("moe.expert_workers", sorted(by_ew))
        for ew, indices, call, out, exchange in posted:
            try:
                exchange.wait(self.timeout_s)
            except ChannelError as error:
                failed.append((ew, error))
                self.metrics.replays.labels(expert_worker=ew).inc(len(indices))
                redo.extend(indices)
                continue
            self._observe(ew, time.perf_counter() - start)
            for i, y in zip(indices, out.to(self.device).split(list(call.counts)), strict=True):
                outputs[i] = y
        if redo:
            detected = time.perf_counter()
            redone = self._on_loop(self._recover(failed, layer, [batches[i] for i in redo], invariant))
            for i, y in zip(redo, redone, strict=True):
                outputs[i] = y
            span.set_attribute("moe.replayed_batches", len(redo))
            if failed:
                span.set_attribute("moe.failed_expert_workers", [ew for ew, _ in failed])
                self.metrics.failover_seconds.observe(time.perf_counter() - start)
                log.warning(
                    "layer %d: %s failed after %.1f ms; %d expert batches replayed in %.1f ms",
                    layer,
                    [ew for ew, _ in failed],
                    (detected - start) * 1e3,
                    len(redo),
                    (time.perf_counter() - detected) * 1e3,
                )
        else:
            self.metrics.layer_seconds.observe(time.perf_counter() - start)
        return [y for y in outputs if y is not None]

    def _on_loop(self, coroutine):
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    async def _recover(self, failed: list[tuple[str, ChannelError]], layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        for ew, error in failed:
            await self._on_failure(ew, error)
        return await self.compute_async(layer, batches, invariant)

    def _observe(self, ew: str, rtt: float) -> None:
        self.rtts.append(rtt)
        self.metrics.rtt_seconds.observe(rtt)
        self.metrics.calls.labels(expert_worker=ew).inc()
        self._failures.pop(ew, None)

    async def compute_async(self, layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        start = time.perf_counter()
        outputs: list[torch.Tensor | None] = [None] * len(batches)
        pending = list(range(len(batches)))
        while pending:
            table = self.table
            if table is None:
                raise UnavailableError("no expert routing table yet")
            by_ew: dict[str, list[int]] = {}
            for i in pending:
                by_ew.setdefault(table.resolve(layer, batches[i].expert, exclude=self.dead), []).append(i)
            groups = list(by_ew.items())
            results = await asyncio.gather(
                *(self._exchange(ew, layer, [batches[i] for i in indices], invariant) for ew, indices in groups), return_exceptions=True
            )
            pending = []
            for (ew, indices), result in zip(groups, results, strict=True):
                if isinstance(result, BaseException):
                    if not isinstance(result, ChannelError | grpc.aio.AioRpcError | TimeoutError):
                        raise result
                    await self._on_failure(ew, result)
                    self.metrics.replays.labels(expert_worker=ew).inc(len(indices))
                    pending.extend(indices)
                else:
                    for i, y in zip(indices, result, strict=True):
                        outputs[i] = y
        self.metrics.layer_seconds.observe(time.perf_counter() - start)
        return [y for y in outputs if y is not None]

    # -- one EW ---------------------------------------------------------------------------------
    async def _exchange(self, ew: str, layer: int, batches: list[ExpertBatch], invariant: bool) -> list[torch.Tensor]:
        call, activations = pack(layer, batches, invariant)
        channel = await self._channel(ew)
        out = torch.empty((call.rows, self.hidden_size), dtype=self.dtype)
        start = time.perf_counter()
        await channel.send(call.header(self.num_experts), timeout_s=self.timeout_s)
        await channel.send(activations.to("cpu", self.dtype), timeout_s=self.timeout_s)
        await channel.recv_into(out, timeout_s=self.timeout_s)
        self._observe(ew, time.perf_counter() - start)
        return list(out.to(self.device).split(list(call.counts)))

    async def _channel(self, ew: str) -> TensorChannel:
        channel = self._channels.get(ew)
        if channel is not None and not channel.broken:
            return channel
        table = self.table
        if table is None or ew not in table.workers:
            raise ChannelError(f"expert worker {ew} is not in the routing table", peer=ew)
        ref = table.workers[ew]
        channel_id = f"moe-{self.worker_id}-{next(self._ids)}"
        stub = expert_pb2_grpc.ExpertServiceStub(self._grpc_channel(ref.address))
        await stub.Connect(
            expert_pb2.ConnectRequest(attention_worker_id=self.worker_id, channel_id=channel_id, dtype=str(self.dtype).removeprefix("torch.")),
            timeout=self.timeout_s,
        )
        channel = await self.endpoint.open(ref.channel_endpoint, channel_id, timeout_s=self.timeout_s)
        self._channels[ew] = channel
        return channel

    def _grpc_channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._grpc:
            self._grpc[address] = open_channel(address)
        return self._grpc[address]

    async def _on_failure(self, ew: str, error: BaseException) -> None:
        """Exclude `ew` at once, so the replay goes to the next host without waiting; the probe decides in the background
        whether it comes back (alive, its channel broke) or stays out (dead)."""
        self.dead.add(ew)
        channel = self._channels.pop(ew, None)
        if channel is not None:
            # Tearing a broken group down takes tens of ms: the replay need not wait for it.
            self._background(channel.close())
        self._background(self._confirm(ew, error))

    async def _confirm(self, ew: str, error: BaseException) -> None:
        alive = await self.probe(ew)
        self._failures[ew] = self._failures.get(ew, 0) + 1
        table = self.table
        if alive and self._failures[ew] < _MAX_CHANNEL_FAILURES and table is not None and ew in table.workers:
            self.dead.discard(ew)
            log.warning("channel to expert worker %s failed (%s) but it answers probes: reconnecting", ew, error)
        else:
            log.warning("expert worker %s is dead (%s; probe %s): its experts go to their shadows", ew, error, "ok" if alive else "failed")

    def _background(self, work) -> None:
        future = asyncio.ensure_future(work)
        self._closing.add(future)
        future.add_done_callback(self._closing.discard)

    async def probe(self, ew: str) -> bool:
        """The control path's answer within `probe_timeout_s`."""
        table = self.table
        if table is None or ew not in table.workers:
            return False
        stub = expert_pb2_grpc.ExpertServiceStub(self._grpc_channel(table.workers[ew].address))
        try:
            await stub.Probe(expert_pb2.ProbeRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as error:
            self.metrics.probe_failures.labels(expert_worker=ew).inc()
            log.info("probe of expert worker %s failed: %s", ew, error.code().name)
            return False
        return True

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        grpc_channels, self._grpc = list(self._grpc.values()), {}
        for grpc_channel in grpc_channels:
            await grpc_channel.close()
