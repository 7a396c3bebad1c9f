"""Image requests and the tokens they must produce, for the multimodal tests (the service path against the in-process one)."""

from __future__ import annotations

import cv2
import numpy as np

import phalanx.model
from phalanx._proto import common_pb2, router_pb2
from phalanx.common.block_hash import MediaSpan, media_hash
from phalanx.encoder_pool.models import load_image_encoder
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
    model = phalanx.model.load(MODEL)
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
