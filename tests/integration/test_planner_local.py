"""`phalanx up --planner`: the supervisor is the planner's orchestrator (the local connector). An operator's
target (`phalanx planner set-target`) becomes a decision; the supervisor really starts a worker process,
then under load drains the newest one (its streams move through migration), and acknowledges; every
stream gets every token index exactly once."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.client import Client
from phalanx.common.config import EtcdConfig
from phalanx.common.lease import connect_etcd
from phalanx.planner.connectors import write_target
from phalanx.testing.asserts import assert_eventually_sync

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "phalanx.cli"]
_FOREIGN_ENV = ("PHALANX_TARGET", "PHALANX_STATE_FILE", "PHALANX_NATS_URL", "PHALANX_ETCD_ENDPOINT", "PHALANX_API_KEY")
ENV = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV} | {
    "PHALANX_PLANNER_INTERVAL_S": "1",
    "PHALANX_PLANNER_POLL_S": "0.2",
    # A drained worker hands its requests back almost at once, so the scale-down moves live streams.
    "PHALANX_WORKER_DRAIN_GRACE_S": "0.2",
}
DRAIN_GRACE_S = 0.2
STREAMS = 8
MAX_TOKENS = 400


def phalanx(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False)


def read_state(path: Path) -> dict:
    return json.loads(path.read_text())


def settled(state_file: Path, workers: int) -> dict | None:
    """The state once the supervisor acknowledged a decision for `workers` workers and runs exactly that many."""
    state = read_state(state_file)
    planner = state["planner"]
    done = planner["target_workers"] == workers and planner["acked_id"] == planner["decision_id"] and len(state["workers"]) == workers
    return state if done and not planner["draining"] and not planner["starting"] else None


@pytest.mark.slow
def test_the_supervisor_scales_workers_to_the_planners_target_with_no_token_lost(tmp_path: Path) -> None:
    state_file = tmp_path / "up.json"
    result = phalanx(
        "up", "--detach", "--planner", "--workers", "1", "--min-workers", "1", "--max-workers", "3", "--model", "phalanx-tiny-moe",
        "--port", "0", "--gateway-port", "0", "--state-file", str(state_file), timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        state = read_state(state_file)
        etcd = state["etcd_endpoint"]
        assert state["planner"]["min_workers"] == 1 and state["planner"]["max_workers"] == 3
        assert any(s["name"] == "planner-0" for s in state["services"])

        # Up: a new worker process.
        assert phalanx("planner", "set-target", "2", "--etcd-endpoint", etcd).returncode == 0
        state = assert_eventually_sync(lambda: settled(state_file, 2), timeout=60, interval=0.2, message="no second worker")
        assert [w["worker_id"] for w in state["workers"]] == ["worker-0", "worker-1"]
        new_worker = state["workers"][1]
        status = json.loads(phalanx("status", "--json", "--state-file", str(state_file)).stdout)
        assert status["supervisor"]["planner"]["target_workers"] == 2
        assert {w["worker_id"] for w in status["workers"]} >= {"worker-0", "worker-1"}

        # Down under load: the newest worker drains mid-stream.
        results = asyncio.run(_streams_while_scaling_down(state["router_address"], etcd, state_file))
        for i, indices in results.items():
            assert indices == list(range(MAX_TOKENS)), f"stream {i}: {indices}"
        state = assert_eventually_sync(lambda: settled(state_file, 1), timeout=60, interval=0.2, message="the surplus worker still runs")
        assert [w["worker_id"] for w in state["workers"]] == ["worker-0"]
        assert_eventually_sync(lambda: _gone(new_worker["pid"]), timeout=10)
        events = [e["what"] for e in state["events"]]
        assert any("draining: planner target 1" in e for e in events) and any("stopped after draining" in e for e in events)

        # A crash: the supervisor restarts the worker at once, health marks the old one DEAD, the planner's restoration
        # decision keeps the target, so nothing starts twice.
        assert phalanx("chaos", "kill", "worker-0", "--wait", "--state-file", str(state_file), timeout=90).returncode == 0
        restored = assert_eventually_sync(lambda: _restoration_acked(state_file), timeout=60, interval=0.2, message="no acked restoration")
        assert [w["worker_id"] for w in restored["workers"]] == ["worker-2"]
        time.sleep(2)  # a double-up would start worker-3 by now
        assert [w["worker_id"] for w in read_state(state_file)["workers"]] == ["worker-2"]
    finally:
        down = phalanx("down", "--state-file", str(state_file), timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def _pools_settled(state_file: Path, decode: int, prefill: int) -> dict | None:
    """The state once the supervisor acknowledged a two-pool decision for `decode` + `prefill` workers and runs just those."""
    state = read_state(state_file)
    planner = state["planner"]
    done = (planner["target_workers"], planner["target_prefill_workers"], planner["prefill_workers"]) == (decode, prefill, prefill)
    done = done and planner["acked_id"] == planner["decision_id"] and len(state["workers"]) == decode + prefill
    return state if done and not planner["draining"] and not planner["starting"] else None


def _state_roles(state_file: Path) -> dict[str, str]:
    status = json.loads(phalanx("status", "--json", "--state-file", str(state_file)).stdout)
    return {w["worker_id"]: w.get("role", "") for w in status["workers"]}


@pytest.mark.slow
def test_with_prefill_workers_the_supervisor_scales_the_decode_pool_and_restores_the_prefill_pool(tmp_path: Path) -> None:
    """`phalanx up --planner --prefill-workers 1 --workers 1` (real workers): the planner's decisions carry both pools; an
    operator's target scales the decode pool (a new worker registers as decode; the scale-down drains it, not the newer
    prefill worker) and a killed prefill worker comes back as a prefill worker."""
    state_file = tmp_path / "up.json"
    result = phalanx(
        "up", "--detach", "--planner", "--workers", "1", "--prefill-workers", "1", "--min-workers", "1", "--max-workers", "3",
        "--model", "phalanx-tiny-moe", "--port", "0", "--gateway-port", "0", "--state-file", str(state_file), timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        etcd = read_state(state_file)["etcd_endpoint"]
        assert phalanx("planner", "set-target", "2", "--etcd-endpoint", etcd).returncode == 0
        assert_eventually_sync(lambda: _pools_settled(state_file, 2, 1), timeout=90, interval=0.2, message="no second decode worker")
        assert _state_roles(state_file) == {"worker-0": "decode", "worker-1": "prefill", "worker-2": "decode"}
        shown = json.loads(phalanx("planner", "show", "--etcd-endpoint", etcd).stdout)
        assert (shown["decision"]["workers"], shown["decision"]["prefill_workers"], shown["ack"]["prefill_workers"]) == (2, 1, 1)

        assert phalanx("chaos", "kill", "worker-1", "--wait", "--state-file", str(state_file), timeout=90).returncode == 0
        assert_eventually_sync(lambda: "worker-1" not in _state_roles(state_file) and _pools_settled(state_file, 2, 1), timeout=90,
                               interval=0.5, message="the prefill worker was not replaced")
        roles = _state_roles(state_file)
        assert sorted(roles.values()) == ["decode", "decode", "prefill"]
        prefill_worker = next(name for name, role in roles.items() if role == "prefill")

        assert phalanx("planner", "set-target", "1", "--etcd-endpoint", etcd).returncode == 0
        assert_eventually_sync(lambda: _pools_settled(state_file, 1, 1), timeout=90, interval=0.2, message="the decode worker still runs")
        assert _state_roles(state_file) == {"worker-0": "decode", prefill_worker: "prefill"}
    finally:
        down = phalanx("down", "--state-file", str(state_file), timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def _restoration_acked(state_file: Path) -> dict | None:
    state = settled(state_file, 1)
    return state if state is not None and state["planner"]["reason"] == "replace_dead" else None


def _event_time(state_file: Path, process: str, what: str) -> float:
    """When the supervisor recorded `process`'s event starting with `what` (wall clock)."""
    return next(e["at"] for e in read_state(state_file)["events"] if e["process"] == process and e["what"].startswith(what))


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by the supervisor counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def _streams_while_scaling_down(router: str, etcd: str, state_file: Path) -> dict[int, list[int]]:
    """STREAMS concurrent streams; once each has 10 tokens, the target drops to 1. Some of them must be on worker-1 (the router
    spreads load) and run on past its drain grace: they moved."""
    served_by: dict[int, str] = {}
    progress: collections.Counter[int] = collections.Counter()
    fired = asyncio.Event()
    ended_at: dict[int, float] = {}

    async with await Client.connect(router) as client:
        async def one(i: int) -> list[int]:
            indices = []
            async for chunk in client.generate(f"{i} {'abcdefgh'[i]} stream of the planner's test", max_tokens=MAX_TOKENS, ignore_eos=True):
                indices.append(chunk.index)
                served_by.setdefault(i, chunk.worker_id)
                progress[i] += 1
                if not fired.is_set() and len(served_by) == STREAMS and min(progress.values()) >= 10:
                    fired.set()
                    # Straight to etcd: the CLI's start-up (a second) would let short streams finish first.
                    etcd_client = connect_etcd(EtcdConfig(endpoint=etcd))
                    try:
                        await write_target(etcd_client, 1)
                    finally:
                        await etcd_client.close()
            ended_at[i] = time.time()
            return indices

        results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    assert fired.is_set()
    moved = [i for i, worker in served_by.items() if worker == "worker-1"]
    assert moved, f"no stream on the worker to remove: {served_by}"
    # A stream still running DRAIN_GRACE_S after worker-1 was SIGTERMed was handed back and went on elsewhere: the
    # drained worker stops generating then (chunks keep naming the worker a stream started on, so they cannot show it).
    drained_at = _event_time(state_file, "worker-1", "draining:")
    late = [i for i in moved if ended_at[i] > drained_at + DRAIN_GRACE_S + 1.0]
    print(f"streams {moved} were on worker-1 when it was SIGTERMed; {late} ran on past its drain grace")
    assert late, f"every stream on worker-1 ended within its drain grace: {ended_at}, drained at {drained_at}"
    return dict(enumerate(results))
