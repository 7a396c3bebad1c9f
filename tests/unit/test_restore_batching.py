"""Restores for one target that come together share a call; each caller gets its own result or the call's error."""

import asyncio

import pytest

from phalanx.migration.batching import Reservations, RestoreBatcher, SharedCalls

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


async def test_items_arriving_while_a_call_runs_go_in_their_own_call_without_waiting_for_it():
    target = Target()
    target.gate.clear()
    batcher = RestoreBatcher(target.send, window_s=0.005)
    first = asyncio.create_task(batcher.submit("a", "r0"))
    while not target.calls:
        await asyncio.sleep(0)
    later = [asyncio.create_task(batcher.submit("a", f"r{i}")) for i in (1, 2, 3)]
    await asyncio.sleep(0.05)
    # The first call is still in flight (a target waiting for its step boundary); the later ones went all the same.
    assert target.calls == [("a", ["r0"]), ("a", ["r1", "r2", "r3"])]
    assert not first.done()
    target.gate.set()
    assert await asyncio.gather(first, *later) == ["a:r0", "a:r1", "a:r2", "a:r3"]
    assert batcher.calls == 2


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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_callers_of_one_key_share_the_call_in_flight_and_its_result_for_reuse_s():
    clock, started = Clock(), []
    gate = asyncio.Event()

    async def read(name: str) -> str:
        started.append(name)
        await gate.wait()
        return f"{name}#{len(started)}"

    shared = SharedCalls(reuse_s=0.1, clock=clock)
    waiting = [asyncio.ensure_future(shared.get("k", lambda: read("k"))) for _ in range(5)]
    other = asyncio.ensure_future(shared.get("j", lambda: read("j")))
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiting) == ["k#1"] * 5 and await other == "j#2"
    assert started == ["k", "j"]
    clock.now = 0.09  # within reuse_s of the answer
    assert await shared.get("k", lambda: read("k")) == "k#1"
    clock.now = 0.2
    assert await shared.get("k", lambda: read("k")) == "k#3"
    assert shared.calls == 3


async def test_a_failed_shared_call_serves_only_its_waiters_and_a_waiter_leaving_does_not_cancel_it():
    gate, calls = asyncio.Event(), []

    async def read() -> int:
        calls.append(1)
        await gate.wait()
        if len(calls) == 1:
            raise RuntimeError("etcd went away")
        return len(calls)

    shared = SharedCalls(reuse_s=10.0)
    leaver = asyncio.ensure_future(shared.get("k", read))
    stayer = asyncio.ensure_future(shared.get("k", read))
    await asyncio.sleep(0)
    leaver.cancel()
    gate.set()
    with pytest.raises(RuntimeError, match="etcd went away"):
        await stayer
    assert await shared.get("k", read) == 2  # the failure is not reused


def test_reservations_count_requests_and_blocks_per_target_until_released():
    reserved = Reservations()
    with reserved.hold("w1", 5), reserved.hold("w1", 3), reserved.hold("w2", 1):
        assert reserved.of("w1") == (2, 8) and reserved.of("w2") == (1, 1)
    with pytest.raises(RuntimeError), reserved.hold("w1", 4):
        raise RuntimeError("the restore failed")
    assert reserved.of("w1") == (0, 0) and reserved.of("w3") == (0, 0)
