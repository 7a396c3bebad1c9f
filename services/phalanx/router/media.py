"""Media at the router: where the prompt's media go, which encoder encodes them, and the Encode call with failover.

``EncoderSet`` (no I/O) keeps the encoders' registrations (their backlog and
learned unit costs ride in them) and orders encoders by estimated time to
finish: backlog + this request's units x their unit cost. ``MediaEncoder``
calls them in that order: an encoder that is gone, overloaded or too slow
costs a retry on the next one (media are pure inputs: encoding again gives
the same rows); bad media are the caller's error and come back as
INVALID_ARGUMENT at once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from phalanx._proto import common_pb2, encoder_pb2, encoder_pb2_grpc, router_pb2
from phalanx.common.block_hash import MediaSpan
from phalanx.common.errors import MEDIA_SOURCE_SUBJECT, InvalidRequestError, UnavailableError
from phalanx.common.grpc_channels import GrpcChannels
from phalanx.router.joint import EncoderEstimate, embedding_bytes, embedding_transfer_s

__all__ = [
    "EmbeddingCache", "Encoded", "EncoderSet", "HandleCache", "MediaEncoder", "estimated_units", "media_fetch_failed", "split_on_markers",
    "usable_for",
]

log = logging.getLogger(__name__)

_KINDS = {
    router_pb2.MEDIA_KIND_IMAGE: encoder_pb2.MODALITY_IMAGE,
    router_pb2.MEDIA_KIND_VIDEO: encoder_pb2.MODALITY_VIDEO,
    router_pb2.MEDIA_KIND_AUDIO: encoder_pb2.MODALITY_AUDIO,
}
# Frames an encoder takes from a video by default (EncoderPoolConfig.default_video_frames): the estimate before decoding.
_VIDEO_FRAMES_ESTIMATE = 8
_WAV_BYTES_PER_CHUNK = 16_000 * 2 * 30  # 30 s of 16 kHz 16-bit mono
# Worth another encoder: it is gone, refusing work, or too slow; anything else is the request's own problem.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def split_on_markers(text: str, marker: str) -> list[str]:
    """The text pieces between media markers: n markers give n + 1 pieces."""
    return text.split(marker)


def estimated_units(item: router_pb2.MediaInput) -> int:
    """Units the item will take before it is decoded: 1 per image, the default frames per video, a chunk per 30 s of audio."""
    if item.kind == router_pb2.MEDIA_KIND_VIDEO:
        return _VIDEO_FRAMES_ESTIMATE
    if item.kind == router_pb2.MEDIA_KIND_AUDIO:
        return max(1, -(-len(item.data) // _WAV_BYTES_PER_CHUNK))
    return 1


class EmbeddingCache:
    """Embeddings of recent images and audio by their bytes' digest, least recently used out past ``max_bytes``.

    A repeated image skips the encoder. Video is not cached: its frames depend
    on the request's sampling and budget. The key is a 128-bit blake2b of
    the bytes (the 64-bit media hash is for block hashes, not identity).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, bytes], encoder_pb2.Embedding] = OrderedDict()

    @staticmethod
    def key(item: router_pb2.MediaInput) -> tuple[int, bytes] | None:
        if item.kind not in (router_pb2.MEDIA_KIND_IMAGE, router_pb2.MEDIA_KIND_AUDIO):
            return None
        return int(item.kind), hashlib.blake2b(item.data, digest_size=16).digest()

    def get(self, key: tuple[int, bytes] | None) -> encoder_pb2.Embedding | None:
        if key is None or key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: tuple[int, bytes] | None, embedding: encoder_pb2.Embedding) -> None:
        size = len(embedding.data)
        if key is None or key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = embedding
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= len(evicted.data)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class _Choice:
    encoder_id: str
    address: str
    estimate_ms: float


def estimated_rows(item: router_pb2.MediaInput, registration: encoder_pb2.EncoderRegistration) -> int:
    """Prompt positions the item will take before it is encoded (the encoder's positions per image, frame or chunk)."""
    if item.kind == router_pb2.MEDIA_KIND_AUDIO:
        return estimated_units(item) * registration.audio_chunk_positions
    return estimated_units(item) * registration.image_positions


