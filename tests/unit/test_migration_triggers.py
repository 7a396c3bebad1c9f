"""A DEAD worker's requests move once per incarnation, and the memory of it stays bounded."""

import pytest

from phalanx.migration.triggers import DeadWorker, TriggerMemory

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_incarnation_triggers_once_and_a_restarted_worker_again():
    memory = TriggerMemory(clock=Clock())
    assert memory.claim(DeadWorker("w1", 1.0))
    assert not memory.claim(DeadWorker("w1", 1.0))
    assert memory.claim(DeadWorker("w1", 2.0))  # the same id restarted: another incarnation


def test_a_running_migration_is_remembered_however_long_it_takes():
    clock = Clock()
    memory = TriggerMemory(forget_after_s=10.0, clock=clock)
    memory.claim(DeadWorker("w1", 1.0))
    clock.now += 10_000.0
    assert not memory.claim(DeadWorker("w1", 1.0))


def test_a_finished_migration_is_forgotten_after_forget_after_s():
    clock = Clock()
    memory = TriggerMemory(forget_after_s=10.0, clock=clock)
    dead = DeadWorker("w1", 1.0)
    memory.claim(dead)
    memory.finished(dead)
    clock.now += 9.0
    assert not memory.claim(dead)  # a late repeat of the DEAD record
    clock.now += 1.0
    assert dead not in memory and len(memory) == 0
    assert memory.claim(dead)


def test_memory_holds_at_most_max_entries_dropping_the_oldest():
    memory = TriggerMemory(max_entries=3, clock=Clock())
    for i in range(10):
        assert memory.claim(DeadWorker(f"w{i}", 1.0))
    assert len(memory) == 3
    assert [DeadWorker(f"w{i}", 1.0) in memory for i in (6, 7, 8, 9)] == [False, True, True, True]


def test_finishing_an_unknown_incarnation_is_a_no_op():
    memory = TriggerMemory(clock=Clock())
    memory.finished(DeadWorker("never-claimed", 1.0))
    assert len(memory) == 0


def test_rejects_nonsense_bounds():
    with pytest.raises(ValueError):
        TriggerMemory(max_entries=0)
    with pytest.raises(ValueError):
        TriggerMemory(forget_after_s=-1.0)
