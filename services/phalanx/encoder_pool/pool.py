"""The encoder pool's engine: decode and preprocess media, queue units per modality, run batches, assemble embeddings.

``EncodePool.encode`` is what the Encode RPC calls. Decoding runs in a
worker thread per request (errors surface as MediaError before anything is
queued); admission refuses work past the backlog bound; one batch loop runs
batches in a thread (torch releases the GIL) and resolves each unit's future
with its output rows; the request's items are assembled from their units in
order. Video frames and images go through the same vision tower but queue
apart, as the reference design's batch loop does (their costs differ: frames are small
batches of a long item, images interactive ones).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from phalanx.common.block_hash import media_hash
from phalanx.encoder_pool.batching import Batch, BatchQueues, Unit
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.encoder_pool.cost import Admission, CostModel, Modality
from phalanx.encoder_pool.errors import MediaError
from phalanx.encoder_pool.image import decode_image
from phalanx.encoder_pool.mel import CHUNK_SAMPLES, HOP, decode_wav, log_mel_chunks
from phalanx.encoder_pool.models import AudioEncoder, ImageEncoder, load_audio_encoder, load_image_encoder
from phalanx.encoder_pool.video import FrameSampling, SamplingStrategy, extract_frames

__all__ = ["EncodePool", "EncodeResult", "EncodedItem", "MediaInput", "VideoRequest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VideoRequest:
    strategy: SamplingStrategy = SamplingStrategy.UNIFORM
    max_frames: int = 0  # 0: the pool's default
    fps: float = 0.0  # 0: 1 frame per second


@dataclass(frozen=True)
class MediaInput:
    modality: Modality
    data: bytes
    video: VideoRequest = VideoRequest()


@dataclass(frozen=True)
class EncodedItem:
    modality: Modality
    embeddings: torch.Tensor  # (rows, llm_hidden)
    media_hash: int
    units: int


@dataclass(frozen=True)
class EncodeResult:
    items: list[EncodedItem]
    queue_ms: float
    encode_ms: float


@dataclass
class _Prepared:
    """One item decoded: its unit inputs and how many output rows each keeps."""

    modality: Modality
    inputs: list[torch.Tensor]
    rows: list[int]
    media_hash: int


@dataclass
class _Slot:
    """Where one unit's output goes."""

    input: torch.Tensor
    rows: int
    future: asyncio.Future[torch.Tensor]
    started: Callable[[], None]


