"""Engine failover with real processes: a primary and a shadow on one memory service and lock.

Probes per state, no registration before the takeover, streams that survive
the primary's SIGKILL on the shadow with identical tokens, a standing-by
shadow that dies and is replaced unnoticed, and engines that keep their
mapped weights when their memory service dies and re-attach to its successor.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from phalanx._proto import chaos_pb2, chaos_pb2_grpc
from phalanx.client import Client
from phalanx.common.discovery import WorkerDirectory
from phalanx.launch.services import FailoverEngineHandle, start_memory_service, wait_registered
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
STREAMS = 8
MAX_TOKENS = 48
CHAOS_TOKEN = "test-chaos-token-engine-failover-0123"
CHAOS = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN}
PROMPTS = [f"Request {i}: the shadow engine keeps the lighthouse lit through storm number {i}. " * 3 for i in range(STREAMS)]
STATES = {"init": 0, "standby": 1, "waking": 2, "active": 3}


@pytest.fixture
async def stack(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model=MODEL)
    try:
        yield s
    finally:
        await asyncio.to_thread(s.stop)


async def registered(etcd_config) -> dict:
    directory = WorkerDirectory(etcd_config)
    try:
        return await directory.list()
    finally:
        await directory.close()


async def probes(engine: FailoverEngineHandle) -> tuple[int | None, ...]:
    return tuple([await asyncio.to_thread(engine.probe, name) for name in ("startup", "live", "ready")])


async def state(engine: FailoverEngineHandle) -> float | None:
    return await asyncio.to_thread(engine.metric, "phalanx_failover_state")


async def test_probes_follow_the_states_and_the_shadow_registers_only_after_the_takeover(stack, etcd_config):
    slot = await stack.add_failover_slot()
    primary, shadow = slot.engines
    assert await probes(primary) == (200, 200, 200)
    assert await state(primary) == STATES["active"]
    assert await state(shadow) == STATES["standby"]
    assert await probes(shadow) == (200, 200, 200)
    assert shadow.worker_id not in await registered(etcd_config), "a standing-by shadow must not be in etcd"

    primary.kill()
    assert await probes(primary) == (None, None, None)  # DEAD: refused
    registration = await wait_registered(shadow, etcd_config, timeout=10)
    assert registration.failover_slot == slot.name
    assert await state(shadow) == STATES["active"]
    assert await probes(shadow) == (200, 200, 200)
    assert await asyncio.to_thread(shadow.metric, "phalanx_failover_switch_attempts_total") == 1
    assert await asyncio.to_thread(shadow.metric, "phalanx_failover_switch_successes_total") == 1


@pytest.mark.slow
async def test_an_engine_in_init_fails_its_startup_probe(stack):
    slot = await stack.add_failover_slot(engines=False)
    slot.next_engine_id = 1  # read-only: it waits for a commit that nobody makes
    engine = await stack.add_failover_engine(slot, "shadow", wait_startup=False, env={"PHALANX_WORKER_WEIGHTS_TIMEOUT_S": "60"})
    assert await probes(engine) == (503, 200, 503)
    assert await state(engine) == STATES["init"]


async def test_primary_sigkilled_under_load_streams_continue_on_the_shadow_with_identical_tokens(stack, etcd_config):
    await stack.add_checkpoint_store()
    await stack.add_migration()
    slot = await stack.add_failover_slot(env=CHAOS)
    primary, shadow = slot.engines
    await stack.add_router()
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        baseline = await _streams(client)  # on the primary: its prefix cache draws the streams back to it below
        # Its steps take 50 ms from now on: the kill lands mid-generation however fast the device (a GPU ends
        # 48 tokens before a slow start's last stream has 8). The shadow, its own process, runs at full speed.
        async with grpc.aio.insecure_channel(primary.address) as channel:
            await chaos_pb2_grpc.ChaosServiceStub(channel).InjectFault(
                chaos_pb2.InjectFaultRequest(kind=chaos_pb2.FAULT_KIND_SLOW, slow_step_s=0.05),
                metadata=[("authorization", f"Bearer {CHAOS_TOKEN}")], timeout=5,
            )
        # A plain worker beside the slot, idle when the primary dies: migration must still pick the slot's shadow.
        (peer,) = await stack.add_workers(1)

        async def routed() -> bool:
            return peer.worker_id in {w.worker_id for w in await client.list_workers()}

        await assert_eventually(routed, timeout=10)
        progress: collections.Counter[int] = collections.Counter()
        at_kill: dict[int, int] = {}

        def on_chunk(i: int, chunk) -> None:
            progress[i] += 1
            if not at_kill and len(progress) == STREAMS and min(progress.values()) >= 8:
                primary.kill()
                at_kill.update(progress)

        results = await _streams(client, on_chunk)
    cut = [i for i, n in at_kill.items() if n < MAX_TOKENS and results[i][0].worker_id == primary.worker_id]
    assert len(cut) >= 2, f"the kill came too late or the primary served too few streams: {at_kill}"
    for i, chunks in results.items():
        assert [c.index for c in chunks] == list(range(MAX_TOKENS)), f"stream {i}: indices {[c.index for c in chunks]}"
        assert [c.token_id for c in chunks] == [c.token_id for c in baseline[i]], f"stream {i} differs from the fault-free run"
    for i in cut:
        assert results[i][-1].worker_id == shadow.worker_id, f"stream {i} ended on {results[i][-1].worker_id}, not the shadow"
    assert await state(shadow) == STATES["active"]


@pytest.mark.slow
async def test_a_shadow_that_dies_standing_by_is_replaced_and_the_primary_never_notices(stack, etcd_config):
    await stack.add_checkpoint_store()
    slot = await stack.add_failover_slot()
    primary, shadow = slot.engines
    await stack.add_router()
    async with await Client.connect(stack.routers[0].address, timeout=60) as client:
        baseline = await _streams(client)
        killed = asyncio.Event()

        def on_chunk(i: int, chunk) -> None:
            if not killed.is_set() and chunk.index == 8:
                shadow.kill()
                killed.set()

        results = await _streams(client, on_chunk)
        replacement = await stack.add_failover_engine(slot, "shadow")
        await assert_eventually(lambda: _is(state(replacement), STATES["standby"]), timeout=30, interval=0.05)
    assert killed.is_set()
    for i, chunks in results.items():
        assert [c.token_id for c in chunks] == [c.token_id for c in baseline[i]]
        assert {c.worker_id for c in chunks} == {primary.worker_id}
    assert primary.process.poll() is None
    assert (await registered(etcd_config))[primary.worker_id].pid == primary.process.pid
    assert await state(primary) == STATES["active"]
    assert await probes(primary) == (200, 200, 200)
    assert replacement.worker_id not in await registered(etcd_config)


@pytest.mark.slow
async def test_engines_keep_their_weights_when_the_memory_service_dies_and_reattach_to_its_successor(stack, etcd_config):
    slot = await stack.add_failover_slot()
    primary, shadow = slot.engines
    slot.memory.kill()
    # Its successor, in place (the slot's socket and segments), as a supervisor starts it.
    slot.memory = await start_memory_service(slot.socket, slot.segments, name=f"{slot.name}-memory-2")

    def readers(count: int):
        async def held() -> bool:
            try:
                return (await asyncio.to_thread(slot.memory.metric, "phalanx_memory_readers") or 0) == count
            except OSError:  # its /metrics not up yet
                return False
        return held

    # Both engines mapped the weights from the segment files, which outlive the service: they re-attach, not exit.
    await assert_eventually(readers(2), timeout=30)
    assert primary.process.poll() is None and shadow.process.poll() is None
    assert await state(primary) == STATES["active"] and await state(shadow) == STATES["standby"]
    assert (await registered(etcd_config))[primary.worker_id].pid == primary.process.pid
    # A standby started now gets the weights from the successor.
    late = await stack.add_failover_engine(slot, "shadow")
    assert await state(late) == STATES["standby"]
    await assert_eventually(readers(3), timeout=30)


@pytest.mark.slow
async def test_a_wake_past_its_watchdog_exits_the_engine(stack, etcd_config):
    slot = await stack.add_failover_slot()
    primary = slot.engines[0]
    # A watchdog no wake can meet: the engine must end itself (status 3) instead of hanging half awake.
    hung = await stack.add_failover_engine(slot, "shadow", env={"PHALANX_WORKER_WAKE_TIMEOUT_S": "0.001"})
    slot.engines[1].kill()
    primary.kill()
    assert await asyncio.to_thread(hung.process.wait, 30) == 3
    assert hung.worker_id not in await registered(etcd_config)


async def _is(value, expected) -> bool:
    return (await value) == expected


async def _streams(client: Client, on_chunk=None) -> dict[int, list]:
    async def one(i: int) -> list:
        chunks = []
        async for chunk in client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True):
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(i, chunk)
        return chunks

    return dict(enumerate(await asyncio.gather(*(one(i) for i in range(STREAMS)))))
