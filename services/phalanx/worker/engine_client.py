"""The worker's side of an engine in a process of its own (vLLM v1's EngineCoreClient); the child is engine_core.py.

`EngineCoreClient` is an `EngineFrontend` like AsyncEngine: the rest of the worker submits, aborts, parks and restores
through it and reads engine state from `engine`, here an `EngineView` built from what the child pushes after each
loop turn (a `CoreState`) plus a skeleton of the model (its config and tokenizer, no weights) loaded in the worker.

A thread blocks on the pipe and hands each message to the event loop. Its EOF (the child exited, however) while the
worker did not ask it to stop makes the engine dead at once: every open stream and pending call fails with
EngineDeadError, and the worker's lifecycle (process.py) then exits non-zero so that its requests migrate.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from phalanx.common.children import pdeathsig_preexec
from phalanx.common.errors import EngineDeadError, UnavailableError
from phalanx.model.kv_cache import KvEvents
from phalanx.worker.capture_ring import RingSlice, ring_view
from phalanx.worker.checkpointing import CheckpointCapture, _Capture
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import EngineRequest, ParkPick, clamp_batch_scale, validate_request
from phalanx.worker.engine_core import (
    Abort,
    Add,
    Admitted,
    CaptureControl,
    Command,
    CoreOptions,
    CoreState,
    Died,
    ExportKv,
    HandBack,
    ListCached,
    Park,
    Ready,
    Reply,
    Restore,
    SetBatchScale,
    SetFaults,
    StepOutput,
    Stop,
    Unpark,
)
from phalanx.worker.engine_frontend import EngineFrontend, EngineLoad, EventSink, set_exception, set_result
from phalanx.worker.faults import FaultState
from phalanx.worker.sequence import TokenEvent

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# A child that does not exit this long after Stop is killed.
_STOP_TIMEOUT_S = 10.0


class CacheView:
    """What the worker reads of the child's KV cache: its shape, and its memory where shared (CPU)."""

    simulated = False

    def __init__(self, ready: Ready) -> None:
        import torch

        self.full_shape = ready.full_shape
        self.bytes_per_block = ready.bytes_per_block
        # On an accelerator the cache stays the child's alone: a meta tensor answers its dtype and shape.
        self.data = ready.cache_data if ready.cache_data is not None else torch.empty(ready.full_shape, dtype=getattr(torch, ready.dtype),
                                                                                      device="meta")


class EngineView:
    """The EngineState of an engine in another process: the last CoreState it pushed, and the model's skeleton."""

    def __init__(self, model: Any, ready: Ready, faults: FaultState, send: Callable[[Command], None]) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.config: EngineConfig = ready.config
        self.cache = CacheView(ready)
        self.faults = faults
        blocks = ready.config.num_kv_blocks  # free until the first state says otherwise (it comes within a loop turn)
        self.state = CoreState(free_blocks=blocks, total_blocks=blocks, max_num_seqs=ready.config.max_num_seqs)
        self._send = send
        self._batch_scale = 1.0
        self._max_num_seqs = ready.config.max_num_seqs

    def validate(self, request: EngineRequest) -> None:
        validate_request(request, self.model, self.config)

    @property
    def batch_scale(self) -> float:
        return self._batch_scale

    def set_batch_scale(self, scale: float) -> float:
        """As Engine.set_batch_scale, applied by the child at its next step boundary."""
        self._batch_scale = scale = clamp_batch_scale(scale)
        self._max_num_seqs = max(1, int(self.config.max_num_seqs * scale))
        self._send(SetBatchScale(scale))
        return scale

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def parked(self) -> tuple[str, ...]:
        return self.state.parked

    @property
    def preemptions(self) -> int:
        return self.state.preemptions

    @property
    def prefix_hit_tokens(self) -> int:
        return self.state.prefix_hit_tokens

    @property
    def prompt_tokens_total(self) -> int:
        return self.state.prompt_tokens_total

    @property
    def generated_tokens_total(self) -> int:
        return self.state.generated_tokens_total

    @property
    def tokens_computed(self) -> int:
        return self.state.tokens_computed

    @property
    def canary_tokens_computed(self) -> int:
        return self.state.canary_tokens_computed

    @property
    def canaries_total(self) -> int:
        return self.state.canaries_total


