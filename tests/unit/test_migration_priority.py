"""Queued migrations go premium first, then in arrival order; cancelled waiters never hold a slot."""

import asyncio

import pytest

from phalanx.migration.priority import STANDARD, PriorityGate, effective_priority

pytestmark = pytest.mark.unit


def test_effective_priority_is_the_first_set_value_else_standard():
    assert effective_priority(0, 3, 1) == 3
    assert effective_priority(1) == 1
    assert effective_priority(0, 0) == STANDARD
    assert effective_priority() == STANDARD


async def hold(gate: PriorityGate, priority: int, until: asyncio.Event, order: list[str]) -> None:
    """Takes a slot, notes "first" in `order`, and keeps the slot until `until` is set."""
    async with gate.slot(priority):
        order.append("first")
        await until.wait()


async def wait_turn(gate: PriorityGate, name: str, priority: int, order: list[str]) -> None:
    """Notes `name` in `order` once it gets a slot."""
    async with gate.slot(priority):
        order.append(name)


async def test_waiters_get_the_slot_by_priority_then_arrival():
    gate = PriorityGate(1)
    order: list[str] = []
    release_first = asyncio.Event()

    first = asyncio.create_task(hold(gate, 3, release_first, order))
    await asyncio.sleep(0)
    arrivals = [("best-a", 3), ("standard", 2), ("premium-a", 1), ("best-b", 3), ("premium-b", 1)]
    waiters = [asyncio.create_task(wait_turn(gate, n, p, order)) for n, p in arrivals]
    for _ in range(3):
        await asyncio.sleep(0)
    assert gate.waiting == 5 and order == ["first"]
    release_first.set()
    await asyncio.gather(first, *waiters)
    assert order == ["first", "premium-a", "premium-b", "standard", "best-a", "best-b"]
    assert gate.waiting == 0


async def test_up_to_slots_run_at_once_and_a_new_arrival_waits_behind_queued_ones():
    gate = PriorityGate(2)
    running = 0
    most = 0
    proceed = asyncio.Event()

    async def work(priority: int):
        nonlocal running, most
        async with gate.slot(priority):
            running += 1
            most = max(most, running)
            await proceed.wait()
            running -= 1

    tasks = [asyncio.create_task(work(2)) for _ in range(5)]
    for _ in range(3):
        await asyncio.sleep(0)
    assert running == 2 and gate.waiting == 3
    proceed.set()
    await asyncio.gather(*tasks)
    assert most == 2 and running == 0


async def test_a_cancelled_waiter_passes_its_turn_on():
    gate = PriorityGate(1)
    release = asyncio.Event()
    got: list[str] = []

    first = asyncio.create_task(hold(gate, 2, release, []))  # the holder's turn is not under test here
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(wait_turn(gate, "cancelled", 1, got))
    later = asyncio.create_task(wait_turn(gate, "later", 3, got))
    await asyncio.sleep(0)
    cancelled.cancel()
    release.set()
    await asyncio.gather(first, later)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert got == ["later"]
    # The slot came back: a new caller gets it at once.
    async with asyncio.timeout(1):
        async with gate.slot(2):
            pass


def test_slots_must_be_positive():
    with pytest.raises(ValueError):
        PriorityGate(0)
