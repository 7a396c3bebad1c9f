"""The EncoderService servicer: protos in, ``EncodePool`` calls, embeddings out; errors reach gRPC status in the shell."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from phalanx._proto import encoder_pb2, encoder_pb2_grpc
from phalanx.common.errors import NotFoundError, ResourceExhaustedError, UnavailableError
from phalanx.common.subjects import check_send_request
from phalanx.common.telemetry import get_tracer
from phalanx.encoder_pool.cost import Modality
from phalanx.encoder_pool.errors import MediaError
from phalanx.encoder_pool.held import DeliveryRates, HeldEmbeddings
from phalanx.encoder_pool.metrics import EncoderMetrics
from phalanx.encoder_pool.pool import EncodedItem, EncodePool, MediaInput, VideoRequest
from phalanx.encoder_pool.video import SamplingStrategy

if TYPE_CHECKING:
    from phalanx.common.channels import ChannelEndpoint

__all__ = ["EncoderServicer", "embedding_to_proto", "encoder_load", "modality_from_proto", "modality_to_proto"]

_MODALITIES: dict[encoder_pb2.Modality, Modality] = {
    encoder_pb2.MODALITY_IMAGE: Modality.IMAGE, encoder_pb2.MODALITY_VIDEO: Modality.VIDEO, encoder_pb2.MODALITY_AUDIO: Modality.AUDIO,
}
_PROTO_MODALITIES = {m: p for p, m in _MODALITIES.items()}
_SAMPLING = {
    encoder_pb2.FRAME_SAMPLING_UNSPECIFIED: SamplingStrategy.UNIFORM, encoder_pb2.FRAME_SAMPLING_UNIFORM: SamplingStrategy.UNIFORM,
    encoder_pb2.FRAME_SAMPLING_KEYFRAME: SamplingStrategy.KEYFRAME, encoder_pb2.FRAME_SAMPLING_FPS: SamplingStrategy.FPS,
}
tracer = get_tracer(__name__)
_CHUNK_BYTES = 1 << 20


def modality_from_proto(value: encoder_pb2.Modality, field: str) -> Modality:
    if value not in _MODALITIES:
        raise MediaError(field, "modality must be IMAGE, VIDEO or AUDIO")
    return _MODALITIES[value]


def modality_to_proto(modality: Modality) -> encoder_pb2.Modality:
    return _PROTO_MODALITIES[modality]


def embedding_to_proto(item: EncodedItem, dtype: torch.dtype, held: HeldEmbeddings | None = None) -> encoder_pb2.Embedding:
    """One item's rows in `dtype` (16-bit halves the bytes on the wire; the worker casts to its model's dtype).

    `held`: direct delivery, the rows stay there under the answered key instead of travelling in the answer.
    """
    values = item.embeddings.to(dtype).contiguous()
    embedding = encoder_pb2.Embedding(
        modality=modality_to_proto(item.modality), rows=values.shape[0], hidden=values.shape[1],
        dtype=str(dtype).removeprefix("torch."), media_hash=item.media_hash, units=item.units,
    )
    if held is None:
        embedding.data = values.view(torch.uint8).numpy().tobytes()
    else:
        embedding.key = held.put(values)
    return embedding


def encoder_load(pool: EncodePool, delivery: DeliveryRates | None = None) -> encoder_pb2.EncoderLoad:
    admission = pool.admission
    return encoder_pb2.EncoderLoad(
        backlog_ms=admission.backlog_ms, inflight_requests=pool.inflight,
        delivery_bytes_per_s=delivery.bytes_per_s if delivery is not None else 0.0,
        delivery_bytes_per_s_by_worker=delivery.by_worker() if delivery is not None else {},
        costs=[
            encoder_pb2.ModalityCost(modality=modality_to_proto(m), unit_ms=pool.cost.unit_ms(m), queued_units=admission.queued[m])
            for m in pool.modalities
        ],
    )


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, pool: EncodePool, metrics: EncoderMetrics, encoder_id: str, *, channels: ChannelEndpoint | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.encoder_id = encoder_id
        self.wire_dtype: torch.dtype = getattr(torch, pool.config.embedding_dtype)
        self.held = HeldEmbeddings(pool.config.hold_s, pool.config.max_held_bytes)
        self.channels = channels  # None: held embeddings go over gRPC only
        self.channel_timeout_s = pool.config.channel_timeout_s
        self._dropped_seen = 0
        self.delivery = DeliveryRates()  # of sends to workers, overall and per worker, advertised for the routers' joint choice

    @property
    def delivery_bytes_per_s(self) -> float:
        return self.delivery.bytes_per_s

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> encoder_pb2.EncodeResponse:
        items = [self._item(i, item) for i, item in enumerate(request.items)]
        labels = [m.modality.value for m in items] or ["image"]
        with tracer.start_as_current_span("encoder.encode", attributes={"request_id": request.request_id, "items": len(items)}):
            started = time.perf_counter()
            try:
                result = await self.pool.encode(items, max_positions=request.max_positions)
            except MediaError:
                self._count(labels, "invalid")
                raise
            except ResourceExhaustedError:
                self._count(labels, "overloaded")
                raise
            except Exception:
                self._count(labels, "error")
                raise
            finally:
                self.metrics.observe_load(self.pool.admission)
        self._count(labels, "ok")
        self.metrics.request_seconds.observe(time.perf_counter() - started)
        held = self.held if request.deliver else None
        response = encoder_pb2.EncodeResponse(
            encoder_id=self.encoder_id, queue_ms=result.queue_ms, encode_ms=result.encode_ms,
            embeddings=[embedding_to_proto(e, self.wire_dtype, held) for e in result.items],
        )
        if request.deliver:
            response.hold_s = self.held.hold_s
            response.channel_endpoint = self.channels.endpoint_id if self.channels is not None else ""
            self.observe_held()
        return response

    # -- direct delivery: a worker fetches what an Encode with `deliver` held --------------------------
    async def SendEmbeddings(
        self, request: encoder_pb2.SendEmbeddingsRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.SendEmbeddingsResponse:
        channels = self.channels
        if channels is None:
            raise UnavailableError("this encoder has no tensor-channel endpoint; use FetchEmbeddings", retry_after_s=0.1)
        check_send_request(request.target_endpoint, request.channel_id, request.timeout_s)
        timeout = request.timeout_s or self.channel_timeout_s
        start = time.perf_counter()
        tensors = self._held_tensors(request.keys)
        # Kept afterwards: the next request's media most likely go to the same few workers.
        async with channels.opened(request.target_endpoint, request.channel_id, reuse=request.reuse_channel, timeout_s=timeout) as channel:
            for tensor in tensors:
                await channel.send(tensor, timeout_s=timeout)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        seconds = time.perf_counter() - start
        self.metrics.sent_bytes.labels(transport="channel").inc(nbytes)
        self.delivery.observe(nbytes, seconds, request.worker_id)
        return encoder_pb2.SendEmbeddingsResponse(bytes=nbytes, seconds=seconds)

    async def FetchEmbeddings(
        self, request: encoder_pb2.FetchEmbeddingsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[encoder_pb2.FetchEmbeddingsResponse]:
        sent = self.metrics.sent_bytes.labels(transport="grpc")
        start, nbytes = time.perf_counter(), 0
        for index, tensor in enumerate(self._held_tensors(request.keys)):
            data = tensor.view(-1).view(torch.uint8).numpy()
            for offset in range(0, len(data), _CHUNK_BYTES):
                piece = data[offset : offset + _CHUNK_BYTES].tobytes()
                yield encoder_pb2.FetchEmbeddingsResponse(piece=index, data=piece)
                sent.inc(len(piece))
                nbytes += len(piece)
        self.delivery.observe(nbytes, time.perf_counter() - start, request.worker_id)

    def _held_tensors(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The tensors held under `keys`, all or NOT_FOUND (held past their hold time, or by an encoder that restarted)."""
        tensors = [self.held.get(key) for key in keys]
        self.observe_held()
        missing = [key for key, t in zip(keys, tensors, strict=True) if t is None]
        if missing:
            raise NotFoundError(f"encoder {self.encoder_id} no longer holds {len(missing)} of {len(keys)} embeddings; encode again")
        return [t for t in tensors if t is not None]

    def observe_held(self) -> None:
        self.held.expire()
        self.metrics.held_results.set(len(self.held))
        self.metrics.held_bytes.set(self.held.nbytes)
        self.metrics.expired.inc(self.held.dropped - self._dropped_seen)
        self._dropped_seen = self.held.dropped

    async def GetLoad(self, request: encoder_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> encoder_pb2.GetLoadResponse:
        return encoder_pb2.GetLoadResponse(load=encoder_load(self.pool, self.delivery))

    def _count(self, modalities: list[str], result: str) -> None:
        for modality in modalities:
            self.metrics.items.labels(modality=modality, result=result).inc()

    @staticmethod
    def _item(index: int, item: encoder_pb2.MediaItem) -> MediaInput:
        modality = modality_from_proto(item.modality, f"items[{index}].modality")
        if item.video.sampling not in _SAMPLING:
            raise MediaError(f"items[{index}].video.sampling", "unknown frame sampling")
        if item.video.max_frames < 0 or item.video.fps < 0:
            raise MediaError(f"items[{index}].video", "max_frames and fps must not be negative")
        video = VideoRequest(_SAMPLING[item.video.sampling], item.video.max_frames, item.video.fps)
        return MediaInput(modality, item.data, video)