class EncoderSet:
    """The encoders registered in etcd; ``ranked`` orders them by estimated time to finish a request."""

    def __init__(self) -> None:
        self.encoders: dict[str, encoder_pb2.EncoderRegistration] = {}

    def update(self, kind: str, encoder_id: str, registration: encoder_pb2.EncoderRegistration | None) -> None:
        if kind == "put" and registration is not None:
            self.encoders[encoder_id] = registration
        else:
            self.encoders.pop(encoder_id, None)

    def ranked(self, units: dict[encoder_pb2.Modality, int]) -> list[_Choice]:
        """Encoders serving every modality in `units` (modality -> units), cheapest first; ties by id."""
        choices = []
        for encoder_id, r in self.encoders.items():
            costs = {c.modality: c.unit_ms for c in r.load.costs}
            if not all(m in costs for m in units):
                continue
            estimate = r.load.backlog_ms + sum(costs[m] * n for m, n in units.items())
            choices.append(_Choice(encoder_id, r.address, estimate))
        return sorted(choices, key=lambda c: (c.estimate_ms, c.encoder_id))


@dataclass(frozen=True)
class Encoded:
    """What an encode gave: one embedding per item, with its rows, or (direct delivery) a key into the encoder that holds them."""

    embeddings: list[encoder_pb2.Embedding]
    # Direct delivery: where each item's rows wait (encoder address, channel endpoint, key); empty: the rows are inline.
    sources: list[common_pb2.MediaSource] = field(default_factory=list)
    # Direct delivery: until when (time.monotonic) the sources are worth fetching, a margin before their hold time ends.
    usable_until: float = 0.0

    def media(self, spans: Sequence[MediaSpan]) -> list[common_pb2.MediaEmbedding]:
        """The worker request's media at `spans` (one per embedding): rows inline, or where the worker fetches them."""
        media = []
        for i, (span, e) in enumerate(zip(spans, self.embeddings, strict=True)):
            item = common_pb2.MediaEmbedding(start=span.start, rows=e.rows, hidden=e.hidden, dtype=e.dtype, media_hash=e.media_hash)
            if self.sources:
                item.source.CopyFrom(self.sources[i])
            else:
                item.data = e.data
            media.append(item)
        return media


_HANDLE_MARGIN_S = 5.0


def usable_for(hold_s: float) -> float:
    """How long after an encode its held rows are worth fetching: 5 s (at most half) short of the hold time, a margin for
    the request to reach its worker; a handle that still goes stale costs an inline encode, not tokens."""
    return max(hold_s / 2, hold_s - _HANDLE_MARGIN_S)


