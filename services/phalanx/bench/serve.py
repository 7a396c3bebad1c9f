"""`phalanx bench serve`: output tokens/s through SDK -> router -> worker against the bare engine.

Same model, engine settings, prompts and sampling on both sides, in one
run: the bare side steps an Engine in this process (no gRPC, no NATS, no
asyncio); the stack side is a real deployment on loopback (nats-server,
etcd, one worker process, one router process) driven by the SDK with
`streams` concurrent streams. Both time from submitting the requests to
the last token, prefill included. Sides alternate per repeat and report
the median, so machine noise hits them alike; each repeat uses fresh
prompts (shared by both sides) so the prefix cache helps neither.

The router reads the worker's tokens over one multiplexed stream (one
message per engine step for all requests). With `compare_per_request` a
second router on the same worker reads them with a call per request, the
way routers did before the multiplexed stream, as a third side of each repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
import uuid

import torch

from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.services import start_router, start_worker
from phalanx.model.params import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

# The goal: stack throughput over the bare engine's, at 16 streams (docs/token-streams.md).
GOAL_RATIO = 0.9


def _prompts(seed: int, streams: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(streams)]


def bare_tokens_per_s(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(EngineRequest(prompt, params, request_id=uuid.uuid4().hex))
    produced = 0
    while engine.has_work():
        produced += sum(1 for e in engine.step() if e.index >= 0)
    return produced / (time.perf_counter() - start)


async def stack_tokens_per_s(client: Client, prompts: list[list[int]], tokens: int) -> float:
    async def one(prompt: list[int]) -> int:
        completion = await client.complete(prompt, max_tokens=tokens, ignore_eos=True)
        return len(completion.token_ids)

    start = time.perf_counter()
    produced = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return produced / (time.perf_counter() - start)


def run_serve_bench(
    *, streams: int = 16, tokens: int = 128, prompt_len: int = 32, model: str = "phalanx-tiny-moe", repeats: int = 3,
    deterministic: bool = False, compare_per_request: bool = False,
) -> dict:
    return asyncio.run(_run(streams, tokens, prompt_len, model, repeats, deterministic, compare_per_request))


async def _run(
    streams: int, tokens: int, prompt_len: int, model: str, repeats: int, deterministic: bool, compare_per_request: bool
) -> dict:
    engine_config = EngineConfig(model=model, deterministic=deterministic)
    # The worker runs its engine on effective_torch_threads() (all cores but one: its event loop needs the other);
    # the bare side gets the same setting, so that the ratio is the stack's cost and not a thread count's.
    torch_threads = engine_config.effective_torch_threads()
    torch.set_num_threads(torch_threads)
    engine = Engine(engine_config.load_model(), engine_config)  # the worker's dtype and weights
    runs: dict[str, list[float]] = {"bare": [], "stack": []}
    if compare_per_request:
        runs["stack_per_request"] = []
    async with contextlib.AsyncExitStack() as stack:
        nats = stack.enter_context(NatsServer())
        etcd = stack.enter_context(EtcdServer())
        etcd_config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        worker = await start_worker("bench-worker", nats.url, etcd_config, "--deterministic" if deterministic else "--fast", model=model)
        stack.callback(worker.terminate)
        router = await start_router("bench-router", nats.url, etcd_config)
        stack.callback(router.terminate)
        clients = {"stack": await stack.enter_async_context(await Client.connect(router.address))}
        if compare_per_request:
            old = await start_router("bench-router-per-request", nats.url, etcd_config, env={"PHALANX_ROUTER_MULTIPLEX_WORKER_STREAMS": "false"})
            stack.callback(old.terminate)
            clients["stack_per_request"] = await stack.enter_async_context(await Client.connect(old.address))
        # Warm-up: allocator, kernels, channels, the first routing decisions.
        warm = _prompts(-1, streams, prompt_len)
        bare_tokens_per_s(engine, warm, 8)
        for client in clients.values():
            await stack_tokens_per_s(client, warm, 8)
        for repeat in range(repeats):
            prompts = _prompts(repeat, streams, prompt_len)
            runs["bare"].append(bare_tokens_per_s(engine, prompts, tokens))
            for side, client in clients.items():
                runs[side].append(await stack_tokens_per_s(client, prompts, tokens))
    bare, served = statistics.median(runs["bare"]), statistics.median(runs["stack"])
    compared = {}
    if compare_per_request:
        compared["per_request_ratio"] = round(statistics.median(runs["stack_per_request"]) / bare, 3)
    return {
        "model": model,
        "streams": streams,
        "tokens_per_stream": tokens,
        "prompt_len": prompt_len,
        "deterministic": deterministic,
        "repeats": repeats,
        "bare_tokens_per_s": round(bare, 1),
        "stack_tokens_per_s": round(served, 1),
        "ratio": round(served / bare, 3),
        **compared,
        "torch_threads": torch_threads,
        "runs": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "goals": {"ratio": GOAL_RATIO},
        "met": {"ratio": served / bare >= GOAL_RATIO},
    }
