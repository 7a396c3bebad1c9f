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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, assert_never

from phalanx.common.errors import EngineDeadError, UnavailableError
from phalanx.model.kv_cache import KvEvents
from phalanx.worker.checkpointing import CheckpointCapture
from phalanx.worker.engine import Engine, EngineRequest, ParkPick, StepStats
from phalanx.worker.sequence import FinishReason, TokenEvent

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_EMA_ALPHA = 0.1


class EventSink(Protocol):
    """Where a request's events go, on the event loop, in order, until its final one."""

    def put_nowait(self, event: TokenEvent) -> None: ...


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
    """`done` gets a parked request's first `kv_tokens` tokens of KV."""

    done: asyncio.Future
    request_id: str
    kv_tokens: int


@dataclass(frozen=True, slots=True)
class Unpark:
    """Free a parked request's KV; `done` gets how many were freed."""

    done: asyncio.Future
    request_id: str


# Commands whose result or exception goes back through their `done` future.
EngineCall = Restore | Park | ExportKv | Unpark
EngineCommand = AddRequest | AbortRequest | ListCachedBlocks | HandBackAll | EngineCall


@dataclass
class EngineLoad:
    queue_depth: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    step_time_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


class AsyncEngine:
    def __init__(
        self, engine: Engine, *, on_kv_events: Callable[[KvEvents], None] | None = None, checkpoints: CheckpointCapture | None = None
    ) -> None:
        self.engine = engine
        self._on_kv_events = on_kv_events
        # Copies each step's new KV for the checkpoint store (on this thread, between steps).
        self.checkpoints = checkpoints
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, EventSink] = {}
        self._canaries: set[str] = set()  # ids in _streams that are canaries
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        # Draining: no new requests, but canaries still (a quarantine, or on the way to exit).
        self.draining = False
        # Exiting: not even canaries; the worker is going away.
        self.exiting = False
        self.step_time_ema_s = 0.0
        self.prefill_rate = 0.0
        self.decode_rate = 0.0

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
        streams, self._streams = self._streams, {}
        self._canaries.clear()
        for request_id, stream in streams.items():
            stream.put_nowait(TokenEvent(request_id, -1, "", -1, FinishReason.ABORTED))

    # -- requests -----------------------------------------------------------
    async def submit(self, request: EngineRequest, sink: EventSink) -> str:
        """Admits a request and returns its id; its events then go to `sink` until the final one.

        Raises what admission raises (invalid, queue full, draining, engine
        dead). Events arrive whoever reads them; only `abort` stops the request.
        """
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        if self._stopping or self.exiting or (self.draining and not request.canary):
            raise UnavailableError("worker is draining; send the request to another worker", retry_after_s=0.1)
        self.engine.validate(request)  # pure checks; safe off the engine thread
        done = _future()
        self._send(AddRequest(request, sink, done))
        return await done  # raises what add_request raised (queue full, duplicate id)

    def abort(self, request_id: str) -> None:
        """Ends a request with ABORTED (freeing its KV); a no-op once it has finished."""
        self._send(AbortRequest(request_id, FinishReason.ABORTED))

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Yields the request's events until its final one; cancelling the iteration aborts it."""
        stream: asyncio.Queue[TokenEvent] = asyncio.Queue()
        request_id = await self.submit(request, stream)
        finished = False
        try:
            while True:
                event = await stream.get()
                if event.error is not None:
                    raise event.error
                finished = event.finish_reason is not FinishReason.NONE
                yield event
                if finished:
                    return
        finally:
            self._forget(request_id)
            if not finished:
                self.abort(request_id)

    async def cached_blocks(self) -> list[tuple[int, int, int]]:
        """Every block in the prefix cache, read on the engine thread after its pending KV events went out."""
        done = _future()
        self._send(ListCachedBlocks(done))
        return await done

    async def restore(self, request: EngineRequest, kv, kv_tokens: int, sink: EventSink) -> list[TokenEvent]:
        """Adds a migrated request with its KV; returns the events of the tokens it brought (its log starts with them)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        if self._stopping or self.exiting or self.draining:
            raise UnavailableError("worker is draining; restore the request on another worker", retry_after_s=0.1)
        return await self._call(Restore(_future(), request, kv, kv_tokens, sink))

    async def park(self, request_ids: list[str] | None, ttl_s: float, pick: ParkPick | None = None) -> list[TokenEvent]:
        """Stops requests keeping their KV (see Engine.park); their logs end with HANDED_BACK."""
        return await self._call(Park(_future(), request_ids, ttl_s, pick))

    async def export_kv(self, request_id: str, kv_tokens: int) -> torch.Tensor:
        return await self._call(ExportKv(_future(), request_id, kv_tokens))

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

    @property
    def num_requests(self) -> int:
        """Requests in flight, canaries left out."""
        return len(self._streams) - len(self._canaries)

    def load(self) -> EngineLoad:
        e = self.engine
        return EngineLoad(
            queue_depth=len(e.waiting),
            running_seqs=len(e.running),
            free_blocks=e.kv.num_free_blocks,
            total_blocks=e.kv.num_blocks,
            step_time_ms=self.step_time_ema_s * 1e3,
            prefill_tokens_per_s=self.prefill_rate,
            decode_tokens_per_s=self.decode_rate,
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
                self._record(self.engine.last_step)
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
                        self._started_loop.call_soon_threadsafe(_set_exception, done, exc)
                        continue
                    self._started_loop.call_soon_threadsafe(self._register, seq.request_id, sink, done, request.canary, seq.replayed)
                case AbortRequest(request_id=request_id, reason=reason):
                    # Its final event also tells the sink, if any still listens, that nothing follows.
                    event = self.engine.abort(request_id, reason)
                    if event is not None:
                        events.append(event)
                case ListCachedBlocks(done=done):
                    self._flush_kv_events()
                    self._started_loop.call_soon_threadsafe(_set_result, done, self.engine.cached_blocks())
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
                case ExportKv(request_id=request_id, kv_tokens=kv_tokens):
                    result = self.engine.export_kv(request_id, kv_tokens)
                case Unpark(request_id=request_id):
                    result = self.engine.unpark(request_id)
                case _:
                    assert_never(command)
        except Exception as exc:  # noqa: BLE001 - reported to that caller only
            self._started_loop.call_soon_threadsafe(_set_exception, command.done, exc)
            return []
        self._started_loop.call_soon_threadsafe(_set_result, command.done, result)
        return events

    def _capture_checkpoints(self) -> None:
        engine = self.engine
        if engine.parked:
            engine.unpark()  # transfers that never came
        if self.checkpoints is not None:
            self.checkpoints.capture(engine)
        else:
            engine.released.clear()

    def _record(self, stats: StepStats) -> None:
        if stats.seconds <= 0:
            return
        a = _EMA_ALPHA
        self.step_time_ema_s = stats.seconds if self.step_time_ema_s == 0 else (1 - a) * self.step_time_ema_s + a * stats.seconds
        if stats.prefill_tokens:
            rate = stats.prefill_tokens / stats.seconds
            self.prefill_rate = (1 - a) * self.prefill_rate + a * rate if self.prefill_rate else rate
        if stats.decode_tokens:
            rate = stats.decode_tokens / stats.seconds
            self.decode_rate = (1 - a) * self.decode_rate + a * rate if self.decode_rate else rate

    def _flush_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        if events and self._on_kv_events is not None:
            self._started_loop.call_soon_threadsafe(self._on_kv_events, events)

    # -- on the event loop --------------------------------------------------
    def _register(self, request_id: str, sink: EventSink, done: asyncio.Future, canary: bool = False, replayed=()) -> None:
        # Registered even if the caller stopped waiting for admission: the
        # request runs, and its sink (or an abort) decides what becomes of it.
        if replayed:
            self._register_restored(request_id, sink, replayed)
        self._streams[request_id] = sink
        if canary:
            self._canaries.add(request_id)
        if not done.done():
            done.set_result(request_id)

    def _register_restored(self, request_id: str, sink: EventSink, replayed: list[TokenEvent]) -> None:
        self._streams[request_id] = sink
        seed = getattr(sink, "seed", None)
        for event in replayed if seed is None else ():
            sink.put_nowait(event)
        if seed is not None:
            seed(replayed)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        streams = self._streams
        for event in events:
            sink = streams.get(event.request_id)
            if sink is not None:
                if event.finish_reason is not FinishReason.NONE:
                    self._forget(event.request_id)
                sink.put_nowait(event)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._canaries.discard(request_id)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        self._canaries.clear()
        for request_id, stream in streams.items():
            stream.put_nowait(TokenEvent(request_id, -1, "", -1, FinishReason.ABORTED, error=error))


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
