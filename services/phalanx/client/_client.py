"""The asyncio client of RouterService."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Unpack

import grpc

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.client._channel import call_metadata, open_channel
from phalanx.client._config import RetryPolicy, TlsConfig
from phalanx.client._errors import InvalidArgumentError, from_rpc_error
from phalanx.client._options import GenerateOptions, GenerateParams, with_params
from phalanx.client._stream import GenerateStream
from phalanx.client._types import Completion, Media, WorkerInfo, tier_to_proto

__all__ = ["Client"]

# A Cancel sent on the caller's way out must never hold the caller up for long.
CANCEL_TIMEOUT_S = 1.0
_REMEMBERED_CANCELS = 4096


class Client:
    """Async client of the Phalanx router: ``async with await Client.connect(target) as client``.

    One client holds one channel to every router replica the target names;
    share it between tasks of the event loop that connected it.
    """

    def __init__(
        self, channel: grpc.aio.Channel | None, stub: Any, *, api_key: str | None, timeout: float | None, retry: RetryPolicy
    ) -> None:
        # Use Client.connect; this is for the SDK (and tests that bring their own stub).
        self._channel = channel
        self._stub = stub
        self._api_key = api_key
        self._timeout = timeout
        self._retry = retry
        self._background: set[asyncio.Task] = set()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # Streams started and not yet ended, including those dropped but not yet finalized.
        self._open_streams: weakref.WeakSet = weakref.WeakSet()
        self._closed = False

    @classmethod
    async def connect(
        cls,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool | TlsConfig | None = None,
        timeout: float | None = None,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        channel_options: Sequence[tuple[str, Any]] | None = None,
    ) -> Client:
        """Opens a channel to ``target`` ("host:port", or "ipv4:h1:p1,h2:p2" for several replicas).

        Does not wait for a router to answer: calls retry until one does.
        ``timeout`` is the default overall deadline of each call in seconds
        (None: none). ``tls`` is True for the system trust store or a
        TlsConfig. ``channel_options`` override the SDK's gRPC channel options.
        """
        channel = open_channel(target, tls=tls, retry=retry, extra_options=channel_options)
        channel.get_state(try_to_connect=True)  # start connecting now, not on the first call
        return cls(channel, router_pb2_grpc.RouterServiceStub(channel), api_key=api_key, timeout=timeout, retry=retry)

    def generate(
        self,
        prompt: str | list[int],
        *,
        options: GenerateOptions | None = None,
        media: Sequence[Media] = (),
        request_id: str | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> GenerateStream:
        """Streams the tokens of a new request, exactly once each, across router failures.

        ``prompt`` is text or token ids; ``media`` its images, video or audio, placed at its ``<media>`` markers
        (media first when it has none). ``options`` (a GenerateOptions) says how to generate; its fields may
        also be given as keyword arguments (``max_tokens=64``), which override those of ``options``.
        ``request_id`` defaults to a fresh uuid4 hex (it is what makes retries idempotent). ``timeout``
        (seconds) bounds the whole stream, retries included.
        """
        request_id = request_id or uuid.uuid4().hex
        request = build_request(prompt, with_params(options, params), request_id=request_id, media=media)
        return GenerateStream(self, request_id=request_id, request=request, start_index=0, timeout=self._deadline(timeout))

    async def complete(
        self,
        prompt: str | list[int],
        *,
        options: GenerateOptions | None = None,
        media: Sequence[Media] = (),
        request_id: str | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        """Generates to the end and returns the whole text (same arguments as ``generate``)."""
        stream = self.generate(prompt, options=options, media=media, request_id=request_id, timeout=timeout, **params)
        async with stream:
            chunks = [chunk async for chunk in stream]
        return Completion.from_chunks(stream.request_id, chunks, resumes=stream.resumes, finish_reason=stream.finish_reason)

    def resume(self, request_id: str, tokens_received: int, *, timeout: float | None = None) -> GenerateStream:
        """Continues a request from index ``tokens_received`` (e.g. in another process)."""
        if tokens_received < 0:
            raise InvalidArgumentError("must not be negative", violations=[("tokens_received", "must not be negative")])
        return GenerateStream(self, request_id=request_id, request=None, start_index=tokens_received, timeout=self._deadline(timeout))

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stops a request server-side; False when no router knew it any more."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > _REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)
        response = await self._unary(self._stub.Cancel, router_pb2.CancelRequest(request_id=request_id), timeout, request_id)
        return response.cancelled

    async def list_workers(self, *, timeout: float | None = None) -> list[WorkerInfo]:
        """The workers the router routes to, with their health and load."""
        response = await self._unary(self._stub.ListWorkers, router_pb2.ListWorkersRequest(), timeout, None)
        return [WorkerInfo.from_proto(worker) for worker in response.workers]

    async def close(self) -> None:
        """Cancels unfinished streams server-side (best-effort, bounded), then closes the channel. Idempotent."""
        if self._closed:
            return
        # A stream left by `break` just before close is only finalized later: cancel it now.
        for state in list(self._open_streams):
            self._cancel_soon(state.request_id)
        self._closed = True
        if self._background:
            await asyncio.wait(set(self._background), timeout=CANCEL_TIMEOUT_S)
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self._api_key)

    async def _unary(self, method, request, timeout: float | None, request_id: str | None):
        try:
            return await method(request, timeout=self._deadline(timeout), metadata=self._metadata())
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error, request_id=request_id) from error

    def _cancelled_by_caller(self, request_id: str) -> bool:
        return request_id in self._cancelled

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


def build_request(
    prompt: str | list[int], options: GenerateOptions, *, request_id: str, media: Sequence[Media] = ()
) -> router_pb2.GenerateRequest:
    """The GenerateRequest of ``Client.generate``'s arguments (the prompt checked here, the options when made)."""
    sampling = common_pb2.SamplingParams(
        temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, max_tokens=options.max_tokens,
        stop_token_ids=list(options.stop_token_ids), stop_strings=list(options.stop), ignore_eos=options.ignore_eos,
        seed=options.seed,
    )
    request = router_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling, tier=tier_to_proto(options.tier), tenant=options.tenant or ""
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.tokens.ids.extend(prompt)
    else:
        raise InvalidArgumentError("prompt must be a str or a list of token ids", violations=[("prompt", "must be str or list[int]")])
    request.media.extend(m.to_proto() for m in media)
    return request
