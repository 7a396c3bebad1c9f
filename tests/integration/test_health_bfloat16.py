"""Canaries on bfloat16 workers: a busy worker passes them, a corrupt one still fails them.

The rest of the suite pins float32 (tests/conftest.py), where a canary's tokens hardly depend on its batch. In
bfloat16 a canary beside a big batch once picked another token (a lone decode's kernels and a full batch's round
apart) and health counted a busy worker as corrupt; this module's workers compute in bfloat16.
"""

import asyncio

import grpc
import pytest

from phalanx._proto import chaos_pb2, chaos_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import WorkerDirectory
from phalanx.launch.stack import Stack
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.cleanup import forget_health_state
from phalanx.testing.workers import busy_batch

pytestmark = pytest.mark.integration

TOKEN = "test-chaos-token-bf16-0123456789"
INTERVAL_S = 0.5
WORKER_ENV = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": TOKEN, "PHALANX_ENGINE_DTYPE": "bfloat16"}
HEALTH_ENV = {
    "PHALANX_HEALTH_CHECK_INTERVAL_S": str(INTERVAL_S),
    "PHALANX_HEALTH_FAILURE_RECHECK_S": "0.25",
    "PHALANX_HEALTH_CIRCUIT_RECOVERY_S": "60",
    "PHALANX_HEALTH_LEADER_TTL_S": "1",
    "PHALANX_DEGRADATION_ENABLED": "false",
    # Every candidate prompt that qualifies, not the first 3: the one whose third token flipped beside a batch is among them.
    "PHALANX_HEALTH_CANARY_PROMPTS": "32",
}
HEALTHY, DRAINING = common_pb2.WORKER_HEALTH_HEALTHY, common_pb2.WORKER_HEALTH_DRAINING


@pytest.fixture(scope="module")
def fleet(nats_server, etcd_server):
    """Two chaos-enabled bfloat16 workers and a health instance."""
    etcd_config = EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)
    s = Stack(nats_server.url, etcd_config, model="phalanx-tiny-moe")

    async def start():
        await s.add_workers(2, "--fast", env=WORKER_ENV)
        await s.add_health(env=HEALTH_ENV)

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()
        asyncio.run(forget_health_state(etcd_config))


async def records(fleet: Stack) -> dict[str, common_pb2.WorkerHealthRecord]:
    return {r.worker_id: r for r in (await fleet.healths[0].list_health()).workers}


async def calibrated_in_bfloat16_and_checked(fleet: Stack) -> common_pb2.CanaryCalibration:
    """Health holds this fleet's bfloat16 calibration and judged both workers HEALTHY with it."""

    async def ready():
        listing = await fleet.healths[0].list_health()
        ours = [c for c in listing.calibrations if c.compute_dtype == "bfloat16"]
        assert len(ours) == 1, listing.calibrations
        calibration = ours[0]
        by_id = {r.worker_id: r for r in listing.workers}
        for w in fleet.workers:
            record = by_id[w.worker_id]
            assert record.health == HEALTHY and record.last_check_at > calibration.calibrated_at, record
        return calibration

    return await assert_eventually(ready, timeout=45, interval=0.2)


async def check_ends(fleet: Stack, worker_id: str) -> None:
    """Returns as health records its next check of the worker."""
    before = (await records(fleet))[worker_id].last_check_at

    async def checked():
        assert (await records(fleet))[worker_id].last_check_at != before
        return True

    await assert_eventually(checked, timeout=10 * INTERVAL_S + 5, interval=0.005)


async def test_workers_register_their_compute_dtype_and_calibrate_in_it(fleet):
    directory = WorkerDirectory(fleet.etcd_config)
    try:
        registrations = await directory.list()
    finally:
        await directory.close()
    assert {registrations[w.worker_id].compute_dtype for w in fleet.workers} == {"bfloat16"}
    calibration = await calibrated_in_bfloat16_and_checked(fleet)
    assert calibration.cases and all(case.expected_token_ids for case in calibration.cases)
    assert set(calibration.calibrated_on) == {w.worker_id for w in fleet.workers}


async def test_a_busy_bfloat16_worker_passes_its_canaries_beside_a_48_sequence_batch(fleet):
    busy = fleet.workers[0]
    calibration = await calibrated_in_bfloat16_and_checked(fleet)
    mismatches = fleet.healths[0].metric("phalanx_canary_failures_total", worker=busy.worker_id, reason="token_mismatch") or 0.0

    async with grpc.aio.insecure_channel(busy.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        async with busy_batch(stub, 48) as streams:
            async def batch_running():
                stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                assert stats.running_seqs >= 48, stats
                return True

            await assert_eventually(batch_running, timeout=20, interval=0.1)

            async def allowed():
                # Busy is not broken: health judges its canaries' latency by the steps its batch takes (health/load.py),
                # as test_health.py's float32 busy test waits for; a check before its load reports say so may time out.
                allowance = fleet.healths[0].metric("phalanx_health_load_allowance", worker=busy.worker_id)
                assert allowance is not None and allowance > 1.2, allowance
                return allowance

            await assert_eventually(allowed, timeout=20, interval=0.1)
            # Every calibrated canary beside the batch gives the tokens calibrated on the idle worker...
            for case in calibration.cases:
                request = worker_pb2.CanaryRequest(text=case.prompt_text, max_tokens=len(case.expected_token_ids))
                answer = await stub.Canary(request, timeout=30)
                assert list(answer.token_ids) == list(case.expected_token_ids), case.prompt_text
            # ...and so health's own checks, one a case, pass.
            for _ in range(len(calibration.cases)):
                await check_ends(fleet, busy.worker_id)
            assert not any(s.done() for s in streams)  # still busy through every check
    record = (await records(fleet))[busy.worker_id]
    assert record.health == HEALTHY and record.routing_weight == 1.0, record
    assert not record.last_failure.startswith("token_mismatch"), record.last_failure
    assert (fleet.healths[0].metric("phalanx_canary_failures_total", worker=busy.worker_id, reason="token_mismatch") or 0.0) == mismatches


async def test_a_corrupt_bfloat16_worker_is_still_caught_by_its_canaries_and_drained(fleet):
    victim = fleet.workers[1]
    await calibrated_in_bfloat16_and_checked(fleet)
    async with grpc.aio.insecure_channel(victim.address) as channel:
        await chaos_pb2_grpc.ChaosServiceStub(channel).InjectFault(
            chaos_pb2.InjectFaultRequest(
                kind=chaos_pb2.FAULT_KIND_CORRUPT, corrupt_target=chaos_pb2.CORRUPT_TARGET_LOGITS, corrupt_scale=1.0
            ),
            metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5,
        )

    async def drained():
        record = (await records(fleet))[victim.worker_id]
        assert record.health == DRAINING, record
        return record

    record = await assert_eventually(drained, timeout=3 * INTERVAL_S + 5, interval=0.02)
    assert record.last_failure.split(":")[0] in ("token_mismatch", "logit_out_of_range"), record.last_failure
    assert record.routing_weight == 0
