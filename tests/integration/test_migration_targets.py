"""How the migration service prices targets: NATS load reports when fresh, a Stats call otherwise, plus its own
restores still in flight."""

import asyncio
import contextlib

import pytest

from phalanx._proto import common_pb2, migration_pb2
from phalanx.launch.ports import free_port
from phalanx.migration.config import MigrationConfig
from phalanx.migration.core import Migrator, Plan
from phalanx.migration.metrics import MigrationMetrics

pytestmark = pytest.mark.integration


def plan(tokens: int) -> Plan:
    return Plan(common_pb2.RequestState(prompt_token_ids=list(range(tokens))), 0, migration_pb2.MIGRATION_METHOD_REPREFILL)


def registration(worker_id: str) -> common_pb2.WorkerRegistration:
    # Nobody listens there: a Stats call to it fails, so only a load report can make it a target.
    return common_pb2.WorkerRegistration(worker_id=worker_id, address=f"127.0.0.1:{free_port()}")


@pytest.fixture
async def migrator(etcd_config):
    m = Migrator(MigrationConfig(load_report_max_age_s=0.2), etcd_config, None, MigrationMetrics())
    try:
        yield m
    finally:
        await m.close()


async def test_fresh_load_reports_price_targets_without_a_stats_call_and_stale_ones_do_not(migrator):
    workers = {w: registration(w) for w in ("busy", "idle", "full")}
    await migrator.on_load(common_pb2.LoadReport(worker_id="busy", running_seqs=6, free_blocks=500))
    await migrator.on_load(common_pb2.LoadReport(worker_id="idle", running_seqs=1, free_blocks=500))
    await migrator.on_load(common_pb2.LoadReport(worker_id="full", running_seqs=0, free_blocks=2))
    picked, load = await migrator._pick_target(plan(100), workers, {"gone"})
    assert picked.worker_id == "idle" and load.running_seqs == 1  # "full" lacks the 7 blocks; "busy" is busier

    # Restores in flight count: five bound for "idle" make "busy" the less loaded one.
    with contextlib.ExitStack() as holds:
        for _ in range(5):
            holds.enter_context(migrator._reserved.hold("idle", 7))
        assert (await migrator._pick_target(plan(100), workers, {"gone"}))[0].worker_id == "busy"

    await asyncio.sleep(0.25)  # every report is stale now: Stats is asked, and nobody answers it
    assert await migrator._pick_target(plan(100), workers, {"gone"}) is None
