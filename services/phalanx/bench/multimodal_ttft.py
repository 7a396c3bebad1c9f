"""Time to first token of media requests, in process: encoder pool + engine, as the router drives them.

Three measurements, each side by side in one run (the box's load hits both
sides alike):

- overlap: TTFT with the text before the image prefilled while the image is
  encoded (the router's WorkerService.Prefill: an engine request with
  ``prefix_only``), against encoding first and then prefilling the whole
  prompt; a short and a long text prefix; the two modes alternate request by
  request, every request with fresh tokens and a fresh image.
- joint routing under skew: two encoders, one kept busy by a background
  stream of 16-image requests; each request's encoder is chosen either by
  ``choose_joint`` over the encoders' live load (as the router reads it from
  their registrations) and the routing table's worker terms, or round-robin;
  alternating, the same requests; TTFT p50 / p90.
- TTFT by modality: one image, four images, a video (8 frames), 10 s of
  audio, with the overlap, medians.

The engine runs on its own thread and the encoder pool's batches on
another, as a worker and an encoder would on their own devices; on a CPU
they share its cores (``torch_threads`` each), which understates the
overlap's gain where encoder and LLM have separate GPUs.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import statistics
import tempfile
import time
import wave
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

import phalanx.model
from phalanx._proto import encoder_pb2
from phalanx.bench.multimodal_e2e import overlap_ttft_through_services
from phalanx.common.block_hash import MediaSpan
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.encoder_pool.cost import Modality
from phalanx.encoder_pool.pool import EncodePool, MediaInput
from phalanx.encoder_pool.server import encoder_load
from phalanx.encoder_pool.tokens import expand_placeholders
from phalanx.model.params import SamplingParams
from phalanx.router.joint import EncoderEstimate, choose_joint
from phalanx.router.media import EncoderSet
from phalanx.router.routing import RoutingTable
from phalanx.worker.async_engine import AsyncEngine
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import MediaEmbedding

__all__ = ["run_ttft_benches"]

PLACEHOLDER = 0
_FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
_WORKER = "bench-worker"


def random_png(seed: int, size: int) -> bytes:
    """A PNG of random pixels, size x 1.25 size (the encoders resize it): distinct per seed, so no cache hits."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size + size // 4, 3), dtype=np.uint8)
    return cv2.imencode(".png", pixels)[1].tobytes()


def _wav(seconds: float, seed: int) -> bytes:
    rate = 16_000
    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * (200 + seed) * t) * 8000).astype(np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def _video(frames: int, seed: int) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.avi"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 10.0, (96, 64))
        rng = np.random.default_rng(seed)
        for _ in range(frames):
            writer.write(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))
        writer.release()
        return path.read_bytes()


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, 256, n)]  # never the placeholder (0), never BOS/EOS


class _Harness:
    """An engine and encoder pools on one event loop: what a worker and encoders do for one media request."""

    def __init__(self, engine: AsyncEngine, pools: dict[str, EncodePool]) -> None:
        self.engine = engine
        self.pools = pools
        self.rng = np.random.default_rng(0)

    async def ttft(self, pool: EncodePool, items: Sequence[MediaInput], prefix_tokens: int, *, overlap: bool) -> float:
        prefix, suffix = _tokens(self.rng, prefix_tokens), _tokens(self.rng, 8)
        start = time.perf_counter()
        encode = pool.encode(list(items))
        if overlap:
            warm = EngineRequest(prefix, _FIRST_TOKEN, prefix_only=True)
            result, _ = await asyncio.gather(encode, self._drain(warm))
        else:
            result = await encode
        ids, spans = expand_placeholders(
            prefix + [PLACEHOLDER] * len(items) + suffix, PLACEHOLDER, [i.embeddings.shape[0] for i in result.items],
            [i.media_hash for i in result.items],
        )
        media = [MediaEmbedding(MediaSpan(s.start, s.length, s.media_hash), i.embeddings) for s, i in zip(spans, result.items, strict=True)]
        async for event in self.engine.generate(EngineRequest(ids, _FIRST_TOKEN, media=media)):
            if event.index >= 0:
                return time.perf_counter() - start
        raise RuntimeError("the request ended without a token")

    async def parts(self, pool: EncodePool, image: bytes, prefix_tokens: int) -> tuple[float, float]:
        """Seconds to encode the image alone and to prefill a text prefix alone: what the overlap can hide is the shorter."""
        start = time.perf_counter()
        await pool.encode([MediaInput(Modality.IMAGE, image)])
        encoded = time.perf_counter()
        await self._drain(EngineRequest(_tokens(self.rng, prefix_tokens), _FIRST_TOKEN, prefix_only=True))
        return encoded - start, time.perf_counter() - encoded

    async def _drain(self, request: EngineRequest) -> None:
        async for _ in self.engine.generate(request):
            pass


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def _p90_ms(values: list[float]) -> float:
    return round(float(np.percentile(values, 90)) * 1e3, 2)


