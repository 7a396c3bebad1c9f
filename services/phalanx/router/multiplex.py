"""The router's side of WorkerService.Multiplex: one stream to a worker for every request relayed from it.

Each relayed request reads a `MultiplexedCall`, which looks to the relay
like the Generate or Attach call it replaces: an async iterator of chunks
that raises `grpc.aio.AioRpcError` with the call's status (details included)
and has `cancel()`. The worker sends one message per engine step with the
new chunks of all the requests (per-token gRPC work on the
worker's event loop starves its engine thread of the GIL).

A broken stream costs the requests on it nothing while the worker lives:
each subscription opens again once over a new stream, from its next index.
If that fails too (the worker died), it fails with the stream's status,
exactly as a dropped channel breaks every per-request call on it, and the
relay policy decides for each request as before (migrate, fail). A worker that does not know Multiplex
(UNIMPLEMENTED) is read with per-request calls from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import propagate

from phalanx._proto import worker_pb2, worker_pb2_grpc

__all__ = ["MultiplexedCall", "WorkerMultiplexer"]

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_OpenCall = Callable[[worker_pb2_grpc.WorkerServiceStub], grpc.aio.UnaryStreamCall]


class _Stream:
    """One Multiplex call and the subscriptions opened on it."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.outgoing: asyncio.Queue[worker_pb2.MultiplexRequest | None] = asyncio.Queue()
        self.subscriptions: dict[int, MultiplexedCall] = {}
        self.call = stub.Multiplex(self._requests())
        self.reader: asyncio.Task | None = None

    async def _requests(self) -> AsyncIterator[worker_pb2.MultiplexRequest]:
        while (request := await self.outgoing.get()) is not None:
            yield request


