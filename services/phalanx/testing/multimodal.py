"""Image requests and the tokens they must produce, for the multimodal tests (the service path against the in-process one)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable

import cv2
import grpc
import numpy as np

import phalanx.model
from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.common.block_hash import MediaSpan, media_hash
from phalanx.encoder_pool.models import load_image_encoder
from phalanx.launch.stack import Stack
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import MediaEmbedding

MODEL = "phalanx-tiny-dense"
PLACEHOLDER = 0  # RouterConfig.media_placeholder_token_id


def png(seed: int) -> bytes:
    """A random 40x40 PNG, the same for the same seed."""
    return cv2.imencode(".png", np.random.default_rng(seed).integers(0, 256, (40, 40, 3), dtype=np.uint8))[1].tobytes()


def image_request(text: str, image: bytes, max_tokens: int = 10) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        text=text, media=[router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=image)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def in_process_tokens(image: bytes, before: str, after: str, max_tokens: int = 10) -> list[int]:
    """What the request must produce: the same encoder and engine, no services in between."""
    model = phalanx.model.load(MODEL, dtype=EngineConfig().torch_dtype())  # the dtype the workers compute in
    encoder = load_image_encoder("tiny-clip", model.config.hidden_size)
    decoded = cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR)
    assert decoded is not None, "not an image"
    rows = encoder.encode(encoder.preprocess(decoded[:, :, ::-1])[None])[0]
    prefix = model.tokenizer.encode(before)
    prompt = prefix + [PLACEHOLDER] * rows.shape[0] + model.tokenizer.encode(after, add_bos=False)
    media = [MediaEmbedding(MediaSpan(len(prefix), rows.shape[0], media_hash(image)), rows)]
    engine = Engine(model, EngineConfig(deterministic=True))
    seq = engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), media=media))
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.request_id == seq.request_id and e.index >= 0]
    return tokens


async def restore_after_a_hang(
    stack: Stack, request: router_pb2.GenerateRequest, expected: list[int], ready: Callable[[str, str], Awaitable[object]]
) -> None:
    """Streams ``request`` through the stack's first router; after its 10th token, once ``ready(worker_id, request_id)``
    returns (it waits for what the store must hold), SIGSTOPs the worker serving it: alive to the kernel and silent, its
    stream never breaks. Asserts that the stream then moved once, by the migration service on health's DEAD trigger
    with the store's copy of the embeddings (none left to the router), and gave ``expected``, every index once."""
    migration = stack.migrations[0]
    migrated = migration.metric("phalanx_migration_total") or 0  # every method (a short prompt may be re-prefilled)
    stopped, stopped_at, seen = None, 0.0, []
    try:
        async with grpc.aio.insecure_channel(stack.routers[0].address) as channel:
            async for chunk in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=90):
                seen.append(chunk)
                if len(seen) == 10:
                    stopped = next(w for w in stack.workers if w.worker_id == seen[0].worker_id)
                    await ready(stopped.worker_id, chunk.request_id)
                    os.kill(stopped.process.pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped.process.pid, signal.SIGCONT)
            stopped.kill()
    finished_in = time.monotonic() - stopped_at
    assert [c.index for c in seen] == list(range(len(expected)))
    assert [c.token_id for c in seen] == expected
    assert [c.worker_id for c in seen if c.worker_id][-1] != seen[0].worker_id
    assert migration.metric("phalanx_migration_total") == migrated + 1
    assert (migration.metric("phalanx_migration_left_to_router_total") or 0) == 0
    # Moved once health declared the worker DEAD (its 1 s lease lapsed), not when a transport timeout broke the stream.
    assert finished_in < 20, f"the stream ended {finished_in:.1f} s after its worker hung"