class HandleCache:
    """Direct delivery's cache: recent images' and audio's handles (embedding without rows, and where they wait) by their
    bytes' digest, until 5 s (at most half) of their encoder's hold time is left, at most ``max_entries``. A repeated image skips the
    encoder as with ``EmbeddingCache``, and this router still holds no rows.
    """

    def __init__(self, max_entries: int = 4096, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[tuple[int, bytes], tuple[float, encoder_pb2.Embedding, common_pb2.MediaSource]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, bytes] | None) -> tuple[encoder_pb2.Embedding, common_pb2.MediaSource] | None:
        entry = self._entries.get(key) if key is not None else None
        if entry is None or key is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1], entry[2]

    def until(self, key: tuple[int, bytes] | None) -> float:
        """Until when (the cache's clock) the handle under `key` is kept; 0 for none."""
        entry = self._entries.get(key) if key is not None else None
        return entry[0] if entry is not None else 0.0

    def put(self, key: tuple[int, bytes] | None, embedding: encoder_pb2.Embedding, source: common_pb2.MediaSource, hold_s: float) -> None:
        if key is None or self.max_entries < 1:
            return
        self._entries[key] = (self._clock() + usable_for(hold_s), embedding, source)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class MediaEncoder:
    def __init__(
        self, encoders: EncoderSet, *, timeout_s: float, max_message_bytes: int, on_retry: Callable[[], None] | None = None,
        cache: EmbeddingCache | None = None, on_cache_hit: Callable[[], None] | None = None,
    ) -> None:
        self.encoders = encoders
        self.cache = cache if cache is not None else EmbeddingCache(0)  # an empty cache is falsy (len 0)
        self.handles = HandleCache(0 if cache is None or cache.max_bytes == 0 else 4096)
        self._on_cache_hit = on_cache_hit or (lambda: None)
        self._on_retry = on_retry or (lambda: None)
        self.timeout_s = timeout_s
        limit = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", max_message_bytes)]
        self._channels = GrpcChannels(limit)

    async def close(self) -> None:
        await self._channels.close()

    def all_cached(self, media: Sequence[router_pb2.MediaInput]) -> bool:
        """Every item's embeddings are in the cache: no encoder will run."""
        keys = [self.cache.key(item) for item in media]
        return all(self.cache.get(key) is not None or self.handles.get(key) is not None for key in keys)

    def estimates(
        self, media: Sequence[router_pb2.MediaInput], *, link_bytes_per_s: float = 0.0, through_router: bool = False,
    ) -> tuple[list[EncoderEstimate], int]:
        """The encoders that serve these media with their estimated encode time, cheapest first, and the prompt
        positions the media will take by the cheapest one's registration (0 when none serves them).

        Each estimate's ``transfer_s`` prices moving the embeddings to a worker (``embedding_transfer_s``: its measured
        delivery bandwidth, else `link_bytes_per_s`; `through_router`: inline delivery, two hops); 0 without a link.
        Direct delivery prices the workers whose link the encoder measured apart (``link_transfer_s``) by that link.
        """
        _, units = self._items(media)
        choices = self.encoders.ranked(units)
        if not choices:
            return [], 0
        estimates = []
        for c in choices:
            registration = self.encoders.encoders[c.encoder_id]
            nbytes = embedding_bytes(
                sum(estimated_rows(item, registration) for item in media), registration.llm_hidden_size, registration.embedding_dtype,
            )
            load = registration.load
            transfer = embedding_transfer_s(
                nbytes, measured_bytes_per_s=load.delivery_bytes_per_s, link_bytes_per_s=link_bytes_per_s, through_router=through_router,
            )
            links = {} if through_router else {
                worker_id: embedding_transfer_s(nbytes, measured_bytes_per_s=rate, link_bytes_per_s=link_bytes_per_s, through_router=False)
                for worker_id, rate in load.delivery_bytes_per_s_by_worker.items() if rate > 0
            }
            estimates.append(EncoderEstimate(c.encoder_id, c.estimate_ms / 1e3, transfer, links))
        registration = self.encoders.encoders[choices[0].encoder_id]
        rows = sum(estimated_rows(item, registration) for item in media)
        return estimates, rows

    async def encode(
        self, request_id: str, media: Sequence[router_pb2.MediaInput], max_positions: int, *, first: str | None = None,
        deliver: bool = False, cached: bool = True,
    ) -> Encoded:
        """One embedding per item, from the cache or the cheapest encoder that answers; InvalidRequestError for bad media.

        `first`: the encoder to try first (a joint (encoder, worker) choice); the others follow cheapest first.
        `deliver`: direct delivery, the encoder keeps the rows for the worker to fetch and answers handles (no cache:
        this router never holds them). `cached=False`: from an encoder, and not kept (a direct request's fallback).
        """
        if deliver:
            return await self._deliverable(request_id, media, max_positions, first)
        if not cached:
            return (await self._encode(request_id, media, max_positions, first))[0]
        keys = [self.cache.key(item) for item in media]
        hits = [self.cache.get(key) for key in keys]
        if all(e is not None for e in hits):
            found = [e for e in hits if e is not None]
            if max_positions and sum(e.rows for e in found) > max_positions:
                raise InvalidRequestError("media", f"media need more than the {max_positions} prompt positions the request allows")
            self._on_cache_hit()
            return Encoded(found)
        encoded, _ = await self._encode(request_id, media, max_positions, first)
        for key, embedding in zip(keys, encoded.embeddings, strict=True):
            self.cache.put(key, embedding)
        return encoded

    async def _deliverable(
        self, request_id: str, media: Sequence[router_pb2.MediaInput], max_positions: int, first: str | None,
    ) -> Encoded:
        """Direct delivery: handles from the handle cache, or an Encode with `deliver`."""
        keys = [self.cache.key(item) for item in media]
        cached = [self.handles.get(key) for key in keys]
        hits = [c for c in cached if c is not None]
        if len(hits) == len(keys):
            if max_positions and sum(e.rows for e, _ in hits) > max_positions:
                raise InvalidRequestError("media", f"media need more than the {max_positions} prompt positions the request allows")
            self._on_cache_hit()
            return Encoded([e for e, _ in hits], [s for _, s in hits], usable_until=min(self.handles.until(k) for k in keys))
        encoded, hold_s = await self._encode(request_id, media, max_positions, first, deliver=True)
        for key, embedding, source in zip(keys, encoded.embeddings, encoded.sources, strict=True):
            self.handles.put(key, embedding, source, hold_s)
        return replace(encoded, usable_until=time.monotonic() + usable_for(hold_s))

    @staticmethod
    def _items(media: Sequence[router_pb2.MediaInput]) -> tuple[list[encoder_pb2.MediaItem], dict[encoder_pb2.Modality, int]]:
        """The Encode items and estimated units per modality; InvalidRequestError for an item no encoder can take."""
        items: list[encoder_pb2.MediaItem] = []
        units: dict[encoder_pb2.Modality, int] = {}
        for i, item in enumerate(media):
            modality = _KINDS.get(item.kind)
            if modality is None:
                raise InvalidRequestError(f"media[{i}].kind", "must be IMAGE, VIDEO or AUDIO")
            if item.WhichOneof("source") != "data":
                raise InvalidRequestError(f"media[{i}].source", "only inline data is supported (no URIs)")
            items.append(encoder_pb2.MediaItem(modality=modality, data=item.data))
            units[modality] = units.get(modality, 0) + estimated_units(item)
        return items, units

    async def _encode(
        self, request_id: str, media: Sequence[router_pb2.MediaInput], max_positions: int, first: str | None, *, deliver: bool = False,
    ) -> tuple[Encoded, float]:
        """The embeddings from the first encoder that answers, and (deliver) how long it holds them."""
        items, units = self._items(media)
        if not self.encoders.encoders:
            # As before the pool existed: a deployment without encoders refuses media as the caller's error.
            raise InvalidRequestError("media", "media inputs need the encoder pool, and no encoder is registered")
        choices = self.encoders.ranked(units)
        if not choices:
            names = sorted(encoder_pb2.Modality.Name(m).removeprefix("MODALITY_").lower() for m in units)
            raise InvalidRequestError("media", f"no registered encoder serves {names}")
        choices.sort(key=lambda c: c.encoder_id != first)  # stable: the rest stay cheapest first
        request = encoder_pb2.EncodeRequest(request_id=request_id, items=items, max_positions=max_positions, deliver=deliver)
        last: grpc.aio.AioRpcError | None = None
        for choice in choices:
            stub = encoder_pb2_grpc.EncoderServiceStub(self._channels.get(choice.address))
            try:
                reply = await stub.Encode(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError("media", error.details() or "invalid media") from None
                if error.code() not in _RETRYABLE:
                    raise
                log.warning("encoder %s failed %s (%s); trying the next", choice.encoder_id, request_id, error.code().name)
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self._channels.discard(choice.address)
                last = error
                self._on_retry()
                continue
            if not deliver:
                return Encoded(list(reply.embeddings)), 0.0
            sources = [
                common_pb2.MediaSource(encoder_address=choice.address, channel_endpoint=reply.channel_endpoint, key=e.key)
                for e in reply.embeddings
            ]
            return Encoded(list(reply.embeddings), sources), reply.hold_s
        raise UnavailableError(f"every encoder failed: {last.code().name if last else 'none'}", retry_after_s=1.0)


def media_fetch_failed(error: grpc.aio.AioRpcError) -> bool:
    """A worker refused a request (or a restore of it) because it could not fetch its media from their encoder
    (worker/media_fetch.py); the migration service passes a target's refusal on as the same status."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    try:
        status = rpc_status.from_call(error)
    except (ValueError, TypeError, AttributeError):
        return False
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.PreconditionFailure.DESCRIPTOR):
            failure = error_details_pb2.PreconditionFailure()
            detail.Unpack(failure)
            if any(v.subject == MEDIA_SOURCE_SUBJECT for v in failure.violations):
                return True
    return False