class RemoteCapture(CheckpointCapture):
    """The CheckpointStreamer's capture when the engine runs in a child: captures arrive from the child's
    CheckpointCapture (see engine_core.py); what the streamer tells this one goes to the child's as CaptureControl.

    On a CPU a capture's KV is a view of the capture ring (capture_ring.py), which the child reuses once `sent`
    reported its bytes: whoever takes captures reads their KV before it reports them sent.
    """

    def __init__(self, send: Callable[[Command], None], max_pending_bytes: int, *, interval_tokens: int) -> None:
        self._send_control = send
        self._connected = False
        self._epoch = 0  # of the last resync of every request
        self.ring: torch.Tensor | None = None  # the child's capture ring, once it started
        super().__init__(max_pending_bytes, interval_tokens=interval_tokens)

    @property
    def connected(self) -> bool:
        return self._connected

    @connected.setter
    def connected(self, connected: bool) -> None:
        if connected == self._connected:
            return  # the child's starts disconnected too
        self._connected = connected
        self._send_control(CaptureControl(connected=connected))

    def resync(self, request_id: str | None = None) -> None:
        if request_id is not None:
            self._send_control(CaptureControl(resync_request=request_id))
            return
        with self._lock:
            self._epoch += 1
            self._queue.clear()
            epoch = self._epoch
        self._send_control(CaptureControl(resync_epoch=epoch))

    def superseded(self, request_id: str, copy_id: int) -> None:
        self._send_control(CaptureControl(superseded=(request_id, copy_id)))

    def sent(self, nbytes: int) -> None:
        if nbytes:
            self._send_control(CaptureControl(sent_bytes=nbytes))

    def deliver(self, captures: list[_Capture], epoch: int) -> None:
        """Queues the child's captures, unless a resync of every request made them stale."""
        ring = self.ring
        if ring is not None:
            for capture in captures:
                for piece in capture.pieces:
                    if isinstance(piece.kv, RingSlice):
                        piece.kv = ring_view(ring, piece.kv)
        with self._lock:
            if epoch != self._epoch:
                return
            wake = not self._queue
            self._queue.extend(captures)
        if wake and self._notify is not None:
            self._notify()


