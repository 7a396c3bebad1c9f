"""An expert worker batches the attention workers' calls of a layer across AWs, and never waits for an AW that is gone.

Real processes on real etcd and NATS, deterministic mode: an ERT manager, two EWs (every expert on both), two AWs
calling them at once and a monolithic worker as the reference.
"""

import asyncio
import os
import signal

import grpc
import pytest

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.launch.services import ServiceHandle
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
STREAMS = 4
MAX_TOKENS = 24
WINDOW_S = 0.05  # longer than the 2 ms default, so that a wait for a missing AW is told apart from no wait
SILENCE_S = 0.3


def _prompts(tag: str) -> list[str]:
    return [f"{tag} {i}: the experts of layer {i % 4} answer every lantern keeper at once. " * (1 + i % 2) for i in range(STREAMS)]


async def _generate(address: str, prompts: list[str], on_token=None) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)

        async def one(i: int) -> list[int]:
            request = worker_pb2.GenerateRequest(text=prompts[i], sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            out = []
            async for chunk in stub.Generate(request, timeout=120):
                out.append(chunk.token_id)
                if on_token is not None:
                    on_token(len(out))
            return out

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _sum(ews: list[ServiceHandle], name: str, **labels: str) -> float:
    return sum(ew.metric(name, **labels) or 0.0 for ew in ews)


@pytest.fixture
async def fleet(nats_config, etcd_config):
    stack = Stack(nats_config.url, etcd_config, model=MODEL)
    try:
        await stack.add_ert_manager()
        env = {"PHALANX_EXPERT_BATCH_WINDOW_S": str(WINDOW_S), "PHALANX_EXPERT_ATTENTION_SILENCE_S": str(SILENCE_S)}
        ews = await stack.add_expert_workers(2, copies=2, env=env)
        (monolithic,) = await stack.add_workers(1)
        aws = await stack.add_workers(2, "--role", "attention")
        yield ews, monolithic, aws
    finally:
        await asyncio.to_thread(stack.stop)


@pytest.mark.slow
async def test_calls_of_two_attention_workers_batched_on_the_expert_workers_give_the_monolithic_tokens(fleet):
    ews, monolithic, (aw_a, aw_b) = fleet
    prompts_a, prompts_b = _prompts("A"), _prompts("B")
    want_a, want_b = await _generate(monolithic.address, prompts_a), await _generate(monolithic.address, prompts_b)
    before = await asyncio.to_thread(_sum, ews, "phalanx_expert_batch_attention_workers_bucket", le="1.0")
    got_a, got_b = await asyncio.gather(_generate(aw_a.address, prompts_a), _generate(aw_b.address, prompts_b))
    assert got_a == want_a and got_b == want_b, "batching across attention workers changed tokens"
    batches = await asyncio.to_thread(_sum, ews, "phalanx_expert_batch_attention_workers_count")
    solo = await asyncio.to_thread(_sum, ews, "phalanx_expert_batch_attention_workers_bucket", le="1.0")
    assert batches - solo > 0, "no layer batch held both attention workers' calls"
    assert solo - before < batches, "every batch held one attention worker's call"


@pytest.mark.slow
async def test_a_stopped_then_killed_attention_worker_is_not_waited_for_and_the_other_keeps_its_tokens(fleet):
    ews, monolithic, (aw_a, aw_b) = fleet
    prompts_a, prompts_b = _prompts("A"), _prompts("B")
    want_a = await _generate(monolithic.address, prompts_a)
    # Both AWs busy, then b stops (alive, silent: its channels stay open) while a's streams are under way.
    stopped: list[bool] = []

    def stop_b(produced: int) -> None:
        if not stopped and produced >= MAX_TOKENS // 3:
            os.kill(aw_b.process.pid, signal.SIGSTOP)
            stopped.append(True)

    wave_b = asyncio.ensure_future(_generate(aw_b.address, prompts_b))
    try:
        got_a = await _generate(aw_a.address, prompts_a, on_token=stop_b)
        assert stopped and got_a == want_a, "a stopped attention worker changed the other's tokens"
        # Every batch started within the window (plus scheduling on a loaded box): nobody waits on b longer.
        waits = await asyncio.to_thread(_sum, ews, "phalanx_expert_batch_wait_seconds_count")
        assert await asyncio.to_thread(_sum, ews, "phalanx_expert_batch_wait_seconds_bucket", le="0.25") == waits
        # Past the silence window b is not expected at all: a's next wave waits for nobody.
        await asyncio.sleep(SILENCE_S)
        timed_out = await asyncio.to_thread(_sum, ews, "phalanx_expert_batches_total", start="window")
        assert await _generate(aw_a.address, prompts_a) == want_a
        assert await asyncio.to_thread(_sum, ews, "phalanx_expert_batches_total", start="window") == timed_out
    finally:
        aw_b.kill()  # a stopped process would sit out SIGTERM
    wave_b.cancel()
    # Killed, its channels close: the EWs drop it at once, and a keeps being served without waits.
    await assert_eventually(
        lambda: _sum(ews, "phalanx_expert_attention_workers") == 2 * 1, timeout=10, message="the EWs closed the dead AW's channels"
    )
    timed_out = await asyncio.to_thread(_sum, ews, "phalanx_expert_batches_total", start="window")
    assert await _generate(aw_a.address, prompts_a) == want_a
    assert await asyncio.to_thread(_sum, ews, "phalanx_expert_batches_total", start="window") == timed_out


@pytest.mark.slow
async def test_a_new_expert_replica_and_a_new_attention_worker_join_under_load_without_changing_a_token(nats_config, etcd_config):
    """Replicas-only placement: an EW joining as one more replica of slot 0 takes calls from the next layer call after the
    ERT names it (an AW reads the table once per layer), and an AW started mid-wave is batched with the busy one."""
    from phalanx.launch.services import start_expert_worker, start_worker
    from phalanx.launch.stack import unique_id

    stack = Stack(nats_config.url, etcd_config, model=MODEL)
    try:
        await stack.add_ert_manager()
        ews = await stack.add_expert_workers(2, "--replicas", copies=2)
        (monolithic,) = await stack.add_workers(1)
        (aw_a,) = await stack.add_workers(1, "--role", "attention")
        prompts_a, prompts_c = _prompts("A"), _prompts("C")
        want_a, want_c = await _generate(monolithic.address, prompts_a), await _generate(monolithic.address, prompts_c)
        stop = asyncio.Event()

        async def keep_a_busy() -> int:
            """Waves on a, back to back, until told to stop: every join below lands while a is generating."""
            waves = 0
            while not stop.is_set():
                assert await _generate(aw_a.address, prompts_a) == want_a, "a join under load changed the busy AW's tokens"
                waves += 1
            return waves

        busy = asyncio.ensure_future(keep_a_busy())
        try:
            joined = await start_expert_worker(
                unique_id("ew0b"), etcd_config, "--replicas", model=MODEL, index=0, num_expert_workers=2, copies=2
            )
            stack.expert_workers.append(joined)
            aw_c = await start_worker(unique_id("awc"), stack.nats_url, etcd_config, "--deterministic", "--role", "attention", model=MODEL)
            stack.workers.append(aw_c)
            assert await _generate(aw_c.address, prompts_c) == want_c, "the attention worker that joined under load gives other tokens"
            await assert_eventually(
                lambda: (joined.metric("phalanx_expert_calls_total") or 0) > 0, timeout=30, message="the new replica takes calls"
            )
            assert not busy.done(), "the busy attention worker stopped early"
        finally:
            stop.set()
            waves = await busy
        assert waves >= 2
        assert all(ew.process.poll() is None for ew in ews)
    finally:
        await asyncio.to_thread(stack.stop)
