"""Simulated workers (`phalanx worker --engine sim`) in a real stack: NATS, etcd, a router, worker processes.

They serve through the router like real workers and say what they are (sim:<model>); every simulated worker gives
the same tokens for a prompt; a fleet of 16 starts in bounded time and its throughput grows with its size. None of
this tests the real engine's correctness: the simulated engine never stands in for it."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc
import openai
import pytest

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.launch.profiling import profile_worker
from phalanx.launch.services import start_gateway
from phalanx.launch.stack import Stack
from phalanx.model.tokenizer import ByteTokenizer
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, load_profile, save_profile
from phalanx.planner.profiler import SweepPlan
from phalanx.worker.simulated import simulated_token, token_alphabet

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
# The fleet's workers: 400 ms a decode step of up to 4 sequences: 10 tokens/s each, whatever the box. Slow on purpose:
# 16 of them deliver 160 tokens/s, well below what relaying costs the shared 2-core box (~300 tokens/s for the workers,
# router and client together), so the measured throughput is the workers' capacity and not the box's.
FLEET_ITL_S = 0.4
FLEET_MAX_SEQS = 4
# Twice as many users as 16 workers have sequences (routing imbalance leaves none idle); 1/8 of them for 2 workers.
USERS = 128


def write_profile(path: Path, itl_s: dict[int, float], prefill_base_s: float = 0.002) -> Path:
    prefill = [PrefillSample(isl=float(n), ttft_s=prefill_base_s + n * 2e-6) for n in (16, 512, 2048)]
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


def torch_loaded(pid: int) -> bool:
    """Whether a process imported torch: its shared libraries (libtorch*, libc10) are mapped into the process then."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "libc10" in maps


async def test_a_sim_worker_starts_serves_and_checkpoints_without_importing_torch(nats_server, etcd_server, tmp_path) -> None:
    # torch was most of a simulated worker's start time and memory; nothing on its path needs it.
    profile = write_profile(tmp_path / "p.npz", {1: 0.004, 8: 0.01})
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    try:
        store = await stack.add_checkpoint_store()
        start = time.perf_counter()
        (worker,) = await stack.add_workers(1, "--engine", "sim", "--profile", str(profile))
        started_s = time.perf_counter() - start
        router = await stack.add_router()
        async with await Client.connect(router.address, timeout=30) as client:
            completions = await asyncio.gather(*(client.complete(list(range(20 + i, 70 + i)), max_tokens=12, ignore_eos=True) for i in range(4)))
        assert all(len(c.token_ids) == 12 for c in completions)
        # Its requests' KV went to the checkpoint store (numpy, a few bytes per position) while it served.
        metrics = (await asyncio.to_thread(_fetch, f"http://{worker.metrics_address}/metrics"))
        sent = [line for line in metrics.splitlines() if line.startswith("phalanx_checkpoint_sent_bytes_total")]
        assert sent and float(sent[0].split()[-1]) > 0, sent
        print(f"sim worker registered {started_s:.2f} s after its start; {rss_mib(worker.process.pid):.0f} MiB RSS; store {store.name}")
        assert not torch_loaded(worker.process.pid)
    finally:
        stack.stop()


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def _fetch(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - the test's own http:// URL
        return response.read().decode()


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
        # The OpenAI-compatible gateway serves them as what they are, with the profiled model's chat template.
        gateway = await start_gateway(router.address)
        try:
            async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30) as oai:
                models = await oai.models.list()
                chat = await oai.chat.completions.create(
                    model=f"sim:{MODEL}", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
                )
        finally:
            gateway.terminate()
        assert [m.id for m in models.data] == [f"sim:{MODEL}"]
        content = chat.choices[0].message.content or ""
        assert len(content) == 6 and set(content) <= set("abcdefghijklmnopqrstuvwxyz ")
        # Every simulated worker, asked directly, gives the same tokens.
        other_prompt = list(range(60, 100))
        first, second = await asyncio.gather(*(worker_tokens(w.address, other_prompt, 12) for w in workers))
        assert first == second == [simulated_token(other_prompt, i, 0, alphabet) for i in range(12)]
    finally:
        stack.stop()


async def test_profile_sweeps_a_real_worker_and_a_sim_worker_follows_what_it_wrote(nats_server, etcd_server, tmp_path) -> None:
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    try:
        (real,) = await stack.add_workers(1, "--fast")
        plan = SweepPlan(isls=(16, 512), contexts=(64,), concurrencies=(1, 8), decode_tokens=6, repeats=1)
        measured = await profile_worker(MODEL, plan, target=real.address)
        path = tmp_path / "measured.npz"
        save_profile(measured, path)
        loaded = load_profile(path)
        assert loaded.model == MODEL
        assert loaded.prefill_isl.tolist() == [16.0, 512.0]
        assert loaded.decode_concurrency.tolist() == [1.0, 8.0]
        assert loaded.decode_context.tolist() == [64.0 + 3]  # the prompt plus half the decoded tokens
        # A 512-token prompt takes the real model longer than a 16-token one.
        assert loaded.prefill_ttft_s[1] > loaded.prefill_ttft_s[0]
        (sim,) = await stack.add_workers(1, "--engine", "sim", "--profile", str(path))
        assert len(await worker_tokens(sim.address, list(range(30, 50)), 4)) == 4
    finally:
        stack.stop()


