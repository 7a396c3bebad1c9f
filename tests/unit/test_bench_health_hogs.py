"""`phalanx bench health --hogs N`: the CPU hogs the bench starts are gone when it ends, however it ends."""

import os

import pytest

from phalanx.bench.health import CpuHogs

pytestmark = pytest.mark.unit


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cpu_hogs_spin_while_the_bench_runs_and_are_killed_by_pid_even_when_it_fails():
    with pytest.raises(RuntimeError, match="bench failed"), CpuHogs(2) as hogs:
        pids = hogs.pids
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert all(p.poll() is None for p in hogs.processes)
        raise RuntimeError("bench failed")
    # Reaped (wait()ed) by the context: the PIDs no longer exist, not even as zombies.
    assert not any(_alive(pid) for pid in pids)
    assert hogs.processes == []


def test_no_hogs_start_nothing():
    with CpuHogs(0) as hogs:
        assert hogs.pids == []
