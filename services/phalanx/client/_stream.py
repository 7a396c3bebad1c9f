"""The exactly-once token stream: re-Generate or Resume across breaks, each index yielded once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from phalanx._proto import router_pb2
from phalanx.client._config import RetryPolicy
from phalanx.client._errors import (
    WRONG_PEER,
    DeadlineExceededError,
    PhalanxClientError,
    RequestCancelledError,
    StreamGapError,
    UnavailableError,
    from_rpc_error,
    is_wrong_peer,
    rich_status,
    wrong_peer_error,
)
from phalanx.client._types import FINISH_FROM_PROTO, Chunk, FinishReason

__all__ = ["GenerateStream", "StreamTransport", "is_retryable"]

_CODE = grpc.StatusCode
# Substrings of the messages gRPC gives a call whose transport broke under it.
_TRANSPORT_MARKERS = ("rst_stream", "stream removed", "socket closed", "connection reset", "goaway", "broken pipe", "end of tcp stream")
# The router refused the request outright: there is nothing server-side to cancel.
_REFUSED = frozenset({_CODE.INVALID_ARGUMENT, _CODE.OUT_OF_RANGE, _CODE.UNAUTHENTICATED, _CODE.PERMISSION_DENIED, _CODE.NOT_FOUND})


def is_retryable(error: grpc.RpcError, policy: RetryPolicy, *, before_first_token: bool) -> bool:
    """Whether a broken Generate/Resume call may be retried (by re-Generate or Resume)."""
    code = error.code()
    if code in (_CODE.UNAVAILABLE, _CODE.CANCELLED):
        return True
    if code is _CODE.RESOURCE_EXHAUSTED:
        return policy.retry_overloaded and before_first_token
    if code in (_CODE.INTERNAL, _CODE.UNKNOWN):
        # A router's own INTERNAL carries google.rpc details; a broken transport has none.
        details = (error.details() or "").lower()
        return rich_status(error) is None and any(marker in details for marker in _TRANSPORT_MARKERS)
    return False


class StreamTransport(Protocol):
    """What a GenerateStream needs of its client: open a call, resume at (request_id, tokens_received), and cancel.

    ``stream_opened``/``stream_closed`` bracket the stream's life (so that closing the client cancels
    the streams still open, and one left unfinished is cancelled); a request the caller cancelled
    itself is not resumed; a call that reached a service that is not a router is reported with
    ``drop_wrong_peer`` before the retry. The client's ``Transport`` is the one in use.
    """

    def generate(self, request: router_pb2.GenerateRequest, *, timeout: float | None) -> Any: ...

    def resume(self, request_id: str, tokens_received: int, *, timeout: float | None) -> Any: ...

    def cancelled_by_caller(self, request_id: str) -> bool: ...

    def stream_opened(self, stream: Any) -> None: ...

    def stream_closed(self, stream: Any, *, finished: bool) -> asyncio.Task | None: ...

    def drop_wrong_peer(self, error: grpc.RpcError) -> None: ...


class _State:
    """What the stream and its generator share (the generator must not reference the stream,
    so that dropping the stream lets asyncio finalize the generator, which sends Cancel)."""

    __slots__ = (
        "request_id", "next_index", "resumes", "failures", "worker_id", "finish_reason", "cancel_task", "detached", "__weakref__",
    )

    def __init__(self, request_id: str, next_index: int) -> None:
        self.request_id = request_id
        self.next_index = next_index
        self.resumes = 0
        self.failures = 0
        self.worker_id = ""
        self.finish_reason: FinishReason | None = None
        self.cancel_task: asyncio.Task | None = None
        self.detached = False


class GenerateStream(AsyncIterator[Chunk]):
    """Async iterator of a request's chunks, each index exactly once and in order.

    Leaving early (``break``, task cancellation, ``aclose()``, or the ``async
    with`` block) cancels the request server-side. ``async with`` or
    ``aclose()`` does so deterministically; a plain ``break`` does when the
    stream is garbage-collected (at once in CPython unless still referenced).
    """

    def __init__(
        self,
        transport: StreamTransport,
        *,
        retry: RetryPolicy,
        request_id: str,
        request: router_pb2.GenerateRequest | None,
        start_index: int,
        timeout: float | None,
    ) -> None:
        # Made by Client.generate (request set) and Client.resume (request None).
        self._state = _State(request_id, start_index)
        self._gen = _iterate(transport, retry, self._state, request, timeout)

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def resumes(self) -> int:
        """Calls made so far to recover from a break (re-Generate before the first token, else Resume)."""
        return self._state.resumes

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the request ended, once it has (also when the end came without a token, e.g. ABORTED)."""
        return self._state.finish_reason

    @property
    def tokens_received(self) -> int:
        """The next index this stream expects (its ``tokens_received`` for a Resume)."""
        return self._state.next_index

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._gen.__anext__()

    def detach(self) -> None:
        """Leave the request running server-side when this stream closes unfinished: another process resumes it."""
        self._state.detached = True

    async def aclose(self, *, wait_s: float = 1.0) -> None:
        """Stops the stream; if it was unfinished, waits up to ``wait_s`` for the Cancel to be sent."""
        await self._gen.aclose()
        task = self._state.cancel_task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=wait_s)

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


