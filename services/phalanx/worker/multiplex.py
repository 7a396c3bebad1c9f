"""The worker's side of WorkerService.Multiplex: many requests' Generate and Attach over one stream.

A per-request stream costs the worker's event loop, per token and request,
a reader wakeup, a response message and a gRPC write (with the server
interceptors around it); at 16 streams that loop competes with the
Python-bound engine thread for the GIL on every step. Here the
request logs (streams.py) tell the stream when they change, and one
response per batch of changes (in practice one per engine step) carries the
new chunks of every subscription, read with a LogCursor: no task and no
write per token.

A subscription is its Generate or Attach call in every other way: the same
admission, the same chunks and the same ending (status code and details),
and it counts as a reader of its log while it is open, so closing it (or
losing the whole stream) detaches the request as leaving that call would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode

from phalanx._proto import worker_pb2
from phalanx.common.errors import PhalanxError
from phalanx.common.grpc_status import to_status
from phalanx.worker.streams import LogCursor, RequestLog

if TYPE_CHECKING:
    from phalanx.worker.server import WorkerServicer

__all__ = ["MultiplexedStream"]

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# The span of a multiplexed request carries the name its own call's span has, so that traces read the same.
GENERATE_SPAN = "/phalanx.worker.v1.WorkerService/Generate"
ATTACH_SPAN = "/phalanx.worker.v1.WorkerService/Attach"


class _Subscription:
    """One request read over the stream: its log, where this reader is, and the reader count it holds."""

    def __init__(self, subscription_id: int, span: Span) -> None:
        self.id = subscription_id
        self.span = span
        self.log: RequestLog | None = None
        self.cursor: LogCursor | None = None
        self.reading: contextlib.AbstractContextManager | None = None
        self.on_change: Callable[[], None] = lambda: None


class MultiplexedStream:
    """One Multiplex call: its subscriptions by id, and which of them have something new to send."""

    def __init__(self, servicer: WorkerServicer) -> None:
        self._servicer = servicer
        self._subscriptions: dict[int, _Subscription] = {}
        self._opening: dict[int, asyncio.Task] = {}
        # Subscriptions with new events (a dict: ordered, each once), and chunks ready as they are (closing errors).
        self._changed: dict[int, _Subscription] = {}
        self._ready: list[worker_pb2.MultiplexChunk] = []
        self._wake = asyncio.Event()
        self._caller_done = False
        self._writing = False

    @property
    def owes_chunks(self) -> bool:
        """Something is still to be sent: a subscription open or opening, new chunks, or a response being written."""
        return bool(self._subscriptions or self._opening or self._changed or self._ready or self._writing)

    async def serve(self, requests: AsyncIterator[worker_pb2.MultiplexRequest]) -> AsyncIterator[worker_pb2.MultiplexResponse]:
        """The responses of the stream; ends when the caller has closed its side and no subscription is left."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                if not self._changed and not self._ready:
                    if self._caller_done and not self._subscriptions and not self._opening:
                        break
                    # No await between the checks above and the wait: no wakeup is missed.
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._writing = True
                try:
                    yield self._collect()
                finally:
                    self._writing = False
        finally:
            reader.cancel()
            for task in list(self._opening.values()):
                task.cancel()
            for subscription in list(self._subscriptions.values()):
                self._leave(subscription)
            await asyncio.gather(reader, *self._opening.values(), return_exceptions=True)

    async def _read(self, requests: AsyncIterator[worker_pb2.MultiplexRequest]) -> None:
        try:
            async for request in requests:
                which = request.WhichOneof("action")
                if which == "close":
                    self._close(request.subscription_id)
                elif which in ("generate", "attach"):
                    self._open(request, which)
        except grpc.aio.AioRpcError:
            pass  # the caller went away; the finally of serve() leaves every subscription
        finally:
            self._caller_done = True
            self._wake.set()

    # -- subscriptions -------------------------------------------------------------
    def _open(self, request: worker_pb2.MultiplexRequest, which: str) -> None:
        subscription_id = request.subscription_id
        if subscription_id in self._subscriptions or subscription_id in self._opening:
            return  # a caller's bug; the first one stands
        parent = propagate.extract(dict(request.trace_context))
        span = tracer.start_span(GENERATE_SPAN if which == "generate" else ATTACH_SPAN, context=parent)
        span.set_attribute("phalanx.multiplexed", True)
        subscription = _Subscription(subscription_id, span)
        task = asyncio.create_task(self._start(subscription, request, which))
        self._opening[subscription_id] = task
        task.add_done_callback(lambda _: self._opening.pop(subscription_id, None))

    async def _start(self, subscription: _Subscription, request: worker_pb2.MultiplexRequest, which: str) -> None:
        """Admits a Generate (or finds an Attach's log) as its own call would, then reads the log from its index."""
        servicer = self._servicer
        streams = servicer.streams
        try:
            if which == "generate":
                fetched = await servicer.fetch_media(request.generate)
                log, engine_request = servicer.generate_log(request.generate, fetched)
                from_index = log.first_index
            else:
                log, engine_request = servicer.attach_log(request.attach), None
                from_index = request.attach.from_index
            subscription.log = log
            subscription.reading = streams.reader(log)
            subscription.reading.__enter__()
            if engine_request is not None:
                await servicer.submit(servicer.engine, engine_request, log)
            subscription.cursor = log.cursor(from_index)
        except asyncio.CancelledError:
            self._leave(subscription)
            raise
        except Exception as exc:  # noqa: BLE001 - it ends this subscription, as it would end its own call
            self._leave(subscription)
            self._ready.append(_closing(subscription.id, exc))
            self._wake.set()
            return
        subscription.on_change = lambda: self._mark(subscription)
        log.watch(subscription.on_change)
        self._subscriptions[subscription.id] = subscription
        self._mark(subscription)  # what the log already has

    def _mark(self, subscription: _Subscription) -> None:
        self._changed[subscription.id] = subscription
        self._wake.set()

    def _close(self, subscription_id: int) -> None:
        task = self._opening.get(subscription_id)
        if task is not None:
            task.cancel()
        subscription = self._subscriptions.get(subscription_id)
        if subscription is not None:
            self._leave(subscription)

    def _leave(self, subscription: _Subscription, error: BaseException | None = None) -> None:
        """Stops reading: the log forgets this reader (the last one out starts the request's detach grace)."""
        self._subscriptions.pop(subscription.id, None)
        self._changed.pop(subscription.id, None)
        if subscription.log is not None:
            subscription.log.unwatch(subscription.on_change)
        reading, subscription.reading = subscription.reading, None
        if reading is not None:
            reading.__exit__(None, None, None)
        if error is not None:
            subscription.span.set_status(Status(StatusCode.ERROR, str(error)))
        subscription.span.end()

    def _collect(self) -> worker_pb2.MultiplexResponse:
        """One response with every new chunk; filled in place (constructing each chunk and copying it in costs 3x)."""
        response = worker_pb2.MultiplexResponse()
        ready, self._ready = self._ready, []
        response.chunks.extend(ready)
        changed, self._changed = self._changed, {}
        add = response.chunks.add
        fill = self._servicer.fill_chunk
        for subscription in changed.values():
            assert subscription.cursor is not None  # only admitted subscriptions watch their log
            events, error = subscription.cursor.take()
            chunk = None
            for event in events:
                chunk = add(subscription_id=subscription.id)
                fill(chunk.response, event)
            if error is not None:
                response.chunks.append(_closing(subscription.id, error))
                self._leave(subscription, error)
            elif subscription.cursor.done:
                if chunk is None:
                    chunk = add(subscription_id=subscription.id)
                chunk.closed = True
                self._leave(subscription)
        return response


def _closing(subscription_id: int, error: BaseException) -> worker_pb2.MultiplexChunk:
    """The chunk that ends a subscription with the status its own call would have ended with."""
    if isinstance(error, PhalanxError):
        status = to_status(error)
        details = next((v for k, v in status.trailing_metadata or () if k == "grpc-status-details-bin"), b"")
        return worker_pb2.MultiplexChunk(
            subscription_id=subscription_id, closed=True, code=status.code.value[0], message=status.details, status_details=details,
        )
    logger.error("multiplexed request failed", exc_info=error)
    # What grpc.aio answers for a handler's unexpected exception.
    return worker_pb2.MultiplexChunk(
        subscription_id=subscription_id, closed=True, code=grpc.StatusCode.UNKNOWN.value[0], message=f"Unexpected {type(error)}: {error}",
    )
