"""The router's fencing decisions: requests moved under their relay, workers declared dead while relayed."""

import pytest

from phalanx.router.fencing import Fence, FencingPolicy, Migrated, ReadStarted, ReadStopped, StopReading, StreamOver, WorkerDead

pytestmark = pytest.mark.unit


def relaying(**reading: str) -> FencingPolicy:
    """A router whose relays read each request (keyword) from its worker (value)."""
    fencing = FencingPolicy()
    for request_id, worker_id in reading.items():
        assert fencing.on(ReadStarted(request_id, worker_id)) == ()
    return fencing


def test_a_request_moved_off_the_worker_its_relay_reads_stops_that_read_and_is_fenced_once_over():
    fencing = relaying(r1="w1")
    assert fencing.on(Migrated("r1", "w1", "w2", "addr2")) == (StopReading("r1"),)
    fencing.on(ReadStopped("r1"))
    assert fencing.on(StreamOver("r1", handed_back=False)) == (Fence("r1", "w1", "w2", "addr2"),)
    # Followed: the next stream of the request is a plain one.
    fencing.on(ReadStarted("r1", "w2"))
    fencing.on(ReadStopped("r1"))
    assert fencing.on(StreamOver("r1", handed_back=False)) == ()


@pytest.mark.parametrize("event", [
    Migrated("r2", "w1", "w2", "addr2"),  # not relayed here
    Migrated("r1", "w3", "w2", "addr2"),  # moved off another worker than the relay reads (it follows already)
    Migrated("r1", "w1", "w1", "addr1"),  # not moved
    Migrated("r1", "w1", "", ""),  # no new owner
])
def test_migrations_the_relay_already_follows_or_that_moved_nothing_change_nothing(event):
    fencing = relaying(r1="w1")
    assert fencing.on(event) == ()
    assert fencing.on(StreamOver("r1", handed_back=False)) == ()


def test_a_migration_after_the_read_stopped_is_the_relays_own():
    fencing = relaying(r1="w1")
    fencing.on(ReadStopped("r1"))
    assert fencing.on(Migrated("r1", "w1", "w2", "addr2")) == ()


def test_a_handed_back_request_is_not_fenced_its_handoff_carries_the_state():
    fencing = relaying(r1="w1")
    fencing.on(Migrated("r1", "w1", "w2", "addr2"))
    assert fencing.on(StreamOver("r1", handed_back=True)) == ()
    assert fencing.on(StreamOver("r1", handed_back=False)) == ()  # the move was dropped, not kept for later


def test_a_dead_worker_s_relays_stop_unless_a_migration_moved_them_already():
    fencing = relaying(r1="w1", r2="w1", r3="w2")
    fencing.on(Migrated("r2", "w1", "w3", "addr3"))
    assert fencing.on(WorkerDead("w1", started_at=5.0, registered_started_at=5.0)) == (StopReading("r1"),)


@pytest.mark.parametrize("registered", [None, 5.0])
def test_a_dead_record_without_an_incarnation_or_of_the_registered_one_stops_its_relays(registered):
    fencing = relaying(r1="w1")
    assert fencing.on(WorkerDead("w1", started_at=0.0, registered_started_at=registered)) == (StopReading("r1"),)
    assert relaying(r1="w1").on(WorkerDead("w1", started_at=5.0, registered_started_at=None)) == (StopReading("r1"),)


def test_a_dead_record_of_another_incarnation_leaves_the_registered_one_alone():
    fencing = relaying(r1="w1")
    assert fencing.on(WorkerDead("w1", started_at=4.0, registered_started_at=5.0)) == ()


def test_a_non_event_is_a_bug():
    with pytest.raises(TypeError, match="not a fencing event"):
        FencingPolicy().on(StopReading("r1"))
