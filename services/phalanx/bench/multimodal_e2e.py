"""Media TTFT through the real services: text prefix overlapped with encoding vs encode-then-prefill.

NATS, etcd, one encoder, one worker and two routers as processes: one router
with ``PHALANX_ROUTER_MEDIA_PREFIX_OVERLAP`` on for every prefix (min steps
0: the mechanism, not the router's rule of when it pays), one with it off. Requests alternate between the two, each with a fresh image (no
embedding cache hit) and fresh random prefix tokens (no prefix cache hit),
and TTFT is taken at the client (the SDK's first token). Every process runs
on the same cores here: the encoder and the worker compete for them, which a
deployment with an encoder on its own device does not.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np

import phalanx.model
from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.tls import open_channel
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import start_encoder_pool, start_router, start_worker

__all__ = ["overlap_ttft_through_services"]

PLACEHOLDER = 0  # RouterConfig.media_placeholder_token_id


async def _first_token_s(stub: router_pb2_grpc.RouterServiceStub, request: router_pb2.GenerateRequest) -> float:
    start = time.perf_counter()
    call = stub.Generate(request, timeout=120)
    try:
        async for chunk in call:
            if chunk.index >= 0:
                return time.perf_counter() - start
    finally:
        call.cancel()
    raise RuntimeError("the request ended without a token")


async def _measure(stubs: dict[bool, router_pb2_grpc.RouterServiceStub], request, prefixes: dict[str, int], rounds: int) -> dict:
    for overlap in (True, False):  # warm-up: channels, kernels, the encoder's unit cost, the routers' encoder view
        for _ in range(2):
            await _first_token_s(stubs[overlap], request(max(prefixes.values())))
    out: dict[str, dict] = {}
    for label, tokens in prefixes.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for overlap in (False, True):
                times[overlap].append(await _first_token_s(stubs[overlap], request(tokens)))
        sequential, overlapped = statistics.median(times[False]), statistics.median(times[True])
        out[label] = {
            "prefix_tokens": tokens, "sequential_ttft_ms": round(sequential * 1e3, 2), "overlapped_ttft_ms": round(overlapped * 1e3, 2),
            "reduction": round(1 - overlapped / sequential, 3),
        }
    return out


async def overlap_ttft_through_services(
    *, image_encoder: str, model: str, prefixes: dict[str, int], rounds: int, png: Callable[[int, int], bytes], image_size: int,
    device: str = "cpu", encoder_device: str = "cpu",
) -> dict:
    hidden = phalanx.model.load(model).config.hidden_size
    rng = np.random.default_rng(7)
    seeds = itertools.count(10_000)

    def request(prefix_tokens: int) -> router_pb2.GenerateRequest:
        ids = [int(t) for t in rng.integers(1, 256, prefix_tokens)] + [PLACEHOLDER] + [int(t) for t in rng.integers(1, 256, 8)]
        return router_pb2.GenerateRequest(
            tokens=common_pb2.PromptTokens(ids=ids),
            media=[router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=png(next(seeds), image_size))],
            sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True),
        )

    with contextlib.ExitStack() as stack:
        nats = stack.enter_context(NatsServer())
        etcd = stack.enter_context(EtcdServer())
        etcd_config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        encoder = await start_encoder_pool(
            "bench-encoder", etcd_config, "--image-encoder", image_encoder, "--llm-hidden-size", str(hidden), "--device", encoder_device,
        )
        stack.callback(encoder.terminate)
        worker = await start_worker("bench-mm-worker", nats.url, etcd_config, "--fast", model=model, env={"PHALANX_ENGINE_DEVICE": device})
        stack.callback(worker.terminate)
        routers = {}
        for overlap in (True, False):
            # The overlap on for every prefix with a block to compute (min steps 0), not only where the router's rule
            # expects it to pay: this measures what the mechanism gains or costs at each prefix length.
            env = {"PHALANX_ROUTER_MEDIA_PREFIX_OVERLAP": "true" if overlap else "false", "PHALANX_ROUTER_MEDIA_PREFIX_OVERLAP_MIN_STEPS": "0"}
            router = await start_router(f"bench-mm-router-{int(overlap)}", nats.url, etcd_config, env=env)
            stack.callback(router.terminate)
            routers[overlap] = router
        channels = {k: open_channel(r.address) for k, r in routers.items()}
        try:
            out = await _measure({k: router_pb2_grpc.RouterServiceStub(c) for k, c in channels.items()}, request, prefixes, rounds)
        finally:
            for channel in channels.values():
                await channel.close()
        out["prefix_prefills_ok"] = int(routers[True].metric("phalanx_router_media_prefix_prefills_total", result="ok") or 0)
    return out
