"""The planner's local connector keeps hot spares per pool of a disaggregated fleet, against a real etcd (the spares' marks):
a prefill spare starts with `--role prefill`, a dead prefill worker's capacity waits for the promotion of a prefill spare,
and the promoted spare's pool gets a new one. Worker processes are stand-ins: what is tested is the connector's
bookkeeping and its etcd marks, not a worker."""

from __future__ import annotations

import asyncio
import time

import pytest

from phalanx.common.config import EtcdConfig
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import SPARES_PREFIX
from phalanx.launch.local_fleet import PLANNER_ID, LocalSettings
from phalanx.launch.supervisor import Supervisor
from phalanx.launch.topology import Fleet, WorkerGroup, WorkerRole
from phalanx.planner.connectors import AckRecord, DecisionRecord
from phalanx.planner.local_connector import LocalConnector
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.supervisor import RecordedView, StandInWorkers

pytestmark = pytest.mark.integration

PREFILL_FLAGS = ("--role", "prefill")


async def _marks(etcd_config: EtcdConfig) -> set[str]:
    client = connect_etcd(etcd_config)
    try:
        return {kv.key.decode().removeprefix(SPARES_PREFIX) for kv in await client.get_prefix(SPARES_PREFIX.encode())}
    finally:
        await client.close()


async def _marks_are(etcd_config: EtcdConfig, expected: set[str]) -> bool:
    return await _marks(etcd_config) == expected


async def _carried_out(stack: LocalConnector, decision_id: int) -> AckRecord:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ack = await stack.acknowledged()
        if ack is not None and ack.id == decision_id:
            return ack
        await asyncio.sleep(0.05)
    raise AssertionError(f"decision {decision_id} not carried out: {stack.state(1, 4)}")


async def _spares_ready(stack: LocalConnector, count: int) -> None:
    deadline = time.monotonic() + 20
    while len(stack.spares) < count or stack.spare_starts:
        assert time.monotonic() < deadline, f"{count} spares never ready: {stack.state(1, 4)}"
        await stack.acknowledged()
        await asyncio.sleep(0.05)


def _decision(decision_id: int, *, reason: str = "scale", replaces: list[str] | None = None, promote: str = "") -> DecisionRecord:
    return DecisionRecord(id=decision_id, workers=1, spares=1, reason=reason, issued_at=time.time(), deadline=time.time() + 60,
                          replaces=replaces or [], promote=promote, prefill_workers=1, prefill_spares=1)


def test_each_pool_keeps_its_own_hot_spare_and_a_dead_prefill_worker_is_restored_by_a_prefill_spare(etcd_config: EtcdConfig) -> None:
    starts = StandInWorkers()
    fleet = Fleet(workers=(WorkerGroup(WorkerRole.DECODE, 1), WorkerGroup(WorkerRole.PREFILL, 1)), planner=True, hot_spares=1)
    supervisor = Supervisor(fleet, LocalSettings(model="phalanx-tiny-moe", etcd_endpoint=etcd_config.endpoint), RecordedView())
    supervisor.fleet.start_worker = starts  # type: ignore[method-assign]

    async def scenario() -> None:
        client = connect_etcd(etcd_config)
        await client.delete_prefix(SPARES_PREFIX.encode())
        await client.close()
        for spec in fleet.worker_specs():
            assert spec.role is not None
            supervisor.fleet.workers[spec.name] = await starts(spec.name, spec.role.flags)
            supervisor.fleet.worker_roles[spec.name] = spec.role
        starts.flags.clear()
        stack = LocalConnector(supervisor, hot_spares=1, prefill_hot_spares=1, planner_id=PLANNER_ID, orchestrator="test")
        supervisor.owner = stack
        try:
            assert await stack.publish(_decision(1))
            ack = await _carried_out(stack, 1)  # the spares (ready or starting) match too
            assert (ack.workers, ack.prefill_workers) == (1, 1)
            await _spares_ready(stack, 2)
            # One spare per pool, each marked before it started: the decode pool's of the fleet's default role.
            assert sorted(starts.flags, key=str) == [PREFILL_FLAGS, None]
            spares = {name: supervisor.role_of(name) for name in stack.spares}
            prefill_spare = next(name for name, role in spares.items() if role == "prefill")
            assert len(spares) == 2 and await _marks(etcd_config) == set(spares)

            # The prefill worker dies: nothing starts for it, its capacity waits for the planner's promotion.
            prefill_worker = next(name for name in supervisor.workers if supervisor.role_of(name) == "prefill")
            assert stack.worker_exited(prefill_worker, None, -9)
            assert prefill_worker in stack.awaiting_promotion and prefill_worker not in supervisor.workers
            assert await stack.publish(_decision(2, reason="promote_spare", replaces=[prefill_worker], promote=prefill_spare))
            ack = await _carried_out(stack, 2)
            assert (ack.workers, ack.prefill_workers) == (1, 1)
            await _spares_ready(stack, 2)
            assert prefill_spare in supervisor.workers and supervisor.role_of(prefill_spare) == "prefill"
            # Its pool started a new prefill spare; the decode pool's spare was not touched.
            assert starts.flags[2:] == [PREFILL_FLAGS]
            new_spares = {name: supervisor.role_of(name) for name in stack.spares}
            assert sorted(new_spares.values()) == ["", "prefill"] and prefill_spare not in new_spares
            assert set(spares) - {prefill_spare} <= set(new_spares)
            # The promoted spare's unmark runs in the background.
            await assert_eventually(lambda: _marks_are(etcd_config, set(new_spares)), timeout=5)
        finally:
            await stack.cancel_starts()
            await stack.close()

    try:
        asyncio.run(scenario())
    finally:
        starts.close()
