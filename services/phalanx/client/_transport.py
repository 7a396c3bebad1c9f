"""The client's calls to the router and its record of them: what a GenerateStream talks to."""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from typing import Any

import grpc

from phalanx._proto import router_pb2
from phalanx.client._channel import call_metadata
from phalanx.client._errors import from_rpc_error

__all__ = ["CANCEL_TIMEOUT_S", "Transport"]

# A Cancel sent on the caller's way out must never hold the caller up for long.
CANCEL_TIMEOUT_S = 1.0
_REMEMBERED_CANCELS = 4096


class Transport:
    """One client's router stub with its API key, the requests its caller cancelled, and its open streams.

    A stream opens its calls here, asks whether its caller cancelled the request (then it must not
    resume it), and on leaving unfinished has its Cancel sent in the background; ``close`` cancels
    the streams still open and waits (bounded) for those Cancels.
    """

    def __init__(self, stub: Any, *, api_key: str | None) -> None:
        self._stub = stub
        self._api_key = api_key
        self._background: set[asyncio.Task] = set()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # Streams started and not yet ended, including those dropped but not yet finalized.
        self._open_streams: weakref.WeakSet = weakref.WeakSet()
        self._closed = False

    def generate(self, request: router_pb2.GenerateRequest, *, timeout: float | None):
        """A Generate call (the same request_id again: the router streams a request it knows from index 0)."""
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata())

    def resume(self, request_id: str, tokens_received: int, *, timeout: float | None):
        """A Resume call from index ``tokens_received``."""
        request = router_pb2.ResumeRequest(request_id=request_id, tokens_received=tokens_received)
        return self._stub.Resume(request, timeout=timeout, metadata=self._metadata())

    async def unary(self, method: str, request, *, timeout: float | None, request_id: str | None):
        """A unary call by method name; a failure as the SDK's typed error."""
        try:
            return await getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata())
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error, request_id=request_id) from error

    def cancelled_by_caller(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def note_cancelled(self, request_id: str) -> None:
        """The caller cancels ``request_id`` itself: its streams stop rather than resume, and send no Cancel of their own."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > _REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)

    def stream_opened(self, stream: Any) -> None:
        """``stream`` (anything with a ``request_id``, held weakly) is cancelled if the client closes before it ends."""
        self._open_streams.add(stream)

    def stream_closed(self, stream: Any, *, finished: bool) -> asyncio.Task | None:
        """``stream`` ended; an unfinished one has its request cancelled in the background (the task, if one was sent)."""
        self._open_streams.discard(stream)
        return None if finished else self._cancel_soon(stream.request_id)

    async def close(self) -> None:
        """Cancels the streams still open, then waits up to CANCEL_TIMEOUT_S for every Cancel sent. Idempotent."""
        if self._closed:
            return
        # A stream left by `break` just before close is only finalized later: cancel it now.
        for stream in list(self._open_streams):
            if not getattr(stream, "detached", False):  # a detached stream's request is another process's to resume
                self._cancel_soon(stream.request_id)
        self._closed = True
        if self._background:
            await asyncio.wait(set(self._background), timeout=CANCEL_TIMEOUT_S)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self._api_key)

    def _cancel_soon(self, request_id: str) -> asyncio.Task | None:
        """Sends Cancel in the background: the caller leaving must not wait on the router."""
        if self._closed or request_id in self._cancelled:
            return None
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _cancel_quietly(self, request_id: str) -> None:
        request = router_pb2.CancelRequest(request_id=request_id)
        try:
            await self._stub.Cancel(request, timeout=CANCEL_TIMEOUT_S, metadata=self._metadata())
        except Exception:  # noqa: BLE001 - best effort: the router may be gone, which is why we are leaving
            pass
