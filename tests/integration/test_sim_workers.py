"""Simulated workers (`phalanx worker --engine sim`) in a real stack: NATS, etcd, a router, worker processes.

They serve through the router like real workers and say what they are (sim:<model>); every simulated worker gives
the same tokens for a prompt; a fleet of 16 starts in bounded time and its throughput grows with its size. None of
this tests the real engine's correctness: the simulated engine never stands in for it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.model.tokenizer import ByteTokenizer
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile
from phalanx.worker.simulated import simulated_token, token_alphabet

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
# The fleet's workers: 400 ms a decode step of up to 4 sequences: 10 tokens/s each, whatever the box. Slow on purpose:
# 16 of them deliver 160 tokens/s, well below what relaying costs the shared 2-core box (~300 tokens/s for the workers,
# router and client together), so the measured throughput is the workers' capacity and not the box's.
FLEET_ITL_S = 0.4
FLEET_MAX_SEQS = 4
# Enough users to fill 16 workers' 64 sequences.
USERS = 64


def write_profile(path: Path, itl_s: dict[int, float]) -> Path:
    prefill = [PrefillSample(isl=float(n), ttft_s=0.002 + n * 2e-6) for n in (16, 512, 2048)]
    decode = [DecodeSample(context=float(c), concurrency=float(k), itl_s=itl) for c in (64, 2048) for k, itl in itl_s.items()]
    save_profile(build_profile(prefill, decode, model=MODEL), path)
    return path


async def worker_tokens(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        request = worker_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, tokens=common_pb2.PromptTokens(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        return [chunk.token_id async for chunk in worker_pb2_grpc.WorkerServiceStub(channel).Generate(request, timeout=30) if chunk.index >= 0]


async def test_sim_workers_serve_through_a_router_say_what_they_are_and_agree(nats_server, etcd_server, tmp_path) -> None:
    profile = write_profile(tmp_path / "p.npz", {1: 0.004, 8: 0.01})
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    try:
        workers = await stack.add_workers(2, "--engine", "sim", "--profile", str(profile))
        router = await stack.add_router()
        alphabet = token_alphabet(ByteTokenizer())
        async with await Client.connect(router.address, timeout=30) as client:
            completion = await client.complete("hello, simulated world", max_tokens=10, ignore_eos=True)
            listed = await client.list_workers()
        prompt = ByteTokenizer().encode("hello, simulated world")
        assert list(completion.token_ids) == [simulated_token(prompt, i, 0, alphabet) for i in range(10)]
        assert {w.model for w in listed} == {f"sim:{MODEL}"}
        assert len(listed) == 2
        # Every simulated worker, asked directly, gives the same tokens.
        other_prompt = list(range(60, 100))
        first, second = await asyncio.gather(*(worker_tokens(w.address, other_prompt, 12) for w in workers))
        assert first == second == [simulated_token(other_prompt, i, 0, alphabet) for i in range(12)]
    finally:
        stack.stop()
