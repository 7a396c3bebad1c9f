"""Runs the engine on its own thread and streams its events to asyncio callers.

The step loop is CPU/GPU-bound; on its own thread it never blocks the event
loop that serves gRPC, publishes NATS events and keeps the etcd lease. torch
releases the GIL inside kernels, so the two overlap.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

from phalanx.common.errors import EngineDeadError
from phalanx.model.kv_cache import KvEvents
from phalanx.worker.checkpointing import CheckpointCapture
from phalanx.worker.engine import Engine, EngineRequest, ParkPick
from phalanx.worker.engine_frontend import EngineFrontend, EngineLoad, EventSink, set_exception, set_result
from phalanx.worker.sequence import FinishReason, TokenEvent

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# -- commands to the engine thread ---------------------------------------------
# Callers on the event loop put these on the command queue; the engine thread applies them between steps, in
# order. A `done` future carries the outcome back (set from the engine thread via call_soon_threadsafe).


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Admit a request; `done` gets its id (or what admission raised), its events then go to `sink`."""

    request: EngineRequest
    sink: EventSink
    done: asyncio.Future


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """End a request with `reason`, freeing its KV; a no-op once it has finished."""

    request_id: str
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class ListCachedBlocks:
    """`done` gets every block in the prefix cache, after the pending KV events went out."""

    done: asyncio.Future


@dataclass(frozen=True, slots=True)
class HandBackAll:
    """End every request but canaries and prefix prefills with HANDED_BACK and its snapshot."""


@dataclass(frozen=True, slots=True)
class Restore:
    """Add a migrated request with its KV; `done` gets the events of the tokens it brought."""

    done: asyncio.Future
    request: EngineRequest
    kv: torch.Tensor | None
    kv_tokens: int
    sink: EventSink


@dataclass(frozen=True, slots=True)
class Park:
    """Stop requests keeping their KV (see Engine.park); `done` gets their HANDED_BACK events."""

    done: asyncio.Future
    request_ids: list[str] | None
    ttl_s: float
    pick: ParkPick | None = None


@dataclass(frozen=True, slots=True)
class ExportKv:
    """`done` gets a parked request's KV of positions [from_token, kv_tokens)."""

    done: asyncio.Future
    request_id: str
    kv_tokens: int
    from_token: int = 0


@dataclass(frozen=True, slots=True)
class Unpark:
    """Free a parked request's KV; `done` gets how many were freed."""

    done: asyncio.Future
    request_id: str


# Commands whose result or exception goes back through their `done` future.
EngineCall = Restore | Park | ExportKv | Unpark
EngineCommand = AddRequest | AbortRequest | ListCachedBlocks | HandBackAll | EngineCall


