"""The client's calls to the router and its record of them: what a GenerateStream talks to."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import grpc

from phalanx._proto import router_pb2
from phalanx.client._channel import call_metadata
from phalanx.client._config import RetryPolicy
from phalanx.client._errors import from_rpc_error, is_wrong_peer, wrong_peer_error

__all__ = ["CANCEL_TIMEOUT_S", "REOPEN_INTERVAL_S", "RETIRED_CHANNEL_GRACE_S", "ChannelOpener", "Transport"]

log = logging.getLogger("phalanx.client")

# A Cancel sent on the caller's way out must never hold the caller up for long.
CANCEL_TIMEOUT_S = 1.0
_REMEMBERED_CANCELS = 4096
# The channel is replaced at most this often: the calls of a burst all met the same wrong peer, and on a target of
# several addresses the live channel's round robin moves on to the next one, where a fresh channel would pick at random.
REOPEN_INTERVAL_S = 1.0
# Calls still running on a replaced channel (streams on a real router) get this long before it closes under them;
# a stream cut then resumes on the new channel.
RETIRED_CHANNEL_GRACE_S = 30.0

# Opens a fresh channel to the router target and its stub.
ChannelOpener = Callable[[], tuple[grpc.aio.Channel, Any]]


class Transport:
    """One client's router channel and stub with its API key, the requests its caller cancelled, and its open streams.

    A stream opens its calls here, asks whether its caller cancelled the request (then it must not
    resume it), and on leaving unfinished has its Cancel sent in the background; ``close`` cancels
    the streams still open and waits (bounded) for those Cancels, then closes the channel.
    A call that reached a service that is not a router has the channel replaced (``drop_wrong_peer``).
    """

    def __init__(
        self, stub: Any, *, api_key: str | None, retry: RetryPolicy, channel: grpc.aio.Channel | None = None,
        reopen: ChannelOpener | None = None,
    ) -> None:
        self._channel = channel
        self._stub = stub
        self._reopen = reopen
        self._reopened_at = -math.inf
        self._retiring: set[asyncio.Task] = set()
        self._closing = asyncio.Event()
        self.wrong_peers = 0
        self._retry = retry
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
        """A unary call by method name, tried again on a fresh channel after a wrong peer; a failure as the SDK's typed error.

        (gRPC's own retryPolicy retries UNAVAILABLE; it cannot retry UNIMPLEMENTED on another channel.)
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await getattr(self._stub, method)(request, timeout=remaining, metadata=self._metadata())
            except grpc.aio.AioRpcError as error:
                if not is_wrong_peer(error):
                    raise from_rpc_error(error, request_id=request_id) from error
                self.drop_wrong_peer(error)
                failures += 1
                delay = self._retry.backoff_s(failures)
                if failures >= self._retry.max_attempts or (deadline is not None and time.monotonic() + delay >= deadline):
                    raise wrong_peer_error(error, request_id=request_id) from error
                await asyncio.sleep(delay)

    def drop_wrong_peer(self, error: grpc.RpcError) -> None:
        """A call reached a service that is not a router: later calls go on a fresh channel, which resolves the target
        again (a live channel keeps the addresses it resolved, and its connection to the wrong peer is healthy)."""
        self.wrong_peers += 1
        now = time.monotonic()
        if self._reopen is None or self._closed or now - self._reopened_at < REOPEN_INTERVAL_S:
            log.debug("a router call reached another service (%s); the channel was replaced just now", error.details())
            return
        self._reopened_at = now
        retired = self._channel
        self._channel, self._stub = self._reopen()
        log.warning("a router call reached another service (%s): dropped the channel and opened a fresh one", error.details())
        if retired is not None:
            task = asyncio.get_running_loop().create_task(self._retire(retired))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

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
        self._closing.set()
        if self._background:
            await asyncio.wait(set(self._background), timeout=CANCEL_TIMEOUT_S)
        if self._retiring:
            await asyncio.wait(set(self._retiring))
        if self._channel is not None:
            await self._channel.close()

    async def _retire(self, channel: grpc.aio.Channel) -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), RETIRED_CHANNEL_GRACE_S)
        await channel.close()

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
