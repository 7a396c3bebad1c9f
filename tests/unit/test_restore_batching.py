"""Restores for one target that come together share a call; each caller gets its own result or the call's error."""

import asyncio

import pytest

from phalanx.migration.batching import RestoreBatcher

pytestmark = pytest.mark.unit


class Target:
    """Records each call; `gate` holds a call open until set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with: Exception | None = None

    async def send(self, key, items: list[str]) -> list[str]:
        self.calls.append((key, list(items)))
        await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [f"{key}:{item}" for item in items]


async def test_items_within_the_window_go_in_one_call_per_target_and_results_come_back_in_order():
    target = Target()
    batcher = RestoreBatcher(target.send, window_s=0.01)
    results = await asyncio.gather(*(batcher.submit("a" if i % 2 else "b", f"r{i}") for i in range(6)))
    assert results == [f"{'a' if i % 2 else 'b'}:r{i}" for i in range(6)]
    assert sorted(target.calls) == [("a", ["r1", "r3", "r5"]), ("b", ["r0", "r2", "r4"])]
    assert batcher.calls == 2


async def test_items_arriving_while_a_call_runs_go_in_the_next_one():
    target = Target()
    target.gate.clear()
    batcher = RestoreBatcher(target.send, window_s=0)
    first = asyncio.create_task(batcher.submit("a", "r0"))
    while not target.calls:
        await asyncio.sleep(0)
    later = [asyncio.create_task(batcher.submit("a", f"r{i}")) for i in (1, 2, 3)]
    await asyncio.sleep(0.01)
    assert target.calls == [("a", ["r0"])]  # still in flight
    target.gate.set()
    assert await asyncio.gather(first, *later) == ["a:r0", "a:r1", "a:r2", "a:r3"]
    assert target.calls == [("a", ["r0"]), ("a", ["r1", "r2", "r3"])]


async def test_a_failed_call_fails_each_of_its_items_and_the_next_call_is_independent():
    target = Target()
    target.fail_with = ConnectionError("target gone")
    batcher = RestoreBatcher(target.send, window_s=0.005)
    outcomes = await asyncio.gather(batcher.submit("a", "r0"), batcher.submit("a", "r1"), return_exceptions=True)
    assert all(isinstance(o, ConnectionError) for o in outcomes)
    target.fail_with = None
    assert await batcher.submit("a", "r2") == "a:r2"


async def test_max_items_splits_a_burst_and_a_cancelled_caller_is_left_out():
    target = Target()
    batcher = RestoreBatcher(target.send, window_s=0.005, max_items=2)
    tasks = [asyncio.create_task(batcher.submit("a", f"r{i}")) for i in range(5)]
    await asyncio.sleep(0)
    tasks[4].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert done[:4] == ["a:r0", "a:r1", "a:r2", "a:r3"] and isinstance(done[4], asyncio.CancelledError)
    assert target.calls == [("a", ["r0", "r1"]), ("a", ["r2", "r3"])]


def test_settings_are_checked():
    with pytest.raises(ValueError):
        RestoreBatcher(Target().send, window_s=-1)
    with pytest.raises(ValueError):
        RestoreBatcher(Target().send, max_items=0)