async def _overlap(h: _Harness, pool: EncodePool, image_size: int, prefixes: dict[str, int], rounds: int) -> dict:
    out: dict[str, dict] = {}
    seeds = itertools.count(1000)
    for label, tokens in prefixes.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        encode, prefill = [], []
        for _ in range(rounds):
            for overlap in (False, True):
                image = [MediaInput(Modality.IMAGE, random_png(next(seeds), image_size))]
                times[overlap].append(await h.ttft(pool, image, tokens, overlap=overlap))
            e, p = await h.parts(pool, random_png(next(seeds), image_size), tokens)
            encode.append(e)
            prefill.append(p)
        sequential, overlapped = _median_ms(times[False]), _median_ms(times[True])
        hideable = min(_median_ms(encode), _median_ms(prefill))
        out[label] = {
            "prefix_tokens": tokens, "sequential_ttft_ms": sequential, "overlapped_ttft_ms": overlapped,
            "reduction": round(1 - overlapped / sequential, 3),
            # Alone, one at a time: the overlap can at best hide the shorter of the two (if they do not share cores).
            "encode_alone_ms": _median_ms(encode), "prefix_prefill_alone_ms": _median_ms(prefill),
            "best_possible_reduction": round(hideable / sequential, 3),
        }
    return out


async def _skew(h: _Harness, image_size: int, requests: int, prefix_tokens: int) -> dict:
    busy = h.pools["busy"]
    background = [random_png(50_000 + i, image_size) for i in range(16)]

    async def keep_busy() -> None:
        while True:
            await busy.encode([MediaInput(Modality.IMAGE, data) for data in background])

    encoders = EncoderSet()
    table = RoutingTable()
    table.upsert_worker(_WORKER, "in-process", pid=os.getpid())

    def joint_choice() -> str:
        for name, pool in h.pools.items():
            encoders.update("put", name, encoder_pb2.EncoderRegistration(encoder_id=name, load=encoder_load(pool)))
        ranked = [EncoderEstimate(c.encoder_id, c.estimate_ms / 1e3) for c in encoders.ranked({encoder_pb2.MODALITY_IMAGE: 1})]
        choice = choose_joint(ranked, table.estimates([]), prefix_tokens=prefix_tokens, rest_tokens=64, overlap=True)
        assert choice is not None
        return choice.encoder_id

    loaders = [asyncio.get_running_loop().create_task(keep_busy()) for _ in range(2)]
    round_robin = itertools.cycle(["busy", "idle"])
    times: dict[str, list[float]] = {"joint": [], "round_robin": []}
    picked_busy = {"joint": 0, "round_robin": 0}
    seeds = itertools.count(2000)
    try:
        await asyncio.sleep(0.2)  # the background stream queues up
        for _ in range(requests):
            for mode in ("joint", "round_robin"):
                name = joint_choice() if mode == "joint" else next(round_robin)
                picked_busy[mode] += name == "busy"
                image = [MediaInput(Modality.IMAGE, random_png(next(seeds), image_size))]
                times[mode].append(await h.ttft(h.pools[name], image, prefix_tokens, overlap=True))
    finally:
        for task in loaders:
            task.cancel()
        await asyncio.gather(*loaders, return_exceptions=True)
    return {
        "requests_per_mode": requests,
        "background": "2 concurrent streams of 16-image requests on encoder 'busy'",
        **{f"{mode}_ttft_ms": {"p50": _median_ms(v), "p90": _p90_ms(v)} for mode, v in times.items()},
        "requests_sent_to_busy_encoder": picked_busy,
    }