async def test_sim_worker_sigkilled_mid_generation_its_streams_migrate_and_continue_the_same_tokens(nats_server, etcd_server, tmp_path) -> None:
    # The real migration path (checkpoint store, migration service, router) moving simulated requests.
    from test_migration import KillWhenBusy, migrations_by_method, run_streams

    profile = write_profile(tmp_path / "m.npz", {1: 0.02, 16: 0.03}, prefill_base_s=0.02)
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    streams, max_tokens = 12, 40
    prompts = [list(range(10 + i, 90 + i)) for i in range(streams)]
    alphabet = token_alphabet(ByteTokenizer())
    try:
        await stack.add_checkpoint_store()
        await stack.add_migration()
        await stack.add_workers(3, "--engine", "sim", "--profile", str(profile))
        router = await stack.add_router()
        async with await Client.connect(router.address, timeout=60) as client:

            async def sigkill(worker) -> None:
                worker.kill()

            killer = KillWhenBusy(stack, after=6, action=sigkill, streams=streams, max_tokens=max_tokens)
            results = await run_streams(client, prompts, killer, max_tokens=max_tokens)
        assert killer.victim is not None
        moved = [i for i, w in killer.served_by.items() if w == killer.victim.worker_id]
        assert moved, "the victim served no stream"
        for i, chunks in results.items():
            assert [c.index for c in chunks] == list(range(max_tokens)), f"stream {i}: indices {[c.index for c in chunks]}"
            assert [c.token_id for c in chunks] == [simulated_token(prompts[i], n, 0, alphabet) for n in range(max_tokens)], f"stream {i}"
        by_method = await migrations_by_method(stack)
        print(f"moved {len(moved)} streams: {by_method}")
        # The survivors restored the victim's requests (KV from the checkpoint store, over gRPC) without torch.
        survivors = [w for w in stack.workers if w.worker_id != killer.victim.worker_id]
        assert survivors and not any(torch_loaded(w.process.pid) for w in survivors)
        assert by_method["router"] >= len(moved) and by_method["transfer"] == 0, by_method
    finally:
        await asyncio.to_thread(stack.stop)


async def tokens_per_s(client: Client, users: int, seconds: float, max_tokens: int = 4) -> float:
    """Closed-loop load: `users` clients each sending one request after another for `seconds`; tokens/s delivered."""
    produced = 0

    async def user(index: int) -> None:
        nonlocal produced
        n = 0
        while time.perf_counter() < end:
            completion = await client.complete([1 + index, 7 + n % 100, 9, 11] * 4, max_tokens=max_tokens, ignore_eos=True)
            assert len(completion.token_ids) == max_tokens
            produced += max_tokens
            n += 1

    start = time.perf_counter()
    end = start + seconds
    await asyncio.gather(*(user(i) for i in range(users)))
    return produced / (time.perf_counter() - start)


@pytest.mark.slow  # a minute and more on 2 cores
async def test_a_fleet_of_16_sim_workers_starts_quickly_and_its_throughput_grows_with_its_size(nats_server, etcd_server, tmp_path) -> None:
    # A prefill costs a forward pass too, as on a real worker: every step takes about as long, so the step times the
    # workers report (which the routers weigh queues with) are steady from the first step on.
    profile = write_profile(tmp_path / "fleet.npz", {1: FLEET_ITL_S, FLEET_MAX_SEQS: FLEET_ITL_S}, prefill_base_s=FLEET_ITL_S)
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=2), model=MODEL)
    env = {"PHALANX_ENGINE_MAX_NUM_SEQS": str(FLEET_MAX_SEQS)}
    flags = ("--engine", "sim", "--profile", str(profile))
    try:
        start = time.perf_counter()
        await stack.add_workers(2, *flags, env=env)
        started_s = time.perf_counter() - start
        router = await stack.add_router()
        async with await Client.connect(router.address, timeout=60) as client:
            await tokens_per_s(client, 8, 0.5)  # warm-up: channels, first routing decisions
            small = await tokens_per_s(client, USERS // 8, 6.0)  # as many per worker as the 16 get
            start = time.perf_counter()
            await stack.add_workers(14, *flags, env=env)
            started_s += time.perf_counter() - start

            async def all_routed() -> bool:
                return len(await client.list_workers()) == 16

            deadline = time.monotonic() + 20
            while not await all_routed():
                assert time.monotonic() < deadline, "the router did not see 16 workers"
                await asyncio.sleep(0.2)
            await tokens_per_s(client, 16, 0.5)
            large = await tokens_per_s(client, USERS, 6.0)
        print(f"16 sim workers started in {started_s:.1f} s; 2 workers {small:.0f} tokens/s, 16 workers {large:.0f} tokens/s")
        # Bounded start: 16 processes on a 2-core box, no model to load (~40 s here, most of it importing torch and grpc).
        assert started_s < 90
        # Capacity adds up: 2 workers carry 2 x 10 tokens/s at most, 16 carry eight times as much (the last requests of a
        # window and uneven routing of simultaneous arrivals cost some).
        assert small <= 2 * FLEET_MAX_SEQS / FLEET_ITL_S * 1.1
        assert large > 4 * small
    finally:
        stack.stop()