class EngineCoreClient(EngineFrontend):
    """The engine loop in a child process (engine_core.py), driven from the worker's event loop."""

    def __init__(
        self, config: EngineConfig, *, faults: FaultState | None = None, on_kv_events: Callable[[KvEvents], None] | None = None,
        checkpoint_max_pending_bytes: int = 0, checkpoint_interval_tokens: int = 8, crash_on_prompt: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.faults = faults or FaultState()
        self._on_kv_events = on_kv_events
        self._send_lock = threading.Lock()
        self.checkpoints: RemoteCapture | None = None
        if checkpoint_max_pending_bytes:
            self.checkpoints = RemoteCapture(self._send, checkpoint_max_pending_bytes, interval_tokens=checkpoint_interval_tokens)
        self._options = CoreOptions(
            os.getpid(), authkey=bytes(multiprocessing.current_process().authkey),
            checkpoint_max_pending_bytes=checkpoint_max_pending_bytes, checkpoint_interval_tokens=checkpoint_interval_tokens,
            log_level=logging.getLogger().getEffectiveLevel(), crash_on_prompt=crash_on_prompt,
        )
        self._conn: Connection | None = None
        self.process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, EventSink | None]] = {}
        self._view: EngineView | None = None

    @property
    def engine(self) -> EngineView:  # type: ignore[override]
        assert self._view is not None, "used before start()"
        return self._view

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        """Starts the child and waits until it loaded the model; raises EngineDeadError if it could not."""
        from phalanx.model.loader import skeleton

        self._loop = asyncio.get_running_loop()
        c = self.config
        skeleton_model = asyncio.ensure_future(asyncio.to_thread(skeleton, c.model, dtype=c.torch_dtype(), seed=c.seed))
        ours, theirs = socket.socketpair()
        # From the event loop's thread, the main one: PDEATHSIG follows the thread that forked. In a session of its
        # own: SIGINT/SIGTERM to the worker's group reach the worker, whose stop() then stops the engine in order.
        self.process = subprocess.Popen(  # noqa: ASYNC220 - a fork and exec; on a pool thread PDEATHSIG would follow it
            [sys.executable, "-m", "phalanx.worker.engine_core", "--fd", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}, start_new_session=True,
            preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509 - only prctl
        )
        theirs.close()  # the child's end is its alone now: its exit is our EOF
        self._conn = Connection(ours.detach())
        self._conn.send((c, self._options))
        ready = await asyncio.to_thread(self._wait_ready)
        model = await skeleton_model
        self._view = EngineView(model, ready, self.faults, self._send)
        if self.checkpoints is not None:
            self.checkpoints.ring = ready.capture_ring
        self.faults.on_change = lambda faults: self._send(SetFaults(tuple(faults.values())))
        self._reader = threading.Thread(target=self._read, name="phalanx-engine-pipe", daemon=True)
        self._reader.start()
        log.info("engine process %d started", self.process.pid)

    def _wait_ready(self) -> Ready:
        conn, process = self._connected, self.process
        assert process is not None
        while not conn.poll(0.2):
            if process.poll() is not None:
                raise EngineDeadError(f"the engine process exited with code {process.returncode} while loading")
        message = conn.recv()
        if isinstance(message, Died):
            raise EngineDeadError(message.error)
        assert isinstance(message, Ready), f"the engine process sent {type(message).__name__} first"
        return message

    async def stop(self) -> None:
        """Stops the child (Stop, then SIGKILL after _STOP_TIMEOUT_S); idempotent. Requests still open end as ABORTED."""
        self._stopping = True
        self.faults.on_change = None
        process = self.process
        if process is not None:
            try:
                self._send(Stop())
            except OSError:
                pass  # gone already
            try:
                await asyncio.to_thread(process.wait, _STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("engine process %d did not stop within %.0f s: killed", process.pid, _STOP_TIMEOUT_S)
                process.kill()
                await asyncio.to_thread(process.wait)
            self.process = None
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join)
            self._reader = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._fail_pending(UnavailableError("the worker is stopping", retry_after_s=0.1))
        self._fail_all(None)

    @property
    def _connected(self) -> Connection:
        assert self._conn is not None, "used before start()"
        return self._conn

    def _send(self, command: Command) -> None:
        if self.dead is not None:
            return  # nobody reads it; callers learn from `dead`
        with self._send_lock:  # the fault service's thread sends too (SetFaults)
            self._connected.send(command)

    # -- requests -----------------------------------------------------------
    async def _submit(self, request: EngineRequest, sink: EventSink) -> str:
        admitted: Admitted = await self._call(lambda call_id: Add(call_id, request), sink)
        return admitted.request_id

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def hand_back_all(self) -> None:
        self._send(HandBack())

    async def cached_blocks(self) -> list[tuple[int, int, int]]:
        return await self._call(ListCached)

    async def _restore(self, request: EngineRequest, kv: Any, kv_tokens: int, sink: EventSink) -> list[TokenEvent]:
        admitted: Admitted = await self._call(lambda call_id: Restore(call_id, request, kv, kv_tokens), sink)
        return admitted.replayed

    async def park(self, request_ids: list[str] | None, ttl_s: float, pick: ParkPick | None = None) -> list[TokenEvent]:
        return await self._call(lambda call_id: Park(call_id, request_ids, ttl_s, pick))

    async def export_kv(self, request_id: str, kv_tokens: int, from_token: int = 0) -> torch.Tensor:
        return await self._call(lambda call_id: ExportKv(call_id, request_id, kv_tokens, from_token))

    async def unpark(self, request_id: str) -> int:
        return await self._call(lambda call_id: Unpark(call_id, request_id))

    async def _call(self, command: Callable[[int], Command], sink: EventSink | None = None) -> Any:
        """Sends a command the child answers with a Reply; its value (or exception) comes back here."""
        self._check_alive()
        call_id = next(self._calls)
        done = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (done, sink)
        try:
            self._send(command(call_id))
            return await done
        finally:
            self._pending.pop(call_id, None)

    def load(self) -> EngineLoad:
        s = self.engine.state
        return EngineLoad(
            queue_depth=s.queue_depth, running_seqs=s.running_seqs, free_blocks=s.free_blocks, total_blocks=s.total_blocks,
            step_time_ms=s.rates.step_time_ema_s * 1e3, prefill_tokens_per_s=s.rates.prefill_rate, decode_tokens_per_s=s.rates.decode_rate,
        )

    # -- the pipe's reader thread -------------------------------------------
    def _read(self) -> None:
        conn, loop = self._connected, self._loop
        assert loop is not None
        try:
            while True:
                message = conn.recv()
                loop.call_soon_threadsafe(self._on_message, message)
        except Exception as exc:  # noqa: BLE001 - EOF, a reset pipe, a tensor whose sender died: the child is gone
            reason = "exited" if isinstance(exc, EOFError) else f"is unreachable ({exc!r})"
        try:
            loop.call_soon_threadsafe(self._on_exit, reason)
        except RuntimeError:
            pass  # the loop closed first: nobody is left to tell

    # -- on the event loop --------------------------------------------------
    def _on_message(self, message: StepOutput | Died) -> None:
        if isinstance(message, Died):
            log.error("engine process: %s", message.error)
            self._die(EngineDeadError(message.error))
            return
        if message.state is not None and self._view is not None:
            self._view.state = message.state
            if self.checkpoints is not None:
                self.checkpoints.lag_tokens = message.state.checkpoint_lag_tokens
                self.checkpoints.captures_skipped = message.state.checkpoints_skipped
        if self._on_kv_events is not None:
            for kv_events in message.kv_events:
                self._on_kv_events(kv_events)
        for reply in message.replies:  # before the events: a request is registered before its first event
            self._on_reply(reply)
        if message.events:
            self._dispatch(message.events)
        if message.captures and self.checkpoints is not None:
            self.checkpoints.deliver(message.captures, message.capture_epoch)

    def _on_reply(self, reply: Reply) -> None:
        pending = self._pending.get(reply.call_id)
        if pending is None:
            return
        done, sink = pending
        if reply.error is not None:
            set_exception(done, reply.error.rebuild())
            return
        value = reply.value
        if isinstance(value, Admitted) and sink is not None:
            self._register(value.request_id, sink, value.canary, value.replayed)
        set_result(done, value)

    def _on_exit(self, reason: str) -> None:
        if self._stopping:
            return
        process = self.process
        code = process.poll() if process is not None else None
        self._die(EngineDeadError(f"the engine process {reason} (exit code {code})"))

    def _die(self, error: EngineDeadError) -> None:
        if self.dead is not None:
            return
        log.error("engine dead: %s", error)
        self.dead = error
        self._fail_pending(error)
        self._fail_all(error)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for done, _ in pending.values():
            set_exception(done, error)