async def _by_modality(h: _Harness, pool: EncodePool, image_size: int, rounds: int, prefix_tokens: int) -> dict:
    seeds = itertools.count(3000)
    kinds = {
        "image": lambda: [MediaInput(Modality.IMAGE, random_png(next(seeds), image_size))],
        "4_images": lambda: [MediaInput(Modality.IMAGE, random_png(next(seeds), image_size)) for _ in range(4)],
        "video_8_frames": lambda: [MediaInput(Modality.VIDEO, _video(24, next(seeds)))],
        "audio_10s": lambda: [MediaInput(Modality.AUDIO, _wav(10.0, next(seeds)))],
    }
    out = {}
    for kind, make in kinds.items():
        times = [await h.ttft(pool, make(), prefix_tokens, overlap=True) for _ in range(rounds)]
        out[kind] = _median_ms(times)
    return out


async def _run(
    image_encoder: str, audio_encoder: str, model: str, rounds: int, skew_requests: int, short_prefix: int, long_prefix: int,
    device: str, encoder_device: str,
) -> dict:
    engine_config = EngineConfig(max_model_len=max(2048, long_prefix + 1024), device=device)
    llm = phalanx.model.load(model, device=engine_config.device, dtype=engine_config.torch_dtype())
    config = EncoderPoolConfig(
        image_encoder=image_encoder, audio_encoder=audio_encoder, llm_hidden_size=llm.config.hidden_size, max_backlog_ms=1e9,
        max_queued_units=100_000, device=encoder_device,
    )
    pools = {name: EncodePool(config) for name in ("idle", "busy")}
    engine = AsyncEngine(Engine(llm, engine_config))
    await engine.start()
    runners = [asyncio.get_running_loop().create_task(pool.run()) for pool in pools.values()]
    try:
        pool = pools["idle"]
        assert pool.image is not None
        size = pool.image.tower.config.image_size
        h = _Harness(engine, pools)
        for p in pools.values():  # warm-up: unit costs learned, kernels and caches warm
            for overlap in (False, True):
                await h.ttft(p, [MediaInput(Modality.IMAGE, random_png(1, size))], long_prefix, overlap=overlap)
        in_process = await _overlap(h, pool, size, {"short_prefix": short_prefix, "long_prefix": long_prefix}, rounds)
        skew = await _skew(h, size, skew_requests, short_prefix)
        modality = await _by_modality(h, pool, size, max(3, rounds // 2), short_prefix)
    finally:
        for task in runners:
            task.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        await engine.stop()
    return {
        "model": model, "overlap_in_process": in_process, "joint_routing_under_skew": skew, "ttft_by_modality_ms": modality,
        "image_size": size,
    }


def run_ttft_benches(
    *, image_encoder: str, audio_encoder: str, model: str = "phalanx-tiny-dense", rounds: int = 6, skew_requests: int = 20,
    short_prefix: int = 32, long_prefix: int = 1024, device: str = "cpu", encoder_device: str = "cpu",
) -> dict:
    results = asyncio.run(
        _run(image_encoder, audio_encoder, model, rounds, skew_requests, short_prefix, long_prefix, device, encoder_device)
    )
    results["overlap_through_services"] = asyncio.run(overlap_ttft_through_services(
        image_encoder=image_encoder, model=model, prefixes={"short_prefix": short_prefix, "long_prefix": long_prefix}, rounds=rounds,
        png=random_png, image_size=results.pop("image_size"), device=device, encoder_device=encoder_device,
    ))
    return results
