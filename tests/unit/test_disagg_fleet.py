"""`phalanx up --prefill-workers N --decode-workers M` through the one fleet description (phalanx.launch.topology)."""

from __future__ import annotations

import pytest

from phalanx.cli.up import UpError, UpOptions, _preflight
from phalanx.common.roles import serves_requests
from phalanx.launch.topology import ProcessKind, WorkerRole

pytestmark = pytest.mark.unit


def options(tmp_path, **kwargs) -> UpOptions:
    return UpOptions(model="phalanx-tiny-moe", deterministic=True, port=0, gateway_port=0, state_file=tmp_path / "up.json", **kwargs)


def test_prefill_workers_run_beside_decode_workers_and_a_detached_supervisor_gets_them(tmp_path):
    up = options(tmp_path, workers=2, prefill_workers=1)
    specs = up.fleet().worker_specs()
    assert [(s.name, s.role) for s in specs] == [
        ("worker-0", WorkerRole.DECODE), ("worker-1", WorkerRole.DECODE), ("worker-2", WorkerRole.PREFILL),
    ]
    assert [s.role.flags for s in specs][-1] == ("--role", "prefill")
    command = up.command()
    assert command[command.index("--prefill-workers") + 1] == "1" and command[command.index("--workers") + 1] == "2"
    assert all(p.kind is not ProcessKind.WORKER or p.role is not None for p in up.fleet().processes())


def test_without_prefill_workers_the_fleet_is_aggregated_as_before(tmp_path):
    up = options(tmp_path, workers=2)
    assert {s.role for s in up.fleet().worker_specs()} == {WorkerRole.MONOLITHIC} and WorkerRole.MONOLITHIC.flags == ()
    assert "--prefill-workers" not in up.command()


def test_prefill_workers_refuse_what_they_do_not_support_yet(tmp_path):
    with pytest.raises(UpError, match="--prefill-workers"):
        _preflight(options(tmp_path, workers=1, prefill_workers=1, expert_workers=2))


def test_only_prefill_workers_take_no_requests():
    assert [serves_requests(role.value) for role in WorkerRole] == [True, True, False, True]
    assert serves_requests("")  # an older worker's registration


def test_the_planner_runs_with_prefill_workers_and_is_told_to_plan_two_pools(tmp_path):
    up = options(tmp_path, workers=2, prefill_workers=1, planner=True, hot_spares=1, max_workers=4)
    _preflight(up)  # no refusal: the planner scales each pool (docs/disagg.md, Planner)
    assert up.settings().prefill_workers == 1 and up.fleet().hot_spares == 1
    assert options(tmp_path, workers=2, planner=True).settings().prefill_workers == 0
