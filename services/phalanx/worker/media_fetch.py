"""How a worker fetches a request's media embeddings from the encoder that holds them (direct delivery).

With ``PHALANX_ROUTER_MEDIA_DELIVERY=direct`` the router's request carries
each item's place in the prompt and a ``MediaSource`` (encoder address,
tensor-channel endpoint, key) instead of the rows. Before the request is
submitted the worker pulls them into fresh tensors the way a restore pulls
KV (``kv_fetch.py``, the same ``KvFetchPolicy``): over the channel kept to
that encoder, over a new one above ``channel_min_bytes``, else over the
``FetchEmbeddings`` gRPC stream (and a channel forms in the background for
the next request). A channel that fails falls back to the gRPC stream once.

Any failure (the encoder died, or no longer holds the key) is
FAILED_PRECONDITION with subject ``media.source``: the router's cue to
encode the media again and resend the request; nothing was submitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import grpc

from phalanx._proto import common_pb2, encoder_pb2, encoder_pb2_grpc
from phalanx.common.errors import MEDIA_SOURCE_SUBJECT, FailedPreconditionError, PhalanxError
from phalanx.common.grpc_channels import GrpcChannels
from phalanx.worker.kv_fetch import ChannelFetcher, KvFetch, KvFetchPolicy, KvFetchRoute, _ready, receive_while_sending

if TYPE_CHECKING:
    import torch

    from phalanx.common.channels import ChannelEndpoint
    from phalanx.worker.metrics import WorkerMetrics

__all__ = ["MediaFetcher", "has_sourced_media"]

log = logging.getLogger(__name__)

_MEDIA_DTYPES = ("bfloat16", "float16", "float32")
_BULK_OPTIONS = [("grpc.max_receive_message_length", 8 << 20)]


def has_sourced_media(media: Sequence[common_pb2.MediaEmbedding]) -> bool:
    """Whether any item comes without its rows, to be fetched from an encoder."""
    return any(not m.data and m.source.key for m in media)


@dataclass(frozen=True)
class _Source:
    address: str
    endpoint: str


class MediaFetcher(ChannelFetcher):
    """Pulls media embeddings from encoders; owns its gRPC channels to them and the background channel formations."""

    def __init__(
        self, channels: ChannelEndpoint | None, policy: KvFetchPolicy, metrics: WorkerMetrics, *, timeout_s: float, worker_id: str = "",
    ) -> None:
        super().__init__(channels, policy, warming={})
        self._metrics = metrics
        self._worker_id = worker_id  # named in every fetch: the encoder measures its link to this worker apart
        self._timeout_s = timeout_s
        self._encoders = GrpcChannels(_BULK_OPTIONS)

    async def close(self) -> None:
        for task in list(self._warming.values()):
            task.cancel()
        await asyncio.gather(*self._warming.values(), return_exceptions=True)
        await self._encoders.close()

    async def fetch(self, media: Sequence[common_pb2.MediaEmbedding]) -> dict[int, torch.Tensor]:
        """The rows of every item given by source, by index in `media`; FailedPreconditionError if any cannot come."""
        import torch

        by_source: dict[_Source, list[int]] = {}
        for index, item in enumerate(media):
            if item.data or not item.source.key:
                continue
            if item.dtype not in _MEDIA_DTYPES or item.rows < 1 or item.hidden < 1:
                continue  # media_from_proto refuses it with the field named
            by_source.setdefault(_Source(item.source.encoder_address, item.source.channel_endpoint), []).append(index)
        fetched: dict[int, torch.Tensor] = {}
        for source, indices in by_source.items():
            buffers = [torch.empty(media[i].rows, media[i].hidden, dtype=getattr(torch, media[i].dtype)) for i in indices]
            keys = [media[i].source.key for i in indices]
            await self._fetch_from(source, keys, buffers)
            fetched.update(zip(indices, buffers, strict=True))
        return fetched

    async def _fetch_from(self, source: _Source, keys: list[str], buffers: list[torch.Tensor]) -> None:
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        start = time.perf_counter()
        try:
            route = await self._route_and_fetch(source, keys, buffers, nbytes)
        except (grpc.aio.AioRpcError, PhalanxError, TimeoutError) as error:
            self._metrics.for_worker(self._metrics.media_fetch_failures).inc()
            why = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else str(error)
            raise FailedPreconditionError(
                f"cannot fetch media embeddings from encoder {source.address}: {why}; encode them again",
                subject=MEDIA_SOURCE_SUBJECT, metadata={"encoder_address": source.address},
            ) from error
        transport = "grpc" if route is KvFetchRoute.GRPC else "channel"
        self._metrics.media_fetch_seconds.labels(worker=self._metrics.worker_id, transport=transport).observe(time.perf_counter() - start)
        self._metrics.media_fetch_bytes.labels(worker=self._metrics.worker_id, transport=transport).inc(nbytes)

    async def _route_and_fetch(self, source: _Source, keys: list[str], buffers: list[torch.Tensor], nbytes: int) -> KvFetchRoute:
        stub = encoder_pb2_grpc.EncoderServiceStub(self._encoders.get(source.address))
        timeout = self._timeout_s
        key = f"encoder/{source.endpoint}"
        fetch = KvFetch(nbytes=nbytes, has_endpoint=self._channels is not None and bool(source.endpoint))
        kept = self._kept(key) if self._policy.uses_channels(fetch) else None
        decision = self._policy.decide(replace(fetch, channel_kept=kept is not None))
        if decision.route is not KvFetchRoute.GRPC:
            try:
                if kept is not None:
                    request = self._send_request(keys, kept.channel_id, reuse=True)
                    await receive_while_sending(stub.SendEmbeddings(request, timeout=timeout + 1.0), _ready(kept), buffers, timeout,
                                                keep=partial(self._endpoint().keep, key))
                else:
                    await self._over_new_channel(stub, key, keys, buffers)
                return decision.route
            except (grpc.aio.AioRpcError, PhalanxError, TimeoutError) as error:
                if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.NOT_FOUND and "holds" in (error.details() or ""):
                    raise  # the encoder no longer holds them: gRPC would not find them either
                log.info("media from %s over a tensor channel failed (%s); over gRPC instead", source.address, error)
        await _fetch_embeddings(stub, keys, buffers, timeout, self._worker_id)
        if decision.warm_channel:
            self._warm_channel(stub, key)
        return KvFetchRoute.GRPC

    def _send_request(self, keys: list[str], channel_id: str, *, reuse: bool) -> encoder_pb2.SendEmbeddingsRequest:
        return encoder_pb2.SendEmbeddingsRequest(
            keys=keys, target_endpoint=self._endpoint().endpoint_id, channel_id=channel_id, timeout_s=self._timeout_s, reuse_channel=reuse,
            worker_id=self._worker_id,
        )

    async def _over_new_channel(self, stub: encoder_pb2_grpc.EncoderServiceStub, key: str, keys: list[str], buffers: list[torch.Tensor]) -> None:
        """Forms a channel with the encoder (kept under `key` if it ends well) and receives the rows over it; none: only forms it."""

        def send(channel_id: str) -> Awaitable[encoder_pb2.SendEmbeddingsResponse]:
            return stub.SendEmbeddings(self._send_request(keys, channel_id, reuse=False), timeout=self._timeout_s + 1.0)

        await self._receive_over_new_channel(key, send, buffers, self._timeout_s)

    def _warm_channel(self, stub: encoder_pb2_grpc.EncoderServiceStub, key: str) -> None:
        """Forms a channel to an encoder in the background (an empty SendEmbeddings) and keeps it; one at a time per encoder."""
        self._warm(key, lambda: self._over_new_channel(stub, key, [], []))


async def _fetch_embeddings(
    stub: encoder_pb2_grpc.EncoderServiceStub, keys: list[str], buffers: list[torch.Tensor], timeout: float, worker_id: str = "",
) -> None:
    """The gRPC fallback: each item's bytes in chunks, copied into its buffer."""
    import numpy as np
    import torch

    views = [b.view(-1).view(torch.uint8).numpy() for b in buffers]
    filled = [0] * len(keys)
    async for chunk in stub.FetchEmbeddings(encoder_pb2.FetchEmbeddingsRequest(keys=keys, worker_id=worker_id), timeout=timeout):
        view, start = views[chunk.piece], filled[chunk.piece]
        data = np.frombuffer(chunk.data, dtype=np.uint8)
        view[start : start + len(data)] = data
        filled[chunk.piece] += len(data)
    for key, view, n in zip(keys, views, filled, strict=True):
        if n != view.size:
            raise FailedPreconditionError(f"the encoder sent {n} of {view.size} bytes of {key}", subject=MEDIA_SOURCE_SUBJECT)
