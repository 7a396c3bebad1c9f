"""The asyncio client of RouterService."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Unpack

import grpc

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.client._channel import open_channel
from phalanx.client._config import RetryPolicy, TlsConfig
from phalanx.client._errors import InvalidArgumentError
from phalanx.client._options import GenerateOptions, GenerateParams, with_params
from phalanx.client._stream import GenerateStream
from phalanx.client._transport import ChannelOpener, Transport
from phalanx.client._types import Completion, Media, WorkerInfo, tier_to_proto

__all__ = ["Client"]


class Client:
    """Async client of the Phalanx router: ``async with await Client.connect(target) as client``.

    One client holds one channel to every router replica the target names;
    share it between tasks of the event loop that connected it.
    """

    def __init__(
        self, channel: grpc.aio.Channel | None, stub: Any, *, api_key: str | None, timeout: float | None, retry: RetryPolicy,
        reopen: ChannelOpener | None = None,
    ) -> None:
        # Use Client.connect; this is for the SDK (and tests that bring their own stub).
        self._stub = stub
        self._timeout = timeout
        self._retry = retry
        self._transport = Transport(stub, api_key=api_key, retry=retry, channel=channel, reopen=reopen)
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

        Does not wait for a router to answer: calls retry until one does. A call that reaches another
        service at a router's address (UNIMPLEMENTED) is retried on a fresh channel, which resolves
        ``target`` again.
        ``timeout`` is the default overall deadline of each call in seconds
        (None: none). ``tls`` is True for the system trust store or a
        TlsConfig. ``channel_options`` override the SDK's gRPC channel options.
        """

        def reopen() -> tuple[grpc.aio.Channel, Any]:
            channel = open_channel(target, tls=tls, retry=retry, extra_options=channel_options)
            channel.get_state(try_to_connect=True)  # start connecting now, not on the first call
            return channel, router_pb2_grpc.RouterServiceStub(channel)

        channel, stub = reopen()
        return cls(channel, stub, api_key=api_key, timeout=timeout, retry=retry, reopen=reopen)

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
        return self._stream(request_id, request, 0, timeout)

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
        return self._stream(request_id, None, tokens_received, timeout)

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stops a request server-side; False when no router knew it any more."""
        self._transport.note_cancelled(request_id)
        response = await self._unary("Cancel", router_pb2.CancelRequest(request_id=request_id), timeout, request_id)
        return response.cancelled

    async def list_workers(self, *, timeout: float | None = None) -> list[WorkerInfo]:
        """The workers the router routes to, with their health and load."""
        response = await self._unary("ListWorkers", router_pb2.ListWorkersRequest(), timeout, None)
        return [WorkerInfo.from_proto(worker) for worker in response.workers]

    @property
    def wrong_peers(self) -> int:
        """Calls so far that reached a service that is not a router (each dropped its channel or was retried)."""
        return self._transport.wrong_peers

    async def close(self) -> None:
        """Cancels unfinished streams server-side (best-effort, bounded), then closes the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._transport.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def _stream(self, request_id: str, request: router_pb2.GenerateRequest | None, start_index: int, timeout: float | None) -> GenerateStream:
        return GenerateStream(
            self._transport, retry=self._retry, request_id=request_id, request=request, start_index=start_index,
            timeout=self._deadline(timeout),
        )

    async def _unary(self, method: str, request, timeout: float | None, request_id: str | None):
        return await self._transport.unary(method, request, timeout=self._deadline(timeout), request_id=request_id)


def build_request(
    prompt: str | list[int], options: GenerateOptions, *, request_id: str, media: Sequence[Media] = ()
) -> router_pb2.GenerateRequest:
    """The GenerateRequest of ``Client.generate``'s arguments (the prompt checked here, the options when made)."""
    sampling = common_pb2.SamplingParams(
        temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, max_tokens=options.max_tokens,
        stop_token_ids=list(options.stop_token_ids), stop_strings=list(options.stop), ignore_eos=options.ignore_eos,
        seed=options.seed, logprobs=options.logprobs, top_logprobs=options.top_logprobs, prompt_logprobs=options.prompt_logprobs,
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
