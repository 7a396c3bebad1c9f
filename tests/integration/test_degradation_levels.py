"""Every degradation level acts end to end: the state the health service publishes in etcd steers real routers and workers.

The tests write the DegradationState the capacity model publishes at a level (the same policy code) and watch a
real router admit, shed and judge latency by it, and a real worker shrink its batch.
"""

import asyncio

import grpc
import pytest

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.client import Client, OverloadedError
from phalanx.common.discovery import encode_json
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import DEGRADATION_KEY
from phalanx.health.config import DegradationConfig
from phalanx.health.degradation import DegradationPolicy, WorkerCapacity
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

TIERS = ("premium", "standard", "best_effort")


@pytest.fixture
async def stack(nats_config, etcd_config):
    s = Stack(nats_config.url, etcd_config, model="phalanx-tiny-moe")
    yield s
    await asyncio.to_thread(s.stop)


@pytest.fixture
async def etcd(etcd_config):
    client = connect_etcd(etcd_config)
    yield client
    await client.delete(DEGRADATION_KEY.encode())
    await client.close()


def published(level: int, **slos: float) -> common_pb2.DegradationState:
    """What the health service writes at `level`: its policy's decision, held at that level."""
    policy = DegradationPolicy(DegradationConfig(**slos), level=level)
    # One fresh, idle worker: no pressure to raise the level, and lowering waits lower_after_s.
    idle = WorkerCapacity(
        worker_id="w", routable=True, weight=1.0, decode_tokens_per_s=0.0, prefill_tokens_per_s=0.0, step_time_s=0.0,
        queue_depth=0, running_seqs=0, free_blocks=1000, total_blocks=1000, report_age_s=0.0,
    )
    decision = policy.evaluate(0.0, [idle])
    assert decision.level == level
    return common_pb2.DegradationState(
        level=decision.level, reason="test", ttft_slo_s=decision.ttft_slo_s, tpot_slo_s=decision.tpot_slo_s,
        batch_scale=decision.batch_scale,
    )


async def served_tiers(client: Client) -> set[str]:
    served = set()
    for tier in TIERS:
        try:
            assert len((await client.complete(f"{tier} asks", max_tokens=2, tier=tier)).token_ids) == 2
            served.add(tier)
        except OverloadedError as error:
            assert error.retry_after_s and error.retry_after_s > 0
            assert "degradation level" in error.message and tier in error.message, error.message
    return served


async def test_router_admits_by_every_level_and_level_four_drains_what_runs(stack, etcd):
    await stack.add_workers(1)
    router = await stack.add_router()
    expected = {0: set(TIERS), 1: set(TIERS), 2: {"premium", "standard"}, 3: {"premium", "standard"}, 4: set()}
    prompt, length = "a long answer that began before level 4", 256
    async with await Client.connect(router.address, timeout=120) as client:
        running = client.generate(prompt, max_tokens=length, ignore_eos=True, request_id="drained-1")
        chunks = [await running.__anext__()]
        for level, tiers in expected.items():
            await etcd.put(DEGRADATION_KEY.encode(), encode_json(published(level)))

            async def at_level(level=level, tiers=tiers):
                assert await served_tiers(client) == tiers, level
                return True

            await assert_eventually(at_level, timeout=10, message=f"admission at level {level}")
        with pytest.raises(OverloadedError) as refused:
            await client.complete("new at level 4", max_tokens=2, tier="premium")
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "every new request is refused, premium included, while the requests in flight finish" in refused.value.message

        # Level 4 drains: a client's retry of the running request is no new request, and streams it from the start;
        # the stream that began before level 4 finishes, every token once.
        again = client.generate(prompt, max_tokens=length, ignore_eos=True, request_id="drained-1")
        retried = [await again.__anext__()]
        chunks += [c async for c in running]
        retried += [c async for c in again]
        assert [c.index for c in chunks] == [c.index for c in retried] == list(range(length))
        assert [c.token_id for c in retried] == [c.token_id for c in chunks]


async def test_premium_is_served_at_level_four_only_when_the_router_is_told_to(stack, etcd):
    await stack.add_workers(1)
    router = await stack.add_router(env={"PHALANX_ROUTER_PREMIUM_AT_LEVEL_4": "true"})
    async with await Client.connect(router.address, timeout=60) as client:
        await etcd.put(DEGRADATION_KEY.encode(), encode_json(published(4)))

        async def premium_only():
            assert await served_tiers(client) == {"premium"}
            return True

        await assert_eventually(premium_only, timeout=10)


async def test_router_counts_latency_slo_violations_against_the_slo_in_force(stack, etcd):
    await stack.add_workers(1)
    router = await stack.add_router()

    def violations(kind: str) -> float:
        return router.metric("phalanx_router_slo_violations_total", kind=kind) or 0.0

    async with await Client.connect(router.address, timeout=60) as client:
        assert len((await client.complete("no SLO published yet", max_tokens=4, ignore_eos=True)).token_ids) == 4
        assert (violations("ttft"), violations("itl")) == (0.0, 0.0)

        # Level 2 promises the configured SLOs: a microsecond is missed by every first token and gap.
        await etcd.put(DEGRADATION_KEY.encode(), encode_json(published(2, slo_ttft_s=1e-6, slo_tpot_s=1e-6)))

        async def counted():
            before = violations("ttft"), violations("itl")
            await client.complete("judged", max_tokens=4, ignore_eos=True)
            assert violations("ttft") == before[0] + 1 and before[1] + 1 <= violations("itl") <= before[1] + 3
            return True

        await assert_eventually(counted, timeout=10)

        # Level 3 relaxes them x2: what the router reads is the relaxed SLO (here 2 x 1000 s), so nothing misses.
        relaxed = published(3, slo_ttft_s=1000.0, slo_tpot_s=1000.0)
        assert (relaxed.ttft_slo_s, relaxed.tpot_slo_s) == (2000.0, 2000.0)
        await etcd.put(DEGRADATION_KEY.encode(), encode_json(relaxed))
        await assert_eventually(lambda: router.metric("phalanx_router_degradation_level") == 3, timeout=10)
        before = violations("ttft"), violations("itl")
        assert len((await client.complete("relaxed", max_tokens=4, ignore_eos=True)).token_ids) == 4
        assert (violations("ttft"), violations("itl")) == before


@pytest.mark.slow
async def test_worker_runs_half_its_batch_at_level_three(stack, etcd):
    (worker,) = await stack.add_workers(1, env={"PHALANX_ENGINE_MAX_NUM_SEQS": "4"})
    router = await stack.add_router()
    await etcd.put(DEGRADATION_KEY.encode(), encode_json(published(3)))
    await assert_eventually(lambda: worker.metric("phalanx_worker_batch_scale", worker=worker.worker_id) == 0.5, timeout=10)
    async with await Client.connect(router.address, timeout=120) as client, grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        requests = [
            asyncio.create_task(client.complete(f"one of four at level 3, number {i}", max_tokens=200, ignore_eos=True)) for i in range(4)
        ]
        seen = []

        async def half_run_half_wait():
            stats = await stub.Stats(worker_pb2.StatsRequest())
            seen.append(stats.running_seqs)
            return stats.running_seqs == 2 and stats.queue_depth == 2

        await assert_eventually(half_run_half_wait, timeout=30, interval=0.02)
        results = await asyncio.gather(*requests)
    assert all(len(r.token_ids) == 200 for r in results)
    assert max(seen) <= 2, seen  # max_num_seqs 4 x 0.5
