"""The one fleet description: what a fleet expands to, in start order, for `phalanx up`, the test stack and the chaos runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.chaos.harness import Topology
from phalanx.cli.up import UpOptions
from phalanx.launch.fork_server import SIM_PRELOAD
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


def up(**options) -> UpOptions:
    return UpOptions(**{"workers": 2, "model": "phalanx-tiny-moe", "deterministic": True, "port": 0, "state_file": Path("/tmp/up.json"),
                        **options})


def test_the_default_phalanx_up_fleet_is_two_workers_behind_a_router_a_gateway_and_health() -> None:
    assert names(up().fleet()) == [
        ["nats", "etcd"], ["checkpoint-0", "migration-0"], ["worker-0", "worker-1"], ["router-0"], ["gateway-0"], ["health-0"],
    ]


def test_phalanx_up_options_shape_its_fleet() -> None:
    moe = up(expert_workers=3, shadow_experts=1, encoders=1, fork_workers=True).fleet()
    assert names(moe) == [
        ["nats", "etcd"], ["fork-server"], ["checkpoint-0", "migration-0"], ["ert-manager-0"], ["expert-0", "expert-1", "expert-2"],
        ["encoder-0"], ["worker-0", "worker-1"], ["router-0"], ["gateway-0"], ["health-0"],
    ]
    assert moe.expert_copies == 2 and {spec.role for spec in moe.worker_specs()} == {WorkerRole.ATTENTION}
    failover = up(failover=True).fleet()
    assert failover.worker_count == 0 and names(failover)[2] == ["slot-0", "slot-1"]
    planned = up(planner=True, hot_spares=1, etcd_endpoint="127.0.0.1:2379", nats_url="nats://127.0.0.1:4222").fleet()
    assert names(planned)[0] == ["checkpoint-0", "migration-0"] and names(planned)[-1] == ["planner-0"] and planned.hot_spares == 1
    # Spares are the planner's: without it the option is ignored, as `phalanx up` always did.
    assert up(hot_spares=1).fleet().hot_spares == 0


def test_phalanx_up_settings_carry_the_workers_flags_and_the_planners_bounds() -> None:
    settings = up(deterministic=False, engine="sim", profile="p.npz", planner=True, min_workers=1, max_workers=5).settings()
    assert settings.worker_flags == ("--fast", "--engine", "sim", "--profile", "p.npz")
    assert (settings.min_workers, settings.max_workers, settings.fork_preload) == (1, 5, SIM_PRELOAD)