class EncodePool:
    """Encoders, the per-modality queues, the cost model and admission; ``run()`` is the batch loop."""

    def __init__(self, config: EncoderPoolConfig, *, on_batch: Callable[[Modality, int, float], None] | None = None) -> None:
        self.config = config
        self.image: ImageEncoder | None = (
            load_image_encoder(config.image_encoder, config.llm_hidden_size, seed=config.seed, device=config.device)
            if config.image_encoder
            else None
        )
        self.audio: AudioEncoder | None = (
            load_audio_encoder(config.audio_encoder, config.llm_hidden_size, seed=config.seed, device=config.device)
            if config.audio_encoder
            else None
        )
        self._warm_up()
        self.cost = CostModel(alpha=config.cost_ewma_alpha)
        self.admission = Admission(self.cost, config.max_backlog_ms, config.max_queued_units)
        self.queues: BatchQueues[_Slot] = BatchQueues(config.max_batch)
        self._wake = asyncio.Event()
        self._on_batch = on_batch
        self.inflight = 0

    def _warm_up(self) -> None:
        """One forward per encoder, not measured, before anything is served.

        A first batch pays one-off costs (on a GPU the CUDA context and kernel
        loading: hundreds of ms against ~2 ms for a warm small-clip image).
        Measured, that would become the learned unit cost, fade only over many
        batches (EWMA) and mislead admission and joint routing meanwhile.
        """
        if self.image is not None:
            size = self.image.tower.config.image_size
            self.image.encode(torch.zeros(1, 3, size, size))
        if self.audio is not None:
            self.audio.encode(torch.zeros(1, self.audio.n_mels, 100))

    @property
    def modalities(self) -> list[Modality]:
        return [m for m in Modality if self.supports(m)]

    def supports(self, modality: Modality) -> bool:
        return (self.audio if modality is Modality.AUDIO else self.image) is not None

    @property
    def audio_chunk_positions(self) -> int:
        return self.audio.tokens_for_frames(CHUNK_SAMPLES // HOP) if self.audio else 0

    # -- the RPC side ----------------------------------------------------------------------
    async def encode(self, items: Sequence[MediaInput], *, max_positions: int = 0) -> EncodeResult:
        """Embeddings of every item, in order. MediaError for bad media, EncoderOverloadedError past the backlog bound."""
        if not items:
            raise MediaError("items", "no media items")
        for index, item in enumerate(items):
            if not self.supports(item.modality):
                raise MediaError(f"items[{index}].modality", f"this encoder serves {[m.value for m in self.modalities]}")
            if len(item.data) > self.config.max_item_bytes:
                raise MediaError(f"items[{index}].data", f"{len(item.data)} bytes is more than {self.config.max_item_bytes}")
        prepared = await asyncio.to_thread(self._prepare_all, list(items), max_positions)
        units: dict[Modality, int] = {}
        for p in prepared:
            units[p.modality] = units.get(p.modality, 0) + len(p.inputs)
        self.admission.admit(units)
        admitted = time.perf_counter()
        first_start: list[float] = []

        def mark_started() -> None:
            if not first_start:
                first_start.append(time.perf_counter())

        loop = asyncio.get_running_loop()
        slots = [
            [_Slot(x, rows, loop.create_future(), mark_started) for x, rows in zip(p.inputs, p.rows, strict=True)] for p in prepared
        ]
        self.queues.push([Unit(p.modality, slot) for p, item_slots in zip(prepared, slots, strict=True) for slot in item_slots])
        self._wake.set()
        self.inflight += 1
        try:
            outputs = [[await s.future for s in item_slots] for item_slots in slots]
        finally:
            self.inflight -= 1
            # A caller that left (cancelled, deadline) frees the rest of its units: the batch loop skips done futures.
            for item_slots in slots:
                for slot in item_slots:
                    slot.future.cancel()
        done = time.perf_counter()
        encoded = [
            EncodedItem(p.modality, torch.cat(rows) if len(rows) > 1 else rows[0], p.media_hash, len(rows))
            for p, rows in zip(prepared, outputs, strict=True)
        ]
        start = first_start[0] if first_start else done
        return EncodeResult(encoded, (start - admitted) * 1000, (done - admitted) * 1000)

    def _prepare_all(self, items: list[MediaInput], max_positions: int) -> list[_Prepared]:
        prepared: list[_Prepared] = []
        remaining = max_positions or math.inf
        for index, item in enumerate(items):
            p = self._prepare(index, item, remaining)
            remaining -= sum(p.rows)
            if remaining < 0:
                raise MediaError(f"items[{index}]", f"media need more than the {max_positions} prompt positions the request allows")
            prepared.append(p)
        return prepared

    def _prepare(self, index: int, item: MediaInput, remaining: float) -> _Prepared:
        field_name = f"items[{index}].data"
        digest = media_hash(item.data)
        if item.modality is Modality.IMAGE:
            assert self.image is not None
            rgb = decode_image(item.data, field=field_name, max_pixels=self.config.max_image_pixels)
            return _Prepared(item.modality, [self.image.preprocess(rgb)], [self.image.tokens_per_image], digest)
        if item.modality is Modality.VIDEO:
            assert self.image is not None
            return self._prepare_video(index, item, remaining, digest)
        assert self.audio is not None
        audio = decode_wav(item.data, field=field_name, max_seconds=self.config.max_audio_seconds)
        chunks = log_mel_chunks(audio, n_mels=self.audio.n_mels)
        # Every chunk is encoded padded to 30 s, as Whisper was trained; only the rows that hold audio are kept.
        samples = [min(CHUNK_SAMPLES, audio.size - i * CHUNK_SAMPLES) for i in range(chunks.shape[0])]
        rows = [self.audio.tokens_for_frames(max(1, -(-n // HOP))) for n in samples]
        return _Prepared(item.modality, list(chunks), rows, digest)

    def _prepare_video(self, index: int, item: MediaInput, remaining: float, digest: int) -> _Prepared:
        assert self.image is not None
        wanted = item.video.max_frames or self.config.default_video_frames
        if wanted > self.config.max_video_frames:
            raise MediaError(f"items[{index}].video.max_frames", f"{wanted} frames is more than {self.config.max_video_frames}")
        per_frame = self.image.tokens_per_image
        # The visual token budget thins the frames; not even one frame fitting is the caller's error.
        fit = int(min(wanted, remaining // per_frame))
        if fit < 1:
            raise MediaError(f"items[{index}]", f"one frame takes {per_frame} positions; the request leaves {remaining:g}")
        sampling = FrameSampling(item.video.strategy, max_frames=fit, fps=item.video.fps or 1.0)
        video = extract_frames(item.data, sampling, field=f"items[{index}].data", max_source_frames=self.config.max_video_source_frames)
        return _Prepared(item.modality, [self.image.preprocess(f) for f in video.frames], [per_frame] * len(video.frames), digest)

    # -- the batch loop --------------------------------------------------------------------
    async def run(self) -> None:
        """Run batches until cancelled; a failed batch fails its units' requests, not the loop."""
        while True:
            batch = self.queues.next_batch()
            if batch is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._run_batch(batch)

    async def _run_batch(self, batch: Batch[_Slot]) -> None:
        slots = [u.payload for u in batch.units]
        live = [s for s in slots if not s.future.done()]  # a caller that left cancelled its futures
        for slot in live:
            slot.started()
        started = time.perf_counter()
        try:
            if live:
                outputs = await asyncio.to_thread(self._forward, batch.modality, torch.stack([s.input for s in live]))
                for slot, output in zip(live, outputs, strict=True):
                    if not slot.future.done():
                        slot.future.set_result(output[: slot.rows].clone())
        except Exception as error:
            log.exception("encoding a batch of %d %s units failed", len(live), batch.modality.value)
            for slot in live:
                if not slot.future.done():
                    slot.future.set_exception(error)
        finally:
            elapsed_ms = (time.perf_counter() - started) * 1000
            self.admission.done(batch.modality, len(slots))
            if live:
                self.cost.observe(batch.modality, len(live), elapsed_ms)
                if self._on_batch is not None:
                    self._on_batch(batch.modality, len(live), elapsed_ms)

    def _forward(self, modality: Modality, inputs: torch.Tensor) -> torch.Tensor:
        if modality is Modality.AUDIO:
            assert self.audio is not None
            return self.audio.encode(inputs)
        assert self.image is not None
        return self.image.encode(inputs)
