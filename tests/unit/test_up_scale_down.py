"""`phalanx up --planner`'s scale-down: starts still in flight are cancelled before any serving worker drains."""

from __future__ import annotations

import asyncio
import io
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from phalanx.cli.up import UpOptions, _Board, _Stack
from phalanx.launch.services import WorkerHandle

pytestmark = pytest.mark.unit


@pytest.fixture
def serving() -> Iterator[subprocess.Popen]:
    """A serving worker's stand-in: a process that runs until signalled."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


async def test_a_scale_down_cancels_the_newest_starts_first_and_drains_only_what_is_left(tmp_path: Path, serving: subprocess.Popen) -> None:
    console = Console(file=io.StringIO())
    stack = _Stack(UpOptions(workers=1, model="phalanx-tiny-moe", deterministic=False, port=0, state_file=tmp_path / "up.json",
                             planner=True), _Board(console), console)
    stack.workers["worker-0"] = WorkerHandle("worker-0", serving, "127.0.0.1:1", "127.0.0.1:2")
    cancelled: list[int] = []
    starts = 0

    async def slow_start() -> tuple[str, int | None]:
        nonlocal starts
        starts += 1
        mine = starts
        try:
            await asyncio.sleep(60)  # a worker process still importing and registering
        except asyncio.CancelledError:
            cancelled.append(mine)
            raise
        return f"worker-{mine}", None

    stack._replace_worker = slow_start  # type: ignore[method-assign]
    stack._scale_up(3)
    stack._scale_up(3)
    await asyncio.sleep(0)
    assert len(stack.scaling) == 2
    # Target 2 from 1 serving + 2 starting: the newest start goes, worker-0 serves on.
    stack._scale_down(1, 2)
    assert len(stack.scaling) == 1 and not stack.retiring
    # A start after the cancellation gets a key of its own: the cancelled start's clean-up leaves it counted.
    stack._scale_up(3)
    await asyncio.sleep(0.05)
    assert cancelled == [2] and len(stack.scaling) == 2
    # Target 0 from 1 serving + 2 starting: both starts go, then worker-0 drains (SIGTERM).
    stack._scale_down(3, 0)
    await asyncio.sleep(0.05)
    assert sorted(cancelled) == [1, 2, 3] and not stack.scaling
    assert list(stack.retiring) == ["worker-0"] and not stack.workers
    assert await asyncio.to_thread(serving.wait, 10) == -signal.SIGTERM
    events = [event.what for event in stack.events]
    assert events.count("1 worker start(s) cancelled: planner target 2 workers") == 1
    assert "2 worker start(s) cancelled: planner target 0 workers" in events
    assert "draining: planner target 0 workers" in events