class AsyncEngine(EngineFrontend):
    """The engine loop on a thread of the worker process (see EngineCoreClient for one in a process of its own)."""

    def __init__(
        self, engine: Engine, *, on_kv_events: Callable[[KvEvents], None] | None = None, checkpoints: CheckpointCapture | None = None
    ) -> None:
        super().__init__()
        self.engine: Engine = engine
        self._on_kv_events = on_kv_events
        # Copies each step's new KV for the checkpoint store (on this thread, between steps).
        self.checkpoints = checkpoints
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def _started_loop(self) -> asyncio.AbstractEventLoop:
        """The loop that start() ran on, where the engine thread hands its results."""
        assert self._loop is not None, "used before start()"
        return self._loop

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="phalanx-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stops the loop thread; idempotent. Requests still open end as ABORTED."""
        self._stopping = True
        self._wake.set()
        self.engine.faults.interrupt()  # a hung engine thread must still end
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._fail_all(None)

    # -- requests -----------------------------------------------------------
    async def _submit(self, request: EngineRequest, sink: EventSink) -> str:
        done = _future()
        self._send(AddRequest(request, sink, done))
        return await done  # raises what add_request raised (queue full, duplicate id)

    def abort(self, request_id: str) -> None:
        """Ends a request with ABORTED (freeing its KV); a no-op once it has finished."""
        self._send(AbortRequest(request_id, FinishReason.ABORTED))

    async def cached_blocks(self) -> list[tuple[int, int, int]]:
        """Every block in the prefix cache, read on the engine thread after its pending KV events went out."""
        done = _future()
        self._send(ListCachedBlocks(done))
        return await done

    async def _restore(self, request: EngineRequest, kv, kv_tokens: int, sink: EventSink) -> list[TokenEvent]:
        return await self._call(Restore(_future(), request, kv, kv_tokens, sink))

    async def park(self, request_ids: list[str] | None, ttl_s: float, pick: ParkPick | None = None) -> list[TokenEvent]:
        """Stops requests keeping their KV (see Engine.park); their logs end with HANDED_BACK."""
        return await self._call(Park(_future(), request_ids, ttl_s, pick))

    async def export_kv(self, request_id: str, kv_tokens: int, from_token: int = 0) -> torch.Tensor:
        return await self._call(ExportKv(_future(), request_id, kv_tokens, from_token))

    async def unpark(self, request_id: str) -> int:
        return await self._call(Unpark(_future(), request_id))

    async def _call(self, command: EngineCall) -> Any:
        """Runs a command on the engine thread between steps; its result or exception comes back here."""
        self._send(command)
        return await command.done

    def hand_back_all(self) -> None:
        """Ends every request but canaries with HANDED_BACK and its snapshot, for a drain past its grace."""
        self._send(HandBackAll())

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)
        self._wake.set()

    def load(self) -> EngineLoad:
        e = self.engine
        return EngineLoad(
            queue_depth=len(e.waiting),
            running_seqs=len(e.running),
            free_blocks=e.kv.num_free_blocks,
            total_blocks=e.kv.num_blocks,
            step_time_ms=self.rates.step_time_ema_s * 1e3,
            prefill_tokens_per_s=self.rates.prefill_rate,
            decode_tokens_per_s=self.rates.decode_rate,
        )

    # -- the engine thread --------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_work():
                    self._capture_checkpoints()
                    self._flush_kv_events()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                events = self.engine.step()
                self.rates.record(self.engine.last_step)
                if events:  # first: the step's tokens should not wait for its checkpoint capture
                    self._started_loop.call_soon_threadsafe(self._dispatch, events)
                self._capture_checkpoints()
                self._flush_kv_events()
        except BaseException as exc:  # the engine is unusable: fail every caller loudly
            log.exception("engine loop died")
            self.dead = exc
            self._started_loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {exc!r}"))

    def _apply_commands(self) -> None:
        events: list[TokenEvent] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            match command:
                case AddRequest(request=request, sink=sink, done=done):
                    try:
                        seq = self.engine.add_request(request)
                    except Exception as exc:  # noqa: BLE001 - reported to that caller only
                        self._started_loop.call_soon_threadsafe(set_exception, done, exc)
                        continue
                    self._started_loop.call_soon_threadsafe(self._admitted, seq.request_id, sink, done, request.canary, seq.replayed)
                case AbortRequest(request_id=request_id, reason=reason):
                    # Its final event also tells the sink, if any still listens, that nothing follows.
                    event = self.engine.abort(request_id, reason)
                    if event is not None:
                        events.append(event)
                case ListCachedBlocks(done=done):
                    self._flush_kv_events()
                    self._started_loop.call_soon_threadsafe(set_result, done, self.engine.cached_blocks())
                case HandBackAll():
                    for request_id, seq in list(self.engine.by_id.items()):
                        if seq.canary or seq.prefix_only:
                            continue  # short; a quarantined worker still runs canaries, and a prefix is no request
                        event = self.engine.abort(request_id, FinishReason.HANDED_BACK)
                        if event is not None:
                            events.append(event)
                case Restore() | Park() | ExportKv() | Unpark():
                    events.extend(self._run_call(command))
        if events:
            self._started_loop.call_soon_threadsafe(self._dispatch, events)

    def _run_call(self, command: EngineCall) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        try:
            match command:
                case Restore(request=request, kv=kv, kv_tokens=kv_tokens, sink=sink):
                    seq = self.engine.restore(request, kv, kv_tokens)
                    result: Any = seq.replayed
                    # Before any event of its next step: the log must start with the tokens it brought.
                    self._started_loop.call_soon_threadsafe(self._register_restored, seq.request_id, sink, seq.replayed)
                case Park(request_ids=request_ids, ttl_s=ttl_s, pick=pick):
                    events = result = self.engine.park(request_ids, ttl_s, pick)
                case ExportKv(request_id=request_id, kv_tokens=kv_tokens, from_token=from_token):
                    result = self.engine.export_kv(request_id, kv_tokens, from_token)
                case Unpark(request_id=request_id):
                    result = self.engine.unpark(request_id)
                case _:
                    assert_never(command)
        except Exception as exc:  # noqa: BLE001 - reported to that caller only
            self._started_loop.call_soon_threadsafe(set_exception, command.done, exc)
            return []
        self._started_loop.call_soon_threadsafe(set_result, command.done, result)
        return events

    def _capture_checkpoints(self) -> None:
        engine = self.engine
        if engine.parked:
            engine.unpark()  # transfers that never came
        if self.checkpoints is not None:
            self.checkpoints.capture(engine)
        else:
            engine.released.clear()

    def _admitted(self, request_id: str, sink: EventSink, done: asyncio.Future, canary: bool, replayed: list[TokenEvent]) -> None:
        self._register(request_id, sink, canary, replayed)
        set_result(done, request_id)

    def _flush_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        if events and self._on_kv_events is not None:
            self._started_loop.call_soon_threadsafe(self._on_kv_events, events)

def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()
