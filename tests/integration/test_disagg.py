"""Disaggregated prefill and decode (router/disagg_flow.py) with real processes, and its failures.

One stack for the module: a prefill worker, two decode workers, the checkpoint store and migration, and a router that
sends every prompt of 16 tokens or more to the prefill worker (PHALANX_ROUTER_DISAGG_MODE=always). Every stream must
carry each index exactly once and the greedy tokens of an aggregated run (an engine in this process, on the same
model with the same batch-invariant numerics), whatever fails: a transfer that stalls, a decode worker SIGKILLed
mid-decode, the prefill worker SIGKILLed mid-prefill (last: the module's stack has no prefill worker after it).
"""

import asyncio

import pytest

import phalanx.model
from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.launch.topology import WorkerRole
from phalanx.model.sampling import SamplingParams
from phalanx.testing.asserts import assert_eventually
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
MAX_TOKENS = 24
PROMPTS = [f"Request {i}: tell the story of the lighthouse keeper number {i} and the long winter storm. " * 2 for i in range(4)]
CHAOS_TOKEN = "test-chaos-token-disagg-0123456789"
POISON = "prefill-poison"  # the prefill worker SIGKILLs itself taking a prompt with this marker
STALL = "stall-kv"  # and stalls the KV transfer of a request whose id has this one
CHAOS = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN}
PREFILL_ENV = {**CHAOS, "PHALANX_WORKER_CHAOS_CRASH_ON_PROMPT": POISON, "PHALANX_WORKER_CHAOS_STALL_KV_SEND": STALL}
# KV over tensor channels whatever its size (this model's is small enough for the gRPC fallback otherwise).
DECODE_ENV = {"PHALANX_WORKER_CHANNEL_MIN_BYTES": "0"}
ROUTER_ENV = {
    "PHALANX_ROUTER_DISAGG_MODE": "always", "PHALANX_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "16",
    "PHALANX_ROUTER_DISAGG_TRANSFER_TIMEOUT_S": "2", "PHALANX_ROUTER_QUARANTINE_AFTER_CRASHES": "3",
}


@pytest.fixture(scope="module")
def stack(nats_server, etcd_server):
    nats_server.start()
    etcd_server.start()
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)

    async def start():
        await asyncio.gather(s.add_checkpoint_store(), s.add_migration())
        prefill, decodes = await asyncio.gather(
            s.add_workers(1, *WorkerRole.PREFILL.flags, env=PREFILL_ENV), s.add_workers(2, *WorkerRole.DECODE.flags, env=DECODE_ENV)
        )
        ROLES["prefill"], ROLES["decode"] = [w.worker_id for w in prefill], [w.worker_id for w in decodes]
        await s.add_router(env=ROUTER_ENV)

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def aggregated():
    """Greedy tokens of a prompt on one aggregated engine (what a fleet without prefill workers streams)."""
    model = phalanx.model.load(MODEL)
    memo: dict[str, list[int]] = {}

    def tokens(prompt: str) -> list[int]:
        if prompt not in memo:
            engine = Engine(model, EngineConfig(deterministic=True))
            engine.add_request(EngineRequest(model.tokenizer.encode(prompt), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "r"))
            out = []
            while engine.has_work():
                out.extend(e.token_id for e in engine.step())
            memo[prompt] = out
        return memo[prompt]

    return tokens


# The module's stack's worker ids by role (its workers list is in start order, which is not by role).
ROLES: dict[str, list[str]] = {}


def roles(stack: Stack) -> tuple[str, list[str]]:
    """(the prefill worker, the decode workers alive)."""
    alive = {w.worker_id for w in stack.workers}
    return ROLES["prefill"][0], [d for d in ROLES["decode"] if d in alive]


async def stream(client: Client, prompt: str, request_id: str | None = None, on_chunk=None) -> list:
    chunks = []
    async for chunk in client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id):
        chunks.append(chunk)
        if on_chunk is not None:
            await on_chunk(chunk)
    return chunks


def assert_exactly_once_and_identical(chunks: list, expected: list[int]) -> None:
    assert [c.index for c in chunks] == list(range(MAX_TOKENS)), [c.index for c in chunks]
    assert [c.token_id for c in chunks] == expected, "differs from the aggregated run"


def router_metric(stack: Stack, name: str, **labels: str) -> float:
    return stack.routers[0].metric(name, **labels) or 0.0


