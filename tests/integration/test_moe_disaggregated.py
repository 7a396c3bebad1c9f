"""Disaggregated MoE: an attention worker (AW) calls expert workers (EWs) through the ERT, and survives an EW's SIGKILL.

Real processes throughout on real etcd and NATS: an ERT manager, three EWs
(every expert on two of them: a primary and a shadow), one AW and, as the
reference, one monolithic worker, all in deterministic mode.
"""

import asyncio
import os
import signal
import time

import grpc
import pytest

from phalanx._proto import common_pb2, expert_pb2, expert_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.common.discovery import decode_json
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import ERT_KEY
from phalanx.ert_manager.table import ExpertRoutingTable
from phalanx.launch.services import start_worker
from phalanx.launch.stack import Stack, unique_id
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
STREAMS = 6
MAX_TOKENS = 32
PROMPTS = [f"Stream {i}: the experts of layer {i % 4} answer the lantern keeper. " * (1 + i % 3) for i in range(STREAMS)]


def _request(text: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


async def _generate(address: str, on_token=None) -> dict[int, list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)

        async def one(i: int) -> list[int]:
            out = []
            async for chunk in stub.Generate(_request(PROMPTS[i])):
                out.append(chunk.token_id)
                if on_token is not None:
                    on_token(i, len(out))
            return out

        return dict(enumerate(await asyncio.gather(*(one(i) for i in range(STREAMS)))))


async def _table(etcd_config) -> ExpertRoutingTable | None:
    client = connect_etcd(etcd_config)
    try:
        held = await client.get(ERT_KEY.encode())
    finally:
        await client.close()
    return None if held is None else ExpertRoutingTable.from_proto(decode_json(held.value, expert_pb2.ExpertRoutingTable))


@pytest.fixture
async def stack(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model=MODEL)
    try:
        yield s
    finally:
        await asyncio.to_thread(s.stop)


async def test_sigkill_of_an_expert_worker_mid_generation_changes_no_token_and_drops_it_from_the_ert(stack, etcd_config):
    await stack.add_ert_manager()
    ews = await stack.add_expert_workers(3, copies=2)
    names = {ew.name for ew in ews}

    async def table_names_our_workers():
        table = await _table(etcd_config)
        return table is not None and set(table.workers) == names and table.complete and table

    before = await assert_eventually(table_names_our_workers, timeout=20, message="the ERT lists the three expert workers")
    (monolithic,) = await stack.add_workers(1)
    aw = await start_worker(unique_id("aw"), stack.nats_url, etcd_config, "--deterministic", "--role", "attention", model=MODEL)
    stack.workers.append(aw)

    expected = await _generate(monolithic.address)
    assert await _generate(aw.address) == expected, "the split deployment changed tokens before any failure"

    victim = next(ew for ew in ews if before.experts_of(ew.name))
    killed_at: list[float] = []

    def kill_mid_generation(i: int, produced: int) -> None:
        if not killed_at and produced >= MAX_TOKENS // 3:
            os.kill(victim.process.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    got = await _generate(aw.address, on_token=kill_mid_generation)
    assert killed_at, "the expert worker was not killed mid-generation"
    assert got == expected, "an expert worker's loss changed tokens"
    assert (await asyncio.to_thread(aw.metric, "phalanx_aw_expert_replays_total") or 0) > 0

    async def ert_drops_the_victim():
        table = await _table(etcd_config)
        return table is not None and victim.name not in table.workers and table.complete and table.version > before.version and table

    after = await assert_eventually(ert_drops_the_victim, timeout=10, message="the ERT manager drops the dead expert worker")
    # Its shadows took over: every expert it led is now led by the copy that shadowed it.
    for key in before.experts_of(victim.name):
        assert after.locations[key].primary == before.locations[key].shadows[0]
    # A replacement in the victim's placement slot joins while the AW is busy, takes its primaries back, and serves.
    from phalanx.launch.services import start_expert_worker

    slot = ews.index(victim)
    wave = asyncio.ensure_future(_generate(aw.address))
    replacement = await start_expert_worker(unique_id(f"ew{slot}"), etcd_config, model=MODEL, index=slot, num_expert_workers=3, copies=2)
    stack.expert_workers.append(replacement)
    assert await wave == expected

    async def replacement_leads():
        table = await _table(etcd_config)
        return table is not None and table.experts_of(replacement.name) == before.experts_of(victim.name)

    await assert_eventually(replacement_leads, timeout=10, message="the replacement leads its slot's experts")
    assert await _generate(aw.address) == expected
    assert (await asyncio.to_thread(aw.metric, "phalanx_aw_expert_calls_total", expert_worker=replacement.name) or 0) > 0


@pytest.mark.slow
async def test_a_hung_expert_worker_is_found_by_probe_and_its_work_replayed_on_the_shadow(stack, etcd_config):
    await stack.add_ert_manager()
    ews = await stack.add_expert_workers(2, copies=2)
    names = {ew.name for ew in ews}

    async def table_names_our_workers():
        table = await _table(etcd_config)
        return table is not None and set(table.workers) == names and table.complete

    await assert_eventually(table_names_our_workers, timeout=20, message="the ERT lists both expert workers")
    (monolithic,) = await stack.add_workers(1)
    aw = await start_worker(
        unique_id("aw"), stack.nats_url, etcd_config, "--deterministic", "--role", "attention", model=MODEL,
        env={"PHALANX_ENGINE_EXPERT_TIMEOUT_S": "0.5"},
    )
    stack.workers.append(aw)
    expected = await _generate(monolithic.address)
    victim = ews[0]
    stopped: list[float] = []

    def stop_mid_generation(i: int, produced: int) -> None:
        if not stopped and produced >= MAX_TOKENS // 3:
            os.kill(victim.process.pid, signal.SIGSTOP)  # alive to the kernel, silent on the data and control paths
            stopped.append(time.monotonic())

    try:
        got = await _generate(aw.address, on_token=stop_mid_generation)
    finally:
        victim.kill()  # a stopped process would sit out SIGTERM
    assert stopped and got == expected, "a hung expert worker changed tokens"
    await assert_eventually(
        lambda: (aw.metric("phalanx_aw_expert_probe_failures_total", expert_worker=victim.name) or 0) > 0,
        timeout=5, message="the hung expert worker failed its probe",
    )
    assert (await asyncio.to_thread(aw.metric, "phalanx_aw_expert_replays_total", expert_worker=victim.name) or 0) > 0


@pytest.mark.slow
async def test_sigkill_of_an_attention_worker_moves_its_streams_while_the_experts_keep_serving_the_other(stack, etcd_config):
    from phalanx.client import Client

    await stack.add_checkpoint_store()
    await stack.add_migration()
    await stack.add_ert_manager()
    ews = await stack.add_expert_workers(2, copies=2)
    names = {ew.name for ew in ews}

    async def table_names_our_workers():
        table = await _table(etcd_config)
        return table is not None and set(table.workers) == names and table.complete

    await assert_eventually(table_names_our_workers, timeout=20, message="the ERT lists both expert workers")
    aws = await stack.add_workers(2, "--role", "attention")
    router = await stack.add_router()

    async def streams(on_chunk=None) -> dict[int, list]:
        async def one(i: int) -> list:
            chunks = []
            async for chunk in client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True):
                chunks.append(chunk)
                if on_chunk is not None:
                    on_chunk(i, chunk)
            return chunks

        return dict(enumerate(await asyncio.gather(*(one(i) for i in range(STREAMS)))))

    async with await Client.connect(router.address, timeout=60) as client:
        baseline = {i: [c.token_id for c in chunks] for i, chunks in (await streams()).items()}
        served_by: dict[int, str] = {}
        progress: dict[int, int] = {}
        killed: list = []

        def kill_the_busiest_attention_worker(i: int, chunk) -> None:
            served_by.setdefault(i, chunk.worker_id)
            progress[i] = progress.get(i, 0) + 1
            if killed or len(progress) < STREAMS or min(progress.values()) < 6:
                return
            busiest = max(aws, key=lambda w: sum(1 for s in served_by.values() if s == w.worker_id))
            os.kill(busiest.process.pid, signal.SIGKILL)
            killed.append(busiest)

        results = await streams(kill_the_busiest_attention_worker)
    (victim,) = killed
    assert any(w == victim.worker_id for w in served_by.values())
    for i, chunks in results.items():
        assert [c.index for c in chunks] == list(range(MAX_TOKENS)), f"stream {i}: indices {[c.index for c in chunks]}"
        assert [c.token_id for c in chunks] == baseline[i], f"stream {i} differs from the fault-free run"
    # The expert workers lost a peer, not their service: both still run and serve the surviving AW.
    assert all(ew.process.poll() is None for ew in ews)
    survivor = next(w for w in aws if w is not victim)
    assert (await asyncio.to_thread(survivor.metric, "phalanx_aw_expert_replays_total") or 0) == 0


@pytest.mark.slow
async def test_the_split_in_bfloat16_gives_the_monoliths_tokens_and_an_expert_worker_of_another_dtype_is_refused(stack, etcd_config):
    """The dtype the engines run in (bfloat16 here, CUDA's default) reaches the experts: an EW computes in it, and one
    set up with another refuses the AW's channel rather than compute on bits of another dtype (same-sized bfloat16 and
    float16 would pass the channel)."""
    bf16 = {"PHALANX_ENGINE_DTYPE": "bfloat16"}
    await stack.add_ert_manager()
    (ew,) = await stack.add_expert_workers(1, "--dtype", "bfloat16")
    await assert_eventually(
        lambda: _table_lists(etcd_config, {ew.name}), timeout=20, message="the ERT lists the expert worker"
    )
    (monolithic,) = await stack.add_workers(1, env=bf16)
    aw = await start_worker(unique_id("aw"), stack.nats_url, etcd_config, "--deterministic", "--role", "attention", model=MODEL, env=bf16)
    stack.workers.append(aw)
    assert await _generate(aw.address) == await _generate(monolithic.address)

    async with grpc.aio.insecure_channel(ew.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await expert_pb2_grpc.ExpertServiceStub(channel).Connect(
                expert_pb2.ConnectRequest(attention_worker_id="aw-float32", channel_id="moe-aw-float32-0", dtype="float32"), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sends float32" in refused.value.details() and "computes in bfloat16" in refused.value.details()


async def _table_lists(etcd_config, names: set[str]) -> bool:
    table = await _table(etcd_config)
    return table is not None and set(table.workers) == names and table.complete
