"""The one fleet description: what a fleet expands to, in start order, for `phalanx up`, the test stack and the chaos runs."""

from __future__ import annotations

import pytest

from phalanx.chaos.harness import Topology
from phalanx.launch.topology import Fleet, ProcessKind, ProcessSpec, WorkerGroup, WorkerRole

pytestmark = pytest.mark.unit


def names(fleet: Fleet) -> list[list[str]]:
    return [[spec.name for spec in phase] for phase in fleet.phases()]


def test_the_default_fleet_is_one_worker_behind_a_router_with_health_on_its_own_infra() -> None:
    assert names(Fleet()) == [
        ["nats", "etcd"], ["checkpoint-0", "migration-0"], ["worker-0"], ["router-0"], ["health-0"],
    ]


def test_workers_are_numbered_across_roles_and_keep_their_role() -> None:
    fleet = Fleet(workers=(WorkerGroup(WorkerRole.MONOLITHIC, 2), WorkerGroup(WorkerRole.ATTENTION, 1)))
    assert fleet.worker_specs() == (
        ProcessSpec(ProcessKind.WORKER, 0, WorkerRole.MONOLITHIC), ProcessSpec(ProcessKind.WORKER, 1, WorkerRole.MONOLITHIC),
        ProcessSpec(ProcessKind.WORKER, 2, WorkerRole.ATTENTION),
    )
    assert fleet.worker_count == 3
    assert [spec.role.flags for spec in fleet.worker_specs() if spec.role] == [(), (), ("--role", "attention")]


def test_experts_start_before_the_attention_workers_and_the_planner_last() -> None:
    fleet = Fleet(
        workers=(WorkerGroup(WorkerRole.ATTENTION, 2),), expert_workers=3, expert_copies=2, encoders=1, gateways=1, planner=True,
        hot_spares=1, nats=False, etcd=False, fork_server=True,
    )
    assert names(fleet) == [
        ["fork-server"], ["checkpoint-0", "migration-0"], ["ert-manager-0"], ["expert-0", "expert-1", "expert-2"], ["encoder-0"],
        ["worker-0", "worker-1"], ["router-0"], ["gateway-0"], ["health-0"], ["planner-0"],
    ]


def test_failover_slots_start_beside_the_workers() -> None:
    fleet = Fleet(workers=(), failover_slots=2)
    assert [spec.name for spec in fleet.processes() if spec.kind in (ProcessKind.WORKER, ProcessKind.FAILOVER_SLOT)] == ["slot-0", "slot-1"]


@pytest.mark.parametrize(
    ("fleet", "why"),
    [
        (lambda: Fleet(expert_workers=2, expert_copies=3), "copies"),
        (lambda: Fleet(hot_spares=1), "planner"),
        (lambda: Fleet(workers=(WorkerGroup(WorkerRole.MONOLITHIC, -1),)), "fewer than 0"),
    ],
)
def test_a_fleet_that_cannot_run_is_refused(fleet, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        fleet()


def test_the_chaos_default_topology_is_three_workers_a_router_a_gateway_and_health() -> None:
    assert names(Topology().fleet) == [
        ["nats", "etcd"], ["checkpoint-0", "migration-0"], ["worker-0", "worker-1", "worker-2"], ["router-0"], ["gateway-0"],
        ["health-0"],
    ]


def test_a_chaos_topology_with_expert_workers_runs_attention_workers_on_two_copies_of_each_expert() -> None:
    fleet = Topology(expert_workers=2).fleet
    assert fleet.expert_copies == 2
    assert {spec.role for spec in fleet.worker_specs()} == {WorkerRole.ATTENTION}
    assert names(fleet)[2:4] == [["ert-manager-0"], ["expert-0", "expert-1"]]


def test_chaos_topologies_expand_to_what_their_scenarios_act_on() -> None:
    kinds = lambda topology: [spec.kind for spec in topology.fleet.processes()]  # noqa: E731 - a one-line helper
    assert kinds(Topology(routers=2)).count(ProcessKind.ROUTER) == 2
    assert kinds(Topology(healths=2)).count(ProcessKind.HEALTH) == 2
    assert kinds(Topology(planner=True))[-1] is ProcessKind.PLANNER
    assert ProcessKind.ENCODER in kinds(Topology(encoders=1))
    assert kinds(Topology(workers=2, failover_slots=1)).count(ProcessKind.FAILOVER_SLOT) == 1
    assert ProcessKind.CHECKPOINT_STORE not in kinds(Topology(store=False))