async def test_prefilled_on_the_prefill_worker_then_decoded_with_its_kv_as_the_aggregated_run(stack, aggregated):
    prefill, decodes = roles(stack)
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        results = await asyncio.gather(*(stream(client, p) for p in PROMPTS))
    for prompt, chunks in zip(PROMPTS, results, strict=True):
        assert_exactly_once_and_identical(chunks, aggregated(prompt))
        # The first token from the prefill worker, the rest from a decode worker that got its KV.
        assert chunks[0].worker_id == prefill and {c.worker_id for c in chunks[1:]} <= set(decodes), [c.worker_id for c in chunks]
    assert router_metric(stack, "phalanx_router_disagg_prefills_total", where="remote") >= len(PROMPTS)
    assert router_metric(stack, "phalanx_router_disagg_transfers_total", outcome="ok") >= len(PROMPTS)
    assert router_metric(stack, "phalanx_router_disagg_transferred_bytes_total") > 0


async def test_the_prefix_the_decode_worker_caches_is_not_sent_again(stack, aggregated):
    prefill, decodes = roles(stack)
    # PROMPTS[0]'s KV reached a decode worker in the first test; this prompt extends it by more than the threshold.
    prompt = PROMPTS[0] + "Then the keeper climbed the stairs once more and lit the great lamp against the dark. " * 2
    skipped = router_metric(stack, "phalanx_router_disagg_skipped_tokens_total")
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        chunks = await stream(client, prompt)
    assert_exactly_once_and_identical(chunks, aggregated(prompt))
    assert chunks[0].worker_id == prefill and chunks[-1].worker_id in decodes
    assert router_metric(stack, "phalanx_router_disagg_skipped_tokens_total") >= skipped + 16


async def test_a_stalled_transfer_prefills_again_on_the_decode_side_and_the_next_one_transfers(stack, aggregated):
    prefill, decodes = roles(stack)
    failed_before = router_metric(stack, "phalanx_router_disagg_transfers_total", outcome="failed") + router_metric(
        stack, "phalanx_router_disagg_transfers_total", outcome="timeout"
    )
    ok_before = router_metric(stack, "phalanx_router_disagg_transfers_total", outcome="ok")
    prompt = PROMPTS[0] + " A stalled one."
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        stalled = await stream(client, prompt, request_id=f"{STALL}-1")
        after = await stream(client, PROMPTS[1] + " The next one.")
    assert_exactly_once_and_identical(stalled, aggregated(prompt))
    assert stalled[0].worker_id == prefill and {c.worker_id for c in stalled[1:]} <= set(decodes)
    failed = router_metric(stack, "phalanx_router_disagg_transfers_total", outcome="failed") + router_metric(
        stack, "phalanx_router_disagg_transfers_total", outcome="timeout"
    )
    assert failed == failed_before + 1
    # The channels the stalled transfer left behind do not hold up the next request's.
    assert_exactly_once_and_identical(after, aggregated(PROMPTS[1] + " The next one."))
    assert router_metric(stack, "phalanx_router_disagg_transfers_total", outcome="ok") == ok_before + 1


async def test_a_decode_worker_sigkilled_mid_decode_migrates_its_request(stack, aggregated):
    prefill, decodes = roles(stack)
    prompt = PROMPTS[2] + " Killed while decoding."
    killed: list[str] = []

    async def kill_decoder(chunk) -> None:
        if chunk.index == 6 and not killed:
            victim = next(w for w in stack.workers if w.worker_id == chunk.worker_id)
            killed.append(victim.worker_id)
            await asyncio.to_thread(victim.kill)

    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        chunks = await stream(client, prompt, on_chunk=kill_decoder)
    assert killed and killed[0] in decodes
    assert_exactly_once_and_identical(chunks, aggregated(prompt))
    survivor = next(d for d in decodes if d != killed[0])
    # The victim's tokens already on their way still name it; the rest come from the survivor, never the prefill worker.
    assert chunks[-1].worker_id == survivor and all(c.worker_id != prefill for c in chunks[1:])
    stack.workers = [w for w in stack.workers if w.worker_id != killed[0]]


async def test_the_prefill_worker_sigkilled_mid_prefill_prefills_again_on_a_decode_worker(stack, aggregated):
    prefill, decodes = roles(stack)
    prompt = f"{POISON}: " + PROMPTS[3]
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        chunks = await stream(client, prompt)
    assert_exactly_once_and_identical(chunks, aggregated(prompt))
    assert {c.worker_id for c in chunks} <= set(decodes)

    def dead() -> bool:
        return next(w for w in stack.workers if w.worker_id == prefill).process.poll() is not None

    await assert_eventually(dead, timeout=10)
