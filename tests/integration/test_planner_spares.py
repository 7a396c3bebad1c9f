"""`phalanx up --planner --hot-spares 1`: a spare is registered and warm but never routed to; when a worker is SIGKILLed, health
marks it DEAD, the planner promotes the spare (deletes its mark; the router routes to it at once) and the supervisor starts a
new spare in the background. Simulated workers (`--engine sim`): what is measured is the control path, not a model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.client import Client
from phalanx.testing.asserts import assert_eventually_sync

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "phalanx.cli"]
_FOREIGN_ENV = ("PHALANX_TARGET", "PHALANX_STATE_FILE", "PHALANX_NATS_URL", "PHALANX_ETCD_ENDPOINT", "PHALANX_API_KEY")
ENV = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV} | {"PHALANX_PLANNER_INTERVAL_S": "1", "PHALANX_PLANNER_POLL_S": "0.2"}


def phalanx(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False)


def read_state(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_killed_worker_is_replaced_by_promoting_a_hot_spare_within_a_second(tmp_path: Path) -> None:
    state_file = tmp_path / "up.json"
    result = phalanx(
        "up", "--detach", "--planner", "--hot-spares", "1", "--workers", "2", "--min-workers", "1", "--max-workers", "4", "--engine", "sim",
        "--model", "phalanx-tiny-moe", "--port", "0", "--gateway-port", "0", "--state-file", str(state_file), timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        state = read_state(state_file)
        spares = assert_eventually_sync(lambda: read_state(state_file)["planner"]["spares"] or None, timeout=60, interval=0.2,
                                        message="no hot spare started")
        spare = spares[0]["worker_id"]
        victim = state["workers"][0]
        elapsed, routed_before, routed_after = asyncio.run(_kill_and_watch(state["router_address"], spare, victim["pid"]))
        print(f"SIGKILL of {victim['worker_id']} -> hot spare {spare} routable after {elapsed * 1000:.0f} ms")
        assert spare not in routed_before, f"a request went to the unpromoted spare: {routed_before}"
        assert elapsed < 1.0, f"capacity came back after {elapsed:.2f} s"
        assert spare in routed_after, f"no request reached the promoted spare: {routed_after}"

        # The supervisor counts the spare as a worker, starts a new spare and acknowledges the promotion.
        def promoted() -> dict | None:
            s = read_state(state_file)
            planner = s["planner"]
            ids = [w["worker_id"] for w in s["workers"]]
            new_spares = [w["worker_id"] for w in planner["spares"]]
            done = (planner["reason"] == "promote_spare" and planner["acked_id"] == planner["decision_id"] and spare in ids
                    and len(ids) == 2 and len(new_spares) == 1 and new_spares[0] != spare)
            return s if done else None

        after = assert_eventually_sync(promoted, timeout=60, interval=0.2, message="the promotion was not carried out")
        assert victim["worker_id"] not in [w["worker_id"] for w in after["workers"]]
        time.sleep(2)  # a double-up (the dead worker restarted as well) would show by now
        assert len(read_state(state_file)["workers"]) == 2
    finally:
        down = phalanx("down", "--state-file", str(state_file), timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


async def _kill_and_watch(router: str, spare: str, pid: int) -> tuple[float, set[str], set[str]]:
    """Where requests go before the kill; the time from SIGKILL until the router lists the spare as routable; where they go after."""
    async with await Client.connect(router) as client:
        workers = {w.worker_id: w for w in await client.list_workers()}
        assert workers[spare].spare and not workers[spare].routable, workers[spare]
        before = {await _served_by(client, i) for i in range(6)}
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while True:
            workers = {w.worker_id: w for w in await client.list_workers()}
            if workers[spare].routable:
                elapsed = time.monotonic() - killed_at
                break
            assert time.monotonic() - killed_at < 10, f"the spare was not promoted: {workers[spare]}"
            await asyncio.sleep(0.005)
        after = {await _served_by(client, 100 + i) for i in range(6)}
    return elapsed, before, after


async def _served_by(client: Client, i: int) -> str:
    async for chunk in client.generate(f"request {i} to see where it goes", max_tokens=2, ignore_eos=True):
        return chunk.worker_id
    raise AssertionError("no token")
