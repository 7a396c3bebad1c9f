"""`phalanx profile`'s sweep: measure a running worker and build its performance profile (profile.py's .npz).

The sweep talks to one worker's WorkerService directly (no router in the way, whose own latency the
planner's correction factors see anyway): a running one (`--target host:port`), or one that
phalanx.launch.profiling starts for the purpose.

- Prefill: requests of ISL tokens, alone and one after another, with max_tokens 1; TTFT is the time to the
  first (only) token. Prompts are random bytes, so no prefix of one is cached from another.
- Decode: `concurrency` streams at once, whose prompts share a cached prefix of `context` tokens (one
  request computes it first), each then decoding `decode_tokens` tokens; ITL is the median gap between a
  stream's consecutive tokens after its second (the first gap may still hold another stream's prefill),
  over every stream. The sample's context is the prompt plus half the decoded tokens.

Every point is measured `repeats` times; build_profile takes the median.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.tls import open_channel
from phalanx.planner.profile import DecodeSample, PerformanceProfile, PrefillSample, build_profile


@dataclass(frozen=True)
class SweepPlan:
    isls: Sequence[int]
    contexts: Sequence[int]
    concurrencies: Sequence[int]
    decode_tokens: int
    repeats: int


# --quick: under a minute for phalanx-tiny-moe on a 2-core box (worker start included).
QUICK = SweepPlan(
    isls=(16, 64, 256, 512, 1024), contexts=(64, 512, 1536), concurrencies=(1, 2, 4, 8, 16, 32, 64), decode_tokens=12, repeats=1
)
FULL = SweepPlan(
    isls=(16, 32, 64, 128, 256, 512, 1024, 1536), contexts=(64, 256, 1024, 1536), concurrencies=(1, 2, 4, 8, 16, 32, 64),
    decode_tokens=24, repeats=3,
)
# Prompt ids are bytes: valid in every vocabulary Phalanx serves, and never a special token of the byte tokenizer.
_BYTE_IDS = 256


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(_BYTE_IDS) for _ in range(length)]


async def _stream_times(stub: worker_pb2_grpc.WorkerServiceStub, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(start, arrival time of each token) of one greedy request."""
    request = worker_pb2.GenerateRequest(
        request_id=f"profile-{uuid.uuid4().hex}", tokens=common_pb2.PromptTokens(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    arrivals = []
    async for chunk in stub.Generate(request, timeout=120):
        if chunk.index >= 0:
            arrivals.append(time.perf_counter())
    return start, arrivals


async def sweep(
    address: str, plan: SweepPlan, *, seed: int = 0, log: Callable[[str], None] | None = None
) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """Prefill and decode samples of the worker at `address`."""
    rng = random.Random(seed)
    prefill: list[PrefillSample] = []
    decode: list[DecodeSample] = []
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        await _stream_times(stub, _prompt(rng, 32), 4)  # warm-up: allocator, first batches
        for isl in plan.isls:
            for _ in range(plan.repeats):
                start, arrivals = await _stream_times(stub, _prompt(rng, isl), 1)
                prefill.append(PrefillSample(isl=float(isl), ttft_s=arrivals[0] - start))
            if log:
                log(f"prefill isl={isl}: ttft {prefill[-1].ttft_s * 1e3:.1f} ms")
        for context in plan.contexts:
            for concurrency in plan.concurrencies:
                for _ in range(plan.repeats):
                    prefix = _prompt(rng, context - 1)
                    await _stream_times(stub, prefix + [0], 1)  # computes (and caches) the shared prefix
                    runs = await asyncio.gather(
                        *(_stream_times(stub, [*prefix, rng.randrange(_BYTE_IDS)], plan.decode_tokens) for _ in range(concurrency))
                    )
                    gaps = [b - a for _, arrivals in runs for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]
                    decode.append(DecodeSample(context=float(context + plan.decode_tokens // 2), concurrency=float(concurrency),
                                               itl_s=statistics.median(gaps)))
                if log:
                    log(f"decode context={context} concurrency={concurrency}: itl {decode[-1].itl_s * 1e3:.1f} ms")
    return prefill, decode


async def profile_address(
    address: str, model: str, plan: SweepPlan, *, log: Callable[[str], None] | None = None
) -> PerformanceProfile:
    """The profile of the worker of `model` at `address`."""
    prefill, decode = await sweep(address, plan, log=log)
    return build_profile(prefill, decode, model=model)
