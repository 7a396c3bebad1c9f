"""A fleet description (phalanx.launch.topology) started by the test stack: every process it names, serving together."""

from __future__ import annotations

import pytest

from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.launch.stack import Stack
from phalanx.launch.topology import Fleet, WorkerGroup, WorkerRole

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"


async def test_a_stack_started_from_a_fleet_runs_every_process_it_names_and_serves(nats_server, etcd_server) -> None:
    fleet = Fleet(workers=(WorkerGroup(WorkerRole.MONOLITHIC, 2),), gateways=1, nats=False, etcd=False)
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    try:
        await stack.start(fleet, "--engine", "sim")
        assert [len(stack.workers), len(stack.routers), len(stack.healths), len(stack.gateways)] == [2, 1, 1, 1]
        assert [len(stack.stores), len(stack.migrations), len(stack.planners)] == [1, 1, 0]
        async with await Client.connect(stack.routers[0].address, timeout=30) as client:
            completion = await client.complete("hello, fleet", max_tokens=6, ignore_eos=True)
            listed = await client.list_workers()
        assert len(completion.token_ids) == 6
        assert {w.worker_id for w in listed} == {w.worker_id for w in stack.workers}
        assert stack.gateways[0].healthy()
    finally:
        stack.stop()
