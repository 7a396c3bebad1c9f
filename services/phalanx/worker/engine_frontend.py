"""What the worker's event loop sees of its engine, wherever the engine loop runs.

Two engines stand behind this front: `AsyncEngine` runs the loop on a thread of the worker process,
`EngineCoreClient` (engine_client.py) in a child process of its own. Both keep the same per-request bookkeeping here,
on the event loop: which sink each open request's events go to, the admission checks, and what a dead loop does to
every open stream (fails it with EngineDeadError). The rest of the worker (server, reports, drain) holds an
`EngineFrontend` and reads engine state through `engine`, an `EngineState`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.common.errors import EngineDeadError, UnavailableError
from phalanx.worker.sequence import FinishReason, TokenEvent

if TYPE_CHECKING:
    import torch

    from phalanx.worker.checkpointing import CheckpointCapture
    from phalanx.worker.config import EngineConfig
    from phalanx.worker.engine import EngineRequest, ParkPick, StepStats
    from phalanx.worker.faults import FaultState

EMA_ALPHA = 0.1


class EventSink(Protocol):
    """Where a request's events go, on the event loop, in order, until its final one."""

    def put_nowait(self, event: TokenEvent) -> None: ...


class EngineState(Protocol):
    """The engine state the worker reads besides requests: the Engine itself, or a view of one in another process."""

    tokenizer: Any
    config: EngineConfig
    model: Any  # model.config (name, sizes) and model.version
    cache: Any  # full_shape, bytes_per_block, data (its dtype) and, for a simulated cache, simulated and empty()
    faults: FaultState
    max_num_seqs: int
    preemptions: int
    prefix_hit_tokens: int
    prompt_tokens_total: int
    generated_tokens_total: int
    tokens_computed: int
    canary_tokens_computed: int
    canaries_total: int

    @property
    def parked(self) -> Any: ...  # truthy while parked KV waits for a transfer

    @property
    def batch_scale(self) -> float: ...

    def set_batch_scale(self, scale: float) -> float: ...

    def validate(self, request: EngineRequest) -> None: ...


@dataclass
class EngineLoad:
    queue_depth: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    step_time_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass
class StepRates:
    """Moving averages of step time and prefill/decode throughput (the load report's figures)."""

    step_time_ema_s: float = 0.0
    prefill_rate: float = 0.0
    decode_rate: float = 0.0

    def record(self, stats: StepStats) -> None:
        if stats.seconds <= 0:
            return
        a = EMA_ALPHA
        self.step_time_ema_s = stats.seconds if self.step_time_ema_s == 0 else (1 - a) * self.step_time_ema_s + a * stats.seconds
        if stats.prefill_tokens:
            rate = stats.prefill_tokens / stats.seconds
            self.prefill_rate = (1 - a) * self.prefill_rate + a * rate if self.prefill_rate else rate
        if stats.decode_tokens:
            rate = stats.decode_tokens / stats.seconds
            self.decode_rate = (1 - a) * self.decode_rate + a * rate if self.decode_rate else rate


class EngineFrontend(ABC):
    """The event-loop side of an engine: open requests' sinks, admission, and failing them all when the loop dies.

    Subclasses carry commands to the engine loop (`_submit`, `abort`, `_restore` …) and hand its outputs back on the
    event loop through `_register`, `_register_restored`, `_dispatch` and `_fail_all`.
    """

    engine: EngineState
    # Copies each step's new KV for the checkpoint store, between steps (None: no checkpointing).
    checkpoints: CheckpointCapture | None

    def __init__(self) -> None:
        self._streams: dict[str, EventSink] = {}
        self._canaries: set[str] = set()  # ids in _streams that are canaries
        self._stopping = False
        self.dead: BaseException | None = None
        # Draining: no new requests, but canaries still (a quarantine, or on the way to exit).
        self.draining = False
        # Exiting: not even canaries; the worker is going away.
        self.exiting = False
        self.rates = StepRates()

    @abstractmethod
    async def start(self) -> None:
        ...

    @abstractmethod
    async def stop(self) -> None:
        ...

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Ends a request with ABORTED (freeing its KV); a no-op once it has finished."""

    @abstractmethod
    def hand_back_all(self) -> None:
        """Ends every request but canaries with HANDED_BACK and its snapshot, for a drain past its grace."""

    @abstractmethod
    async def cached_blocks(self) -> list[tuple[int, int, int]]:
        """Every block in the prefix cache, read by the engine loop after its pending KV events went out."""

    @abstractmethod
    async def park(self, request_ids: list[str] | None, ttl_s: float, pick: ParkPick | None = None) -> list[TokenEvent]:
        """Stops requests keeping their KV (see Engine.park); their logs end with HANDED_BACK."""

    @abstractmethod
    async def export_kv(self, request_id: str, kv_tokens: int, from_token: int = 0) -> torch.Tensor:
        """A parked request's KV of positions [from_token, kv_tokens) (what a target lacks)."""

    @abstractmethod
    async def unpark(self, request_id: str) -> int:
        ...

    @abstractmethod
    def load(self) -> EngineLoad:
        ...

    @abstractmethod
    async def _submit(self, request: EngineRequest, sink: EventSink) -> str:
        ...

    @abstractmethod
    async def _restore(self, request: EngineRequest, kv: Any, kv_tokens: int, sink: EventSink) -> list[TokenEvent]:
        ...

    # -- requests -----------------------------------------------------------
    async def submit(self, request: EngineRequest, sink: EventSink) -> str:
        """Admits a request and returns its id; its events then go to `sink` until the final one.

        Raises what admission raises (invalid, queue full, draining, engine
        dead). Events arrive whoever reads them; only `abort` stops the request.
        """
        self._check_alive()
        if self._stopping or self.exiting or (self.draining and not request.canary):
            raise UnavailableError("worker is draining; send the request to another worker", retry_after_s=0.1)
        self.engine.validate(request)  # pure checks; safe off the engine loop
        return await self._submit(request, sink)  # raises what add_request raised (queue full, duplicate id)

    async def restore(self, request: EngineRequest, kv: Any, kv_tokens: int, sink: EventSink) -> list[TokenEvent]:
        """Adds a migrated request with its KV; returns the events of the tokens it brought (its log starts with them)."""
        self._check_alive()
        if self._stopping or self.exiting or self.draining:
            raise UnavailableError("worker is draining; restore the request on another worker", retry_after_s=0.1)
        return await self._restore(request, kv, kv_tokens, sink)

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

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")

    @property
    def num_requests(self) -> int:
        """Requests in flight, canaries left out."""
        return len(self._streams) - len(self._canaries)

    # -- on the event loop --------------------------------------------------
    def _register(self, request_id: str, sink: EventSink, canary: bool = False, replayed=()) -> None:
        # Registered even if the caller stopped waiting for admission: the
        # request runs, and its sink (or an abort) decides what becomes of it.
        if replayed:
            self._register_restored(request_id, sink, replayed)
        self._streams[request_id] = sink
        if canary:
            self._canaries.add(request_id)

    def _register_restored(self, request_id: str, sink: EventSink, replayed: list[TokenEvent]) -> None:
        self._streams[request_id] = sink
        seed: Callable[[list[TokenEvent]], None] | None = getattr(sink, "seed", None)
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

    def _fail_all(self, error: Exception | None) -> None:
        """Ends every open stream: with `error` (the loop died), or as ABORTED without one (a stop)."""
        streams, self._streams = self._streams, {}
        self._canaries.clear()
        for request_id, stream in streams.items():
            stream.put_nowait(TokenEvent(request_id, -1, "", -1, FinishReason.ABORTED, error=error))


def set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