class WorkerMultiplexer:
    """The multiplexed stream to one worker, opened on first use and again after it broke."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, worker_address: str, *, enabled: bool = True) -> None:
        self.stub = stub
        self.worker_address = worker_address
        # False: per-request calls (so configured, or the worker answered UNIMPLEMENTED).
        self.enabled = enabled
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self._closed = False

    def generate(self, request: worker_pb2.GenerateRequest) -> MultiplexedCall | grpc.aio.UnaryStreamCall:
        """A Generate of `request`, over the stream where the worker has one."""
        return self._call(worker_pb2.MultiplexRequest(generate=request), lambda stub: stub.Generate(request))

    def attach(self, request: worker_pb2.AttachRequest) -> MultiplexedCall | grpc.aio.UnaryStreamCall:
        """An Attach of `request`, over the stream where the worker has one."""
        return self._call(worker_pb2.MultiplexRequest(attach=request), lambda stub: stub.Attach(request))

    def _call(self, request: worker_pb2.MultiplexRequest, per_request: _OpenCall) -> MultiplexedCall | grpc.aio.UnaryStreamCall:
        if not self.enabled or self._closed:
            return per_request(self.stub)
        call = MultiplexedCall(self, request, per_request)
        self._subscribe(call, request)
        return call

    @property
    def open(self) -> bool:
        """Whether subscriptions may still go over the stream (not closed, not an old worker)."""
        return self.enabled and not self._closed

    def _subscribe(self, call: MultiplexedCall, request: worker_pb2.MultiplexRequest) -> None:
        """Opens `call` on the stream (a new one if there is none), under a new subscription id."""
        stream = self._stream
        if stream is None:
            stream = self._stream = _Stream(self.stub)
            stream.reader = asyncio.get_running_loop().create_task(self._read(stream))
        request.subscription_id = next(self._ids)
        propagate.inject(request.trace_context)
        call._stream, call._id = stream, request.subscription_id
        stream.subscriptions[request.subscription_id] = call
        stream.outgoing.put_nowait(request)

    def _leave(self, stream: _Stream, subscription_id: int) -> None:
        if stream.subscriptions.pop(subscription_id, None) is not None and stream is self._stream:
            stream.outgoing.put_nowait(worker_pb2.MultiplexRequest(subscription_id=subscription_id, close=worker_pb2.MultiplexClose()))

    async def _read(self, stream: _Stream) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for response in stream.call:
                subscriptions = stream.subscriptions
                for chunk in response.chunks:
                    subscription = subscriptions.get(chunk.subscription_id)
                    if subscription is not None:
                        if chunk.closed:
                            del subscriptions[chunk.subscription_id]  # the worker forgot it too
                        subscription.feed(chunk)
            error = _error(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_address} ended the multiplexed stream")
        except grpc.aio.AioRpcError as caught:
            error = caught
        except asyncio.CancelledError:
            # Our close(), or the channel closed under the call: its requests' streams broke either way.
            error = _error(grpc.StatusCode.CANCELLED, f"the multiplexed stream to worker {self.worker_address} was cancelled locally")
        finally:
            if self._stream is stream:
                self._stream = None  # the next subscription opens a new stream
            stream.outgoing.put_nowait(None)
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            log.info("worker %s has no Multiplex; per-request streams from now on", self.worker_address)
            self.enabled = False
        elif stream.subscriptions:
            log.info("the multiplexed stream to worker %s broke (%s): %d requests follow", self.worker_address, error.code().name,
                     len(stream.subscriptions))
        subscriptions, stream.subscriptions = stream.subscriptions, {}
        for subscription in subscriptions.values():
            subscription.fail(error)

    async def close(self) -> None:
        """Breaks the stream (every subscription on it fails CANCELLED) and opens no more; idempotent."""
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.call.cancel()
            if stream.reader is not None:
                await asyncio.gather(stream.reader, return_exceptions=True)


class MultiplexedCall:
    """One request's subscription on a worker's multiplexed stream, read as its own Generate or Attach call.

    When the stream breaks under it, it subscribes again at once over a new stream, from the index after the
    last token it received (a Generate not answered yet is sent again: the worker does not start a request id twice);
    only if that fails too does the relay see the break, and decide (migrate, fail) as for a broken call.
    """

    def __init__(self, multiplexer: WorkerMultiplexer, request: worker_pb2.MultiplexRequest, per_request: _OpenCall) -> None:
        self._multiplexer = multiplexer
        self._request = request
        self._per_request = per_request
        self._stream: _Stream | None = None
        self._id = 0
        self._chunks: deque[worker_pb2.MultiplexChunk] = deque()
        self._error: grpc.aio.AioRpcError | None = None
        self._wake: asyncio.Future | None = None
        self._ended = False
        self._reconnected = False
        self._got_any = False
        self._next_index = -1  # after the last token received (-1: none yet)
        self._fallback: grpc.aio.UnaryStreamCall | None = None

    def feed(self, chunk: worker_pb2.MultiplexChunk) -> None:
        if chunk.HasField("response"):
            self._got_any = True
            if chunk.response.index >= 0:
                self._next_index = chunk.response.index + 1
        self._chunks.append(chunk)
        self._wakeup()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """The stream broke: subscribe again at once (not when next read: the worker's detach grace runs), or end."""
        unimplemented = error.code() == grpc.StatusCode.UNIMPLEMENTED and not self._got_any
        if not unimplemented and not self._reconnected and not self._ended and self._multiplexer.open:
            self._reconnected = True
            # After the chunks received so far, which are still to be read.
            self._multiplexer._subscribe(self, self._again(self._next_index))
            return
        self._error = error
        self._wakeup()

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def cancel(self) -> None:
        """Stops reading (the worker counts one reader less), as cancelling the call would: a reader waiting for
        the next chunk gets CANCELLED at once, and chunks not read yet are dropped."""
        if self._fallback is not None:
            self._fallback.cancel()
        if not self._ended:
            self._ended = True
            assert self._stream is not None
            self._multiplexer._leave(self._stream, self._id)
            self._chunks.clear()
            if self._error is None:
                self._error = _error(grpc.StatusCode.CANCELLED, "the call was cancelled locally")
            self._wakeup()

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        chunks = self._chunks
        while True:
            while chunks:
                chunk = chunks.popleft()
                if chunk.closed:
                    self._ended = True
                if chunk.HasField("response"):
                    yield chunk.response
                if chunk.closed:
                    if chunk.code:
                        raise _error(_CODES.get(chunk.code, grpc.StatusCode.UNKNOWN), chunk.message, chunk.status_details)
                    return
            error = self._error
            if error is not None:
                self._ended = True
                if error.code() == grpc.StatusCode.UNIMPLEMENTED and not self._got_any:
                    # An older worker: the request was never opened there; open it on its own call instead.
                    self._fallback = self._per_request(self._multiplexer.stub)
                    async for response in self._fallback:
                        yield response
                    return
                raise error
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
            self._wake = None

    def _again(self, next_index: int) -> worker_pb2.MultiplexRequest:
        """The subscription to continue from `next_index` (-1: no token yet) after the stream broke."""
        request = self._request
        if request.WhichOneof("action") == "generate":
            if next_index < 0:
                return worker_pb2.MultiplexRequest(generate=request.generate)
            attach = worker_pb2.AttachRequest(request_id=request.generate.request_id, from_index=next_index)
        else:
            attach = worker_pb2.AttachRequest(request_id=request.attach.request_id, from_index=max(next_index, request.attach.from_index))
        return worker_pb2.MultiplexRequest(attach=attach)


def _error(code: grpc.StatusCode, details: str, status_details: bytes = b"") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status_details)) if status_details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)
