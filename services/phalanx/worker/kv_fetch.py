"""How a restoring worker fetches KV from its source: a kept tensor channel, a new one, or gRPC.

Forming a channel and tearing it down took longer than sending 4 MB of KV
(about 20 ms against 2), so both ends keep it for the next restore. On a
host that a failure has just loaded, forming one took 300 ms against
15-80 ms for a few MB over gRPC: without a kept channel, KV under
``channel_min_bytes`` goes over gRPC, and a channel forms in the background
for the next transfer from that source (4 MB: 7 ms over a kept channel,
14 ms over gRPC).

``KvFetchPolicy`` makes that choice from facts alone (no I/O); ``KvFetcher``
carries it out. ``ChannelFetcher`` is what it shares with the worker's media
fetch (``media_fetch.py``, which pulls embeddings from an encoder the same
way): the kept channel by key, a new channel accepted while the source
sends, and the background formation of one.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from phalanx._proto import migration_pb2, migration_pb2_grpc
from phalanx.common.errors import PhalanxError, UnavailableError

if TYPE_CHECKING:
    import torch

    from phalanx.common.channels import ChannelEndpoint, TensorChannel

__all__ = ["ChannelFetcher", "KvFetch", "KvFetchDecision", "KvFetchPolicy", "KvFetchRoute", "KvFetcher", "receive_while_sending"]

logger = logging.getLogger(__name__)

Pieces = Sequence[migration_pb2.KvPiece]


class KvFetchRoute(enum.Enum):
    """How the KV of one restore comes over."""

    KEPT_CHANNEL = "kept_channel"  # the channel kept from the last transfer from this source
    NEW_CHANNEL = "new_channel"  # a channel formed for this transfer, kept afterwards
    GRPC = "grpc"  # FetchKv: chunks of one gRPC stream


@dataclass(frozen=True)
class KvFetch:
    """What is known when a restore needs KV from a source."""

    nbytes: int
    grpc_requested: bool = False  # the migration asked for gRPC
    has_endpoint: bool = True  # this worker has a tensor-channel endpoint
    channel_kept: bool = False  # a channel to the source is kept from the last transfer


@dataclass(frozen=True)
class KvFetchDecision:
    route: KvFetchRoute
    # After a gRPC fetch: form a channel to the source in the background, for the next restore from it.
    warm_channel: bool = False


class KvFetchPolicy:
    """Picks the route for a fetch; pure, so that unit tests call it directly."""

    def __init__(self, channel_min_bytes: int) -> None:
        if channel_min_bytes < 0:
            raise ValueError("channel_min_bytes must be at least 0")
        self.channel_min_bytes = channel_min_bytes

    def uses_channels(self, fetch: KvFetch) -> bool:
        """Whether a tensor channel may carry it at all (else ``channel_kept`` does not matter)."""
        return fetch.has_endpoint and not fetch.grpc_requested

    def decide(self, fetch: KvFetch) -> KvFetchDecision:
        if not self.uses_channels(fetch):
            return KvFetchDecision(KvFetchRoute.GRPC)
        if fetch.channel_kept:
            return KvFetchDecision(KvFetchRoute.KEPT_CHANNEL)
        if fetch.nbytes < self.channel_min_bytes:
            return KvFetchDecision(KvFetchRoute.GRPC, warm_channel=True)
        return KvFetchDecision(KvFetchRoute.NEW_CHANNEL)

    def after_kept_channel_lost(self, fetch: KvFetch) -> KvFetchDecision:
        """The source no longer keeps its end of the kept channel (it restarted, or closed it idle)."""
        return self.decide(replace(fetch, channel_kept=False))


class ChannelFetcher:
    """What a fetch over tensor channels needs whatever it fetches (KV from a KvSource, embeddings from an encoder):
    the channel kept to a source under its key, a new channel formed with a source that sends into it, and such a
    formation in the background for the next fetch.

    ``warming`` holds the background channel formations by source key, one at
    a time per source; its owner cancels them when it closes.
    """

    def __init__(self, channels: ChannelEndpoint | None, policy: KvFetchPolicy, *, warming: dict[str, asyncio.Task]) -> None:
        self._channels = channels
        self._policy = policy
        self._warming = warming

    def _endpoint(self) -> ChannelEndpoint:
        assert self._channels is not None, "the policy routes over a channel only with an endpoint"
        return self._channels

    def _kept(self, key: str) -> TensorChannel | None:
        """The channel kept under `key`, handed over (no longer kept until it is kept again); None if none is."""
        from phalanx.common.channels import ChannelNotKeptError

        try:
            return self._endpoint().reuse(key)
        except ChannelNotKeptError:
            return None

    async def _receive_over_new_channel(
        self, key: str, send: Callable[[str], Awaitable[Any]], buffers: Sequence[torch.Tensor], timeout: float
    ) -> None:
        """Forms a channel with the source (kept under `key` if it ends well): `send(channel_id)` is the source's send
        call into it, received into `buffers` here; none: only forms it."""
        channels = self._endpoint()
        channel_id = uuid.uuid4().hex
        accepted = asyncio.ensure_future(channels.accept(channel_id, timeout_s=timeout))
        try:
            await receive_while_sending(send(channel_id), accepted, buffers, timeout, keep=partial(channels.keep, key))
        finally:
            accepted.cancel()

    def _warm(self, key: str, form: Callable[[], Awaitable[None]]) -> None:
        """Runs `form` (a channel formation with nothing to send) in the background; one at a time per key."""
        if key in self._warming or self._channels is None:
            return

        async def warm() -> None:
            try:
                await form()
            except (grpc.aio.AioRpcError, PhalanxError) as error:
                logger.info("could not form a tensor channel for %s ahead of time: %s", key, error)

        warming = self._warming
        task = warming[key] = asyncio.ensure_future(warm())
        task.add_done_callback(lambda _t: warming.pop(key, None))


class KvFetcher(ChannelFetcher):
    """Receives KV pieces from a KvSource the way ``KvFetchPolicy`` decides."""

    async def fetch(
        self,
        stub: migration_pb2_grpc.KvSourceStub,
        source: str,
        pieces: Pieces,
        buffers: dict[str, torch.Tensor],
        timeout: float,
        *,
        grpc_requested: bool,
    ) -> KvFetchRoute:
        """Fills ``buffers`` with the pieces from ``source``; returns the route they came by."""
        key = f"kv-source/{source}"
        fetch = KvFetch(nbytes=sum(b.nbytes for b in buffers.values()), grpc_requested=grpc_requested, has_endpoint=self._channels is not None)
        # reuse() hands the kept channel over: ask only when one could carry this fetch.
        kept = self._kept(key) if self._policy.uses_channels(fetch) else None
        fetch = replace(fetch, channel_kept=kept is not None)
        decision = self._policy.decide(fetch)
        if decision.route is KvFetchRoute.KEPT_CHANNEL:
            assert kept is not None
            try:
                await self._over_kept_channel(stub, key, kept, pieces, buffers, timeout)
                return decision.route
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                # The source no longer keeps its end (it restarted, or closed it idle).
            decision = self._policy.after_kept_channel_lost(fetch)
        if decision.route is KvFetchRoute.GRPC:
            await _fetch_kv(stub, pieces, buffers, timeout)
            if decision.warm_channel:
                self._warm_channel(stub, key, timeout)
        else:
            await self._over_new_channel(stub, key, pieces, buffers, timeout)
        return decision.route

    async def _over_kept_channel(
        self, stub: migration_pb2_grpc.KvSourceStub, key: str, kept: TensorChannel, pieces: Pieces, buffers: dict[str, torch.Tensor], timeout: float
    ) -> None:
        channels = self._endpoint()
        request = migration_pb2.SendKvRequest(
            pieces=pieces, target_endpoint=channels.endpoint_id, channel_id=kept.channel_id, timeout_s=timeout, reuse_channel=True
        )
        await _transfer_kv(stub, request, _ready(kept), pieces, buffers, timeout, keep=partial(channels.keep, key))

    async def _over_new_channel(
        self, stub: migration_pb2_grpc.KvSourceStub, key: str, pieces: Pieces, buffers: dict[str, torch.Tensor], timeout: float
    ) -> None:
        """Forms a channel with the source (kept under `key` if it ends well) and receives the pieces over it; none: only forms it."""
        target = self._endpoint().endpoint_id

        def send(channel_id: str) -> Awaitable[Any]:
            request = migration_pb2.SendKvRequest(pieces=pieces, target_endpoint=target, channel_id=channel_id, timeout_s=timeout)
            return stub.SendKv(request, timeout=timeout + 1.0)

        await self._receive_over_new_channel(key, send, [buffers[p.request_id] for p in pieces], timeout)

    def _warm_channel(self, stub: migration_pb2_grpc.KvSourceStub, key: str, timeout: float) -> None:
        """Forms a channel to a KV source in the background (an empty SendKv) and keeps it; one at a time per source."""
        self._warm(key, lambda: self._over_new_channel(stub, key, [], {}, timeout))


async def _transfer_kv(
    stub: migration_pb2_grpc.KvSourceStub,
    request: migration_pb2.SendKvRequest,
    channel_ready: asyncio.Future[TensorChannel],
    pieces: Pieces,
    buffers: dict[str, torch.Tensor],
    timeout: float,
    *,
    keep: Callable[[TensorChannel], None],
) -> None:
    """SendKv on the source while receiving its pieces here (see ``receive_while_sending``)."""
    send = stub.SendKv(request, timeout=timeout + 1.0)
    await receive_while_sending(send, channel_ready, [buffers[p.request_id] for p in pieces], timeout, keep=keep)


async def receive_while_sending(
    send: Awaitable[Any],
    channel_ready: asyncio.Future[TensorChannel],
    buffers: Sequence[torch.Tensor],
    timeout: float,
    *,
    keep: Callable[[TensorChannel], None],
) -> None:
    """The source's send call (SendKv, SendEmbeddings) while receiving into `buffers` in order here; the channel goes to
    `keep` if every tensor arrived, else closed.

    A failure on either side ends the other at once (a channel the source never
    opened must not hold a receive until the timeout).
    """

    async def receive() -> None:
        channel = await channel_ready
        try:
            for buffer in buffers:
                await channel.recv_into(buffer, timeout_s=timeout)
        except BaseException:
            await channel.close()
            raise
        keep(channel)

    sending = asyncio.ensure_future(send)
    received = asyncio.ensure_future(receive())
    try:
        await asyncio.gather(sending, received)
    except BaseException:
        sending.cancel()
        received.cancel()
        await asyncio.gather(sending, received, return_exceptions=True)
        raise


def _ready(value: TensorChannel) -> asyncio.Future[TensorChannel]:
    future: asyncio.Future[TensorChannel] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def _fetch_kv(stub: migration_pb2_grpc.KvSourceStub, pieces: Pieces, buffers: dict[str, torch.Tensor], timeout: float) -> None:
    """The gRPC fallback: each piece's bytes in chunks, copied into its buffer."""
    views = [_byte_view(buffers[p.request_id]) for p in pieces]
    filled = [0] * len(pieces)
    async for chunk in stub.FetchKv(migration_pb2.FetchKvRequest(pieces=pieces), timeout=timeout):
        view, start = views[chunk.piece], filled[chunk.piece]
        data = np.frombuffer(chunk.data, dtype=np.uint8)
        view[start : start + len(data)] = data
        filled[chunk.piece] += len(data)
    for piece, view, n in zip(pieces, views, filled, strict=True):
        if n != view.size:
            raise UnavailableError(f"the KV source sent {n} of {view.size} bytes of {piece.request_id}", retry_after_s=0.1)


def _byte_view(buffer: torch.Tensor | Any) -> np.ndarray:
    """A contiguous buffer's bytes as a writable numpy view: a torch tensor (any dtype, bfloat16 too, through a uint8
    view), or a numpy array (a simulated worker's KV, which has no torch)."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    import torch

    return buffer.view(-1).view(torch.uint8).numpy()