async def _iterate(
    transport: StreamTransport, retry: RetryPolicy, state: _State, request: router_pb2.GenerateRequest | None, timeout: float | None
):
    deadline = None if timeout is None else time.monotonic() + timeout
    finished = refused = False
    transport.stream_opened(state)
    try:
        while True:
            call = _open(transport, state, request, deadline)
            failure: grpc.aio.AioRpcError | None = None
            try:
                async for response in call:
                    if response.index < 0:
                        # An end without a token (aborted, or the end of a request already fully held).
                        if response.finish_reason:
                            state.finish_reason = FINISH_FROM_PROTO.get(response.finish_reason)
                            finished = True
                            return
                        continue
                    chunk = _accept(state, response)
                    if chunk is None:
                        continue
                    finished = chunk.finish_reason is not None
                    state.finish_reason = chunk.finish_reason
                    yield chunk
                    if finished:
                        return
            except grpc.aio.AioRpcError as error:
                failure = error
            finally:
                call.cancel()
            await _backoff_or_raise(transport, retry, state, failure, deadline)
    except PhalanxClientError as error:
        refused = error.code in _REFUSED or (error.code is _CODE.RESOURCE_EXHAUSTED and state.next_index == 0)
        raise
    finally:
        state.cancel_task = transport.stream_closed(state, finished=finished or refused or state.detached)


def _open(transport: StreamTransport, state: _State, request: router_pb2.GenerateRequest | None, deadline: float | None):
    timeout = None
    if deadline is not None:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise DeadlineExceededError("the call's timeout ran out", code=_CODE.DEADLINE_EXCEEDED, request_id=state.request_id)
    if request is not None and state.next_index == 0:
        return transport.generate(request, timeout=timeout)
    return transport.resume(state.request_id, state.next_index, timeout=timeout)


def _accept(state: _State, response) -> Chunk | None:
    if response.index < state.next_index:
        return None  # already yielded before the break
    if response.index > state.next_index:
        raise StreamGapError(expected_index=state.next_index, received_index=response.index, request_id=state.request_id)
    state.next_index += 1
    state.failures = 0
    state.worker_id = response.worker_id or state.worker_id
    return Chunk.from_proto(response, request_id=state.request_id, worker_id=state.worker_id)


async def _backoff_or_raise(
    transport: StreamTransport, policy: RetryPolicy, state: _State, failure: grpc.aio.AioRpcError | None, deadline: float | None
) -> None:
    if failure is None:
        error: PhalanxClientError = UnavailableError(
            "the stream ended before its final token", code=_CODE.UNAVAILABLE, request_id=state.request_id
        )
        retry = True
    elif transport.cancelled_by_caller(state.request_id):
        error, retry = RequestCancelledError("cancelled by this client", code=_CODE.CANCELLED, request_id=state.request_id), False
    elif is_wrong_peer(failure):
        # The other service ran nothing: a Generate is sent again as it was, a stream with tokens resumes.
        transport.drop_wrong_peer(failure)
        error, retry = wrong_peer_error(failure, request_id=state.request_id), True
    else:
        error = from_rpc_error(failure, request_id=state.request_id)
        retry = is_retryable(failure, policy, before_first_token=state.next_index == 0)
    state.failures += 1
    if not retry or state.failures >= policy.max_attempts:
        raise error from failure
    # A wrong peer's retry hint is for the caller once the retries are spent; the server's own RetryInfo paces them.
    server_delay = 0.0 if error.reason == WRONG_PEER else error.retry_after_s or 0.0
    delay = max(policy.backoff_s(state.failures), server_delay)
    if deadline is not None and time.monotonic() + delay >= deadline:
        raise error from failure
    await asyncio.sleep(delay)
    if deadline is not None and time.monotonic() >= deadline:
        raise error from failure  # the sleep overran the deadline: the failure says more than "the timeout ran out"
    state.resumes += 1
