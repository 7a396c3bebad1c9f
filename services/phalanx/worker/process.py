"""The worker's lifecycle, in one place.

Start: health NOT_SERVING -> connect NATS and etcd -> load the model ->
engine -> register in etcd -> SERVING. Stop (SIGTERM or Drain): NOT_SERVING
-> drain the engine (finish or hand back) -> stop gRPC -> revoke the lease
-> close NATS. Quarantine (Drain keep_running): NOT_SERVING, drained, up and
running canaries until Undrain (SERVING again) or a stop.

A failover engine (``--failover-role``, phalanx.worker.failover_engine) maps the
slot's shared weights instead of loading them and stands by, unregistered,
until it holds the slot's lock; only then does it allocate its KV cache,
start the engine and register (under a watchdog). A memory service lost for
good (its successor refuses the weights, or they were its GPU memory) or a
lost lock ends it with exit status 1; a restarted memory service does not
(the client re-attaches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx._proto import chaos_pb2, chaos_pb2_grpc, checkpoint_pb2, common_pb2, migration_pb2, migration_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import encode_registration
from phalanx.common.events import EventBus
from phalanx.common.lease import Backoff, LeasedKey
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import (
    validate_worker_id,
    worker_key,
)
from phalanx.common.telemetry import get_tracer
from phalanx.common.watched import DEGRADATION, StateFollower
from phalanx.model.kv_cache import BLOCK_SIZE, prefault
from phalanx.worker.async_engine import AsyncEngine
from phalanx.worker.checkpointing import CheckpointCapture, CheckpointStreamer
from phalanx.worker.config import EngineConfig, WorkerConfig
from phalanx.worker.engine import Engine
from phalanx.worker.engine_frontend import EngineFrontend
from phalanx.worker.fault_service import ChaosServicer, arm_prompt_crash
from phalanx.worker.faults import FaultKind, FaultState
from phalanx.worker.metrics import WorkerMetrics
from phalanx.worker.reports import KvEventStream, publish_load
from phalanx.worker.server import KvSourceServicer, WorkerServicer, drain_engine, snapshot_to_proto

if TYPE_CHECKING:
    from phalanx.common.channels import ChannelEndpoint
    from phalanx.worker.failover_engine import FailoverEngine, WakeWatchdog
    from phalanx.worker.tp_leader import TensorParallelLeader

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
KV_SOURCE_SERVICE_NAME = migration_pb2.DESCRIPTOR.services_by_name["KvSource"].full_name
CHAOS_SERVICE_NAME = chaos_pb2.DESCRIPTOR.services_by_name["ChaosService"].full_name


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
        self.failover = self._failover_engine() if worker.failover else None
        # Non-zero when the worker ends because it must be restarted (a failover engine's memory service or lock went).
        self.exit_code = 0
        self.shell = ServiceShell(
            "phalanx-worker", worker, telemetry, registry=self.metrics.registry,
            options=[
                ("grpc.max_receive_message_length", worker.max_message_bytes),
                # Routers ping every 10 s on open streams to notice a dead worker; the default would GOAWAY them.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ],
            probes=self.failover.probe if self.failover is not None else None,
        )
        self.health = self.shell.health
        self.ready = self.shell.ready
        self._exit_drain: asyncio.Future[tuple[int, int]] | None = None
        self._quarantined = False
        self.faults = FaultState()
        # None while a DROP_NATS fault holds the connection closed: events are then dropped.
        self._bus: EventBus | None = None
        self._nats_reconnect: asyncio.Task[None] | None = None
        self._registration: LeasedKey | None = None
        self._servicer: WorkerServicer | None = None
        self._kv_events = KvEventStream(self.worker_id, lambda: self._bus)
        self.channels: ChannelEndpoint | None = None
        self._streamer: CheckpointStreamer | None = None
        self._capture: CheckpointCapture | None = None
        self._engine_process = False  # the engine runs in a child process (engine_core.py)
        # The follower ranks and their group, when tensor_parallel_size > 1.
        self._tensor_parallel: TensorParallelLeader | None = None
        # The forwarding engine, in the attention role (docs/moe.md).
        self.remote_experts: Any = None

    @property
    def address(self) -> str:
        return self.shell.address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        async with self.shell as shell:
            servicer = self._servicer = self._add_services(shell)
            await shell.start()
            self._bus = await EventBus.connect(self.nats_config, name=f"worker-{self.worker_id}")
            shell.push_async_callback(self._close_nats)
            watchdog = None
            if self.failover is None:
                engine, model = await self._load(shell)
            else:
                woken = await self._take_over(shell, self.failover)
                if woken is None:
                    return
                engine, model, watchdog = woken
                self.failover.mark("engine")
            if self.channels is not None:
                await self.channels.start()
            if self._capture is not None:
                self._streamer = self._checkpoint_streamer(self._capture, engine, model)
                shell.push_async_callback(self._streamer.stop)
                await self._streamer.start()
            servicer.attach(engine, model_version=model.version)
            if self.config.chaos_crash_on_prompt and not self._engine_process:  # an engine process armed its own steps
                arm_prompt_crash(engine.engine, self.config.chaos_crash_on_prompt, servicer.tokenizer.decode)
            servicer.stall_kv_send = self.config.chaos_stall_kv_send
            if self.failover is not None:
                self.failover.mark("channels+checkpointing")  # the endpoint started while standing by: a no-op here
            self._registration = await shell.register(self.etcd_config, worker_key(self.worker_id), self._registration_value(model))
            if self.failover is not None and watchdog is not None:
                watchdog.cancel()
                self.failover.mark("registered")
                self.failover.activated()
            await self._set_serving(True)
            self.metrics.for_worker(self.metrics.serving).set(1)
            self.metrics.for_worker(self.metrics.batch_scale).set(1)
            log.info("worker %s serving %s (%s) on %s", self.worker_id, model.config.name, model.version, self.address)
            # A woken shadow restores at once: not now. A simulated engine's cache (numpy) holds no KV worth it.
            if self.failover is None and self.config.prefault_kv_cache and self.engine_config.engine == "torch":
                _prefault_kv_cache(engine)
            async with asyncio.TaskGroup() as tasks:
                loops = [
                    tasks.create_task(self._kv_events.run()),
                    tasks.create_task(publish_load(self.worker_id, engine, self.metrics, lambda: self._bus, self.config.load_interval_s)),
                    tasks.create_task(self._follow_degradation(engine)),
                ]
                await self._wait_for_stop(engine)
                await self._shutdown(engine)
                for task in loops:
                    task.cancel()

    def _failover_engine(self) -> FailoverEngine:
        from phalanx.failover.lock import FileFailoverLock
        from phalanx.failover.memory_service import MemoryServiceClient
        from phalanx.worker.failover_engine import FailoverEngine, FailoverMetrics, SwitchLedger

        c = self.config
        if self.engine_config.engine != "torch" or self.engine_config.tensor_parallel_size != 1:
            raise ValueError("a failover engine runs the torch engine in one process (engine=torch, tensor_parallel_size=1)")
        lock_path = os.path.abspath(c.failover_lock)
        slot = c.failover_slot or f"{socket.gethostname()}:{lock_path}"
        return FailoverEngine(
            lock=FileFailoverLock(lock_path, f"{c.engine_id}:{self.worker_id}"), memory=MemoryServiceClient(c.memory_socket),
            engine_id=c.engine_id, role=c.failover_role, slot=slot,
            metrics=FailoverMetrics(self.metrics.registry, self.worker_id, c.failover_role, slot),
            ledger=SwitchLedger(Path(f"{lock_path}.switches.json")), weights_timeout_s=c.weights_timeout_s,
        )

    async def _take_over(self, shell: ServiceShell, failover: FailoverEngine) -> tuple[EngineFrontend, Any, WakeWatchdog] | None:
        """INIT -> shared weights -> STANDBY until the lock is ours -> WAKING: the engine, with a watchdog the caller
        cancels once registered. None if a stop or a failure came first (exit_code says which)."""
        from phalanx.worker.failover_engine import FailoverState, WakeWatchdog

        shell.push_async_callback(failover.close)
        self._set_torch_threads()
        with get_tracer(__name__).start_as_current_span("worker.map_weights"):
            loading = asyncio.ensure_future(
                failover.load_model(
                    self.engine_config.model, dtype=self.engine_config.torch_dtype(), seed=self.engine_config.seed,
                    device=self.engine_config.device,
                )
            )
            stopping = asyncio.ensure_future(shell.wait_for_stop())
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not loading.done():  # stopped while waiting for the weights (a read-only engine before engine 0 published)
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loading
                return None
            model = loading.result()
        # The tensor-channel endpoint (a TCP store, a gloo device, its etcd advertisement: 10-200 ms, more on a busy host)
        # is ready before the wake. It is no worker registration: nobody sends this engine anything until it registers.
        await self._endpoint.start()
        log.info("engine %d (%s) of slot %s standing by on shared weights", failover.engine_id, failover.role, failover.slot)
        if not await failover.stand_by(shell.wait_for_stop):
            self._fail_if(failover)
            return None
        failover.enter(FailoverState.WAKING)
        watchdog = WakeWatchdog(self.config.wake_timeout_s, f"the wake of engine {failover.engine_id}").start()
        shell.callback(watchdog.cancel)
        log.warning("engine %d (%s) holds the slot's lock after %.3f s standing by: waking", failover.engine_id, failover.role,
                    failover.standby_s)
        engine = await self._start_engine(shell, model)
        return engine, model, watchdog

    def _fail_if(self, failover: FailoverEngine) -> bool:
        why = failover.failure()
        if why is not None:
            log.error("%s: the engine exits non-zero so that it is restarted", why)
            self.exit_code = 1
        return why is not None

    async def _set_serving(self, serving: bool) -> None:
        await self.shell.set_serving(serving)
        if self.failover is not None:
            self.failover.serving = serving

    @property
    def _endpoint(self) -> ChannelEndpoint:
        """The tensor-channel endpoint, once _add_services made it."""
        assert self.channels is not None, "used before _add_services()"
        return self.channels

    def _add_services(self, shell: ServiceShell) -> WorkerServicer:
        """The worker's gRPC services (chaos only when enabled) and its tensor-channel endpoint, whose undo goes first."""
        c = self.config
        channels = None
        # A simulated worker has no tensor channels: its KV is a few bytes per position, which gRPC carries, and an endpoint
        # (torch.distributed's TCP store and gloo) would import torch, most of its start time and memory.
        if self.engine_config.engine != "sim":
            from phalanx.common.channels import ChannelEndpoint

            # Peers connect to the advertised host (a container's service name), which must resolve to this host.
            channels = self.channels = ChannelEndpoint(
                f"worker-{self.worker_id}", self.etcd_config, host=shell.advertised_host, timeout_s=c.channel_timeout_s
            )
            shell.push_async_callback(channels.close)
            channels.add_grpc_service(shell.server)
        servicer = WorkerServicer(
            self.worker_id, self.metrics, on_drain=self._drain, on_undrain=self._undrain, kv_sequence=lambda: self._kv_events.sequence,
            address=self.address, channels=channels, channel_timeout_s=c.channel_timeout_s, channel_min_bytes=c.channel_min_bytes,
            media_channel_min_bytes=c.media_channel_min_bytes,
            checkpointing_to=self._checkpointing_to, detach_grace_s=c.detach_grace_s, retain_s=c.retain_s, max_retained=c.max_retained,
            max_retained_bytes=c.max_retained_bytes,
        )
        shell.push_async_callback(servicer.close)  # no detach timer outlives the loop; readers still waiting see ABORTED
        shell.add_service(SERVICE_NAME, worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)
        # Not health-checked: a draining worker is NOT_SERVING but still hands its parked KV out.
        shell.add_service(KV_SOURCE_SERVICE_NAME, migration_pb2_grpc.add_KvSourceServicer_to_server, KvSourceServicer(servicer), health=False)
        if c.chaos_enabled:
            self._add_chaos_service(shell)
        return servicer

    def _engine_in_process(self) -> bool:
        c = self.engine_config
        if not c.engine_process:
            return False
        applies = c.engine == "torch" and c.tensor_parallel_size == 1 and c.whole_model and self.failover is None
        if not applies and "engine_process" in c.model_fields_set:  # asked for, not merely the default
            log.warning("engine_process applies to the torch engine of a monolithic worker without tensor parallelism or "
                        "failover: this one keeps its engine on a thread")
        return applies

    async def _start_engine_process(self, shell: ServiceShell) -> tuple[EngineFrontend, Any]:
        """The engine in a child process (engine_core.py) that loads the model; this process keeps its skeleton only."""
        from phalanx.worker.engine_client import EngineCoreClient

        c = self.config
        engine = EngineCoreClient(
            self.engine_config, faults=self.faults, on_kv_events=self._kv_events.outbox.put_nowait,
            checkpoint_max_pending_bytes=c.checkpoint_max_pending_bytes if c.checkpointing else 0,
            checkpoint_interval_tokens=c.checkpoint_interval_tokens, crash_on_prompt=c.chaos_crash_on_prompt,
        )
        shell.push_async_callback(engine.stop)
        await engine.start()
        self._engine_process = True
        self._capture = engine.checkpoints
        self.engine_config = engine.engine.config  # sized by the child for its model
        return engine, engine.engine.model

    async def _load(self, shell: ServiceShell) -> tuple[EngineFrontend, Any]:
        """The model (split over the follower ranks with tensor parallelism) and its engine, started; both stopped at exit."""
        if self._engine_in_process():
            with get_tracer(__name__).start_as_current_span("worker.start_engine_process"):
                return await self._start_engine_process(shell)
        simulated = self.engine_config.engine == "sim"
        self._set_torch_threads()
        with get_tracer(__name__).start_as_current_span("worker.load_model"):
            runner = None
            cache = None
            model: Any  # a Transformer, or a SimulatedModel that quacks like one to the engine (no weights)
            if simulated:
                from phalanx.worker.simulated import load_simulated

                model, runner = await asyncio.to_thread(load_simulated, self.engine_config)
            else:
                model = await asyncio.to_thread(self.engine_config.load_model)
            if self.engine_config.role == "attention":
                model = await self._split_attention(shell, model)
            if self.engine_config.tensor_parallel_size > 1:
                self._size_for(model)  # before the followers get the config
                shell.push_async_callback(self._stop_tensor_parallel)
                model, cache = await self._start_tensor_parallel(model)
        return await self._start_engine(shell, model, cache=cache, runner=runner), model

    def _set_torch_threads(self) -> None:
        # A simulated worker computes nothing and never imports torch (its start time and memory are most of a worker's).
        if self.engine_config.engine != "sim" and self.engine_config.device == "cpu":
            import torch

            torch.set_num_threads(self.engine_config.effective_torch_threads())

    def _size_for(self, model: Any) -> None:
        # Before the registration announces the cache's size.
        mc = model.config
        self.engine_config = self.engine_config.sized_for(mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype.itemsize)

    async def _start_engine(self, shell: ServiceShell, model: Any, *, cache: Any = None, runner: Any = None) -> EngineFrontend:
        """The engine on `model` (its KV cache allocated here unless a tensor-parallel group brings it), started; stopped at exit."""
        c = self.config
        self._size_for(model)
        if c.checkpointing:
            self._capture = CheckpointCapture(c.checkpoint_max_pending_bytes, interval_tokens=c.checkpoint_interval_tokens)
        engine = AsyncEngine(
            Engine(model, self.engine_config, faults=self.faults, cache=cache, runner=runner), on_kv_events=self._kv_events.outbox.put_nowait,
            checkpoints=self._capture,
        )
        shell.push_async_callback(engine.stop)
        await engine.start()
        return engine

    async def _stop_tensor_parallel(self) -> None:
        # After the engine thread ended (its undo runs first): nothing else issues a collective any more.
        if self._tensor_parallel is not None:
            await asyncio.to_thread(self._tensor_parallel.shutdown)

    def _checkpointing_to(self) -> str:
        """The checkpoint store this worker's checkpoints stream to now, if any."""
        streamer, capture = self._streamer, self._capture
        return streamer.store_address if streamer is not None and capture is not None and capture.connected else ""

    async def _close_nats(self) -> None:
        if self._nats_reconnect is not None:
            self._nats_reconnect.cancel()
        if self._bus is not None:
            await self._bus.close()

    async def _split_attention(self, shell: ServiceShell, model: Any) -> Any:
        """Attention role: the experts go (split_attention); a RemoteExperts follows the ERT and reaches the expert workers."""
        from phalanx.model.expert_split import split_attention
        from phalanx.worker.forwarding import ForwardingMetrics, RemoteExperts

        c = self.engine_config
        mc = model.config
        remote = self.remote_experts = RemoteExperts(
            self.worker_id, self._endpoint, asyncio.get_running_loop(), num_experts=mc.num_experts, hidden_size=mc.hidden_size,
            dtype=model.dtype, device=c.device, timeout_s=c.expert_timeout_s, probe_timeout_s=c.expert_probe_timeout_s,
            metrics=ForwardingMetrics(self.metrics.registry),
        )
        following = asyncio.create_task(remote.follow(self.etcd_config), name="phalanx-ert-follow")

        async def stop_following() -> None:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            await remote.close()

        shell.push_async_callback(stop_following)
        # The channels need the endpoint, which the worker starts after the model loads otherwise.
        await self._endpoint.start()
        table = await remote.wait_complete(c.ert_wait_s)
        log.info("attention worker %s: ERT version %d, %d expert workers", self.worker_id, table.version, len(table.workers))
        return split_attention(model, remote)

    async def _start_tensor_parallel(self, model):
        """Starts the follower ranks and forms the group; returns the model and KV cache the Engine runs on.

        The followers are started from this, the main, thread: they die with
        it (PDEATHSIG follows the thread that forked them).
        """
        from phalanx.worker.tp_leader import TensorParallelLeader

        leader = self._tensor_parallel = TensorParallelLeader(self.engine_config)
        leader.start_followers(model)
        return await asyncio.to_thread(leader.connect, model)

    async def _wait_for_stop(self, engine: EngineFrontend) -> None:
        while not self.shell.stop_requested:
            if engine.dead is not None:
                log.error("engine died; worker exits non-zero so that its lease lapses, its requests migrate and it is replaced")
                self.exit_code = 1
                return
            if self.failover is not None and self._fail_if(self.failover):
                return
            try:
                await asyncio.wait_for(self.shell.wait_for_stop(), timeout=0.5)
            except TimeoutError:
                pass

    async def _shutdown(self, engine: EngineFrontend) -> None:
        self.metrics.for_worker(self.metrics.serving).set(0.5)
        if self.failover is not None:
            self.failover.serving = False
        await self.shell.stop_serving()
        await self._drain(engine, self.config.drain_grace_s)  # a no-op after a Drain that already ran
        # Requests already ended (finished or handed back): wait for their last chunks to be written, then stop. Calls that
        # owe nothing stay open (a router's idle Multiplex, health's Watch) and would hold a fixed grace in full: a scaled-down
        # worker held its process a second longer, every time. The short grace lets the written bytes leave the transport.
        if self._servicer is not None:
            await self._servicer.chunks_written(timeout_s=1.0)
        await self.shell.stop_server(0.1)
        self.metrics.for_worker(self.metrics.serving).set(0)

    async def _drain(self, engine: EngineFrontend, grace_s: float, keep_running: bool = False) -> tuple[int, int]:
        """Drain RPC and SIGTERM: quarantine (keep_running), or drain once and exit."""
        if keep_running and not engine.exiting:
            self._quarantined = True
            self.metrics.for_worker(self.metrics.serving).set(0.5)
            await self._set_serving(False)
            drained = await drain_engine(engine, grace_s, keep_running=True, park_ttl_s=self._park_ttl())
            log.warning("quarantined: %d finished, %d handed back; admitting canaries only until Undrain", *drained)
            return drained
        if self._exit_drain is None:
            self._exit_drain = asyncio.ensure_future(self._drain_to_exit(engine, grace_s))
        return await asyncio.shield(self._exit_drain)

    async def _drain_to_exit(self, engine: EngineFrontend, grace_s: float) -> tuple[int, int]:
        self.metrics.for_worker(self.metrics.serving).set(0.5)
        await self._set_serving(False)
        drained = await drain_engine(engine, grace_s, park_ttl_s=self._park_ttl())
        log.info("drained: %d finished, %d handed back", *drained)
        # Parked KV leaves with the process: stay up (serving KvSource only) until it was transferred or expired.
        deadline = time.monotonic() + self._park_ttl()
        while engine.engine.parked and time.monotonic() < deadline and engine.dead is None:
            await asyncio.sleep(0.01)
        self.shell.request_stop()
        return drained

    def _park_ttl(self) -> float:
        # A simulated worker's parked KV goes over gRPC (it has no channels; a few bytes per position).
        movable = self.channels is not None or self.engine_config.engine == "sim"
        return self.config.park_ttl_s if self.config.transfer_on_drain and movable else 0.0

    async def _undrain(self, engine: EngineFrontend) -> bool:
        """Lifts a quarantine; False if there is none or the worker is on its way out."""
        if not self._quarantined or engine.exiting or self.shell.stop_requested:
            return False
        self._quarantined = False
        engine.draining = False
        await self._set_serving(True)
        self.metrics.for_worker(self.metrics.serving).set(1)
        log.warning("quarantine lifted: admitting requests again")
        return True

    def _checkpoint_streamer(self, capture: CheckpointCapture, engine: EngineFrontend, model) -> CheckpointStreamer:
        cache = engine.engine.cache
        shape = cache.full_shape  # all heads: a tensor-parallel leader gathers every rank's into each segment
        layout = checkpoint_pb2.KvLayout(
            num_layers=shape[0], num_kv_heads=shape[4], head_dim=shape[5], dtype=str(cache.data.dtype).removeprefix("torch.")
        )
        return CheckpointStreamer(
            capture, worker_id=self.worker_id, model_version=model.version, layout=layout,
            channel_endpoint=self.channels.endpoint_id if self.channels is not None else "", etcd_config=self.etcd_config,
            sent_bytes=self.metrics.for_worker(self.metrics.checkpoint_bytes),
            snapshot_to_proto=snapshot_to_proto, flush_interval_s=self.config.checkpoint_flush_interval_s,
        )

    def _registration_value(self, model) -> bytes:
        return encode_registration(
            common_pb2.WorkerRegistration(
                worker_id=self.worker_id, address=self.address, pid=os.getpid(), model=model.config.name,
                role=self.engine_config.role, block_size=BLOCK_SIZE, total_blocks=self.engine_config.num_kv_blocks,
                metrics_address=self.shell.metrics_address,
                started_at=time.time(), max_model_len=self.engine_config.max_model_len, model_version=model.version,
                channel_endpoint=self.channels.endpoint_id if self.channels is not None else "",
                tensor_parallel_size=self.engine_config.tensor_parallel_size,
                num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim,
                kv_dtype=str(model.dtype).removeprefix("torch."), compute_dtype=str(model.dtype).removeprefix("torch."),
                failover_slot=self.failover.slot if self.failover is not None else "",
            )
        )

    # -- fault injection (chaos) ------------------------------------------------------
    def _add_chaos_service(self, shell: ServiceShell) -> None:
        # Only with chaos enabled: otherwise its calls get UNIMPLEMENTED.
        chaos = ChaosServicer(
            self.worker_id, self.config.chaos_token, self.faults, self.metrics, ready=self.ready,
            on_inject=self._inject_fault, on_clear=self._clear_fault,
        )
        shell.add_service(CHAOS_SERVICE_NAME, chaos_pb2_grpc.add_ChaosServiceServicer_to_server, chaos, health=False)
        log.warning("chaos enabled: this worker accepts fault injection from holders of its token")

    async def _inject_fault(self, kind: FaultKind) -> None:
        if kind is FaultKind.DROP_NATS:
            bus, self._bus = self._bus, None
            if bus is not None:
                await bus.close()
        elif kind is FaultKind.DROP_ETCD and self._registration is not None:
            # Not revoked: the key lapses after its TTL, as when a worker hangs.
            await self._registration.pause()

    async def _clear_fault(self, kind: FaultKind) -> None:
        if kind is FaultKind.DROP_NATS:
            if self._bus is None and (self._nats_reconnect is None or self._nats_reconnect.done()):
                self._nats_reconnect = asyncio.create_task(self._reconnect_nats())
        elif kind is FaultKind.DROP_ETCD and self._registration is not None:
            self._registration.resume()  # a fresh lease, put in the background

    async def _reconnect_nats(self) -> None:
        backoff = Backoff(initial=self.nats_config.initial_reconnect_wait_s, cap=self.nats_config.max_reconnect_wait_s)
        while True:
            try:
                bus = await EventBus.connect(self.nats_config, name=f"worker-{self.worker_id}")
            except ConnectionError as error:
                delay = backoff.next()
                log.warning("NATS reconnect after a dropped connection failed (%s); retrying in %.2f s", error, delay)
                await asyncio.sleep(delay)
                continue
            if self.faults.get(FaultKind.DROP_NATS) is not None:  # dropped again meanwhile
                await bus.close()
            else:
                self._bus = bus
                log.warning("NATS connection restored after a drop")
            return

    # -- background loops ----------------------------------------------------------
    async def _follow_degradation(self, engine: EngineFrontend) -> None:
        """Shrinks the batch while the health service's DegradationState asks for it."""
        follower = StateFollower(self.etcd_config, DEGRADATION)
        try:
            await follower.follow(lambda state: self._apply_degradation(engine, state))
        finally:
            await follower.close()

    def _apply_degradation(self, engine: EngineFrontend, state: common_pb2.DegradationState | None) -> None:
        before = engine.engine.batch_scale
        scale = engine.engine.set_batch_scale(state.batch_scale if state is not None else 1.0)
        if scale != before:
            log.warning(
                "batch scale %.2f -> %.2f (degradation level %d): at most %d sequences per batch",
                before, scale, state.level if state is not None else 0, engine.engine.max_num_seqs,
            )
        self.metrics.for_worker(self.metrics.batch_scale).set(scale)


def _prefault_kv_cache(engine: EngineFrontend) -> None:
    """Faults the KV cache's pages in on a background thread, so that restores and new requests write warm memory.

    The cache is allocated untouched (a fast start, see ``zeroed``); without this a restore onto a fresh worker pays a
    page fault per 4 KiB of KV it scatters.
    """
    data = getattr(getattr(engine.engine, "cache", None), "data", None)
    if data is not None:
        threading.Thread(target=prefault, args=(data,), name="kv-prefault", daemon=True).start()
