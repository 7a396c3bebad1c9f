"""KvIndex: per-worker KV residency from event streams and snapshots, and prefix overlap queries."""

import heapq
import random

import pytest

from phalanx._proto import common_pb2
from phalanx.common.block_hash import prefix_block_hashes
from phalanx.router.index import KvIndex

pytestmark = pytest.mark.unit


def event(worker_id: str, sequence: int, stored=(), removed=(), cleared: bool = False) -> common_pb2.KvEvent:
    return common_pb2.KvEvent(
        worker_id=worker_id, sequence=sequence, removed=list(removed), cleared=cleared,
        stored=[common_pb2.KvBlockStored(block_hash=h, parent_hash=0, num_tokens=16) for h in stored],
    )


def synced_index(*worker_ids: str, **kwargs) -> KvIndex:
    index = KvIndex(**kwargs)
    for worker_id in worker_ids:
        index.add_worker(worker_id)
        index.load_snapshot(worker_id, 0, [])
    return index


PROMPT = list(range(160))
HASHES = prefix_block_hashes(PROMPT, 16)  # 10 blocks


# -- prefix overlap --------------------------------------------------------------
def test_matched_blocks_counts_leading_blocks_each_worker_holds():
    index = synced_index("full", "partial", "divergent", "none")
    index.apply_event(event("full", 1, HASHES))
    index.apply_event(event("partial", 1, HASHES[:4]))
    divergent = prefix_block_hashes(PROMPT[:96] + [999] * 64, 16)  # shares 6 blocks, then differs
    index.apply_event(event("divergent", 1, divergent))
    index.apply_event(event("none", 1, prefix_block_hashes([5] * 160, 16)))
    assert index.matched_blocks(HASHES) == {"full": 10, "partial": 4, "divergent": 6}
    assert index.matched_blocks(HASHES[:3]) == {"full": 3, "partial": 3, "divergent": 3}


def test_matched_blocks_stop_at_the_first_block_a_worker_lacks():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:3] + HASHES[4:]))
    assert index.matched_blocks(HASHES) == {"w": 3}


def test_matched_blocks_is_empty_without_a_first_block_match():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[1:]))
    assert index.matched_blocks(HASHES) == {}
    assert index.matched_blocks([]) == {}


def test_match_slots_reports_by_slot():
    index = synced_index("a", "b")
    index.apply_event(event("b", 1, HASHES[:2]))
    assert index.match_slots(HASHES) == {index.slot("b"): 2}
    assert index.slot_owner(index.slot("b")) == "b"


# -- events ------------------------------------------------------------------------
def test_removed_event_drops_only_those_blocks():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES))
    index.apply_event(event("w", 2, removed=HASHES[5:]))
    assert index.matched_blocks(HASHES) == {"w": 5}
    assert index.indexed_blocks("w") == 5


def test_removing_an_unheld_block_changes_nothing():
    index = synced_index("a", "b")
    index.apply_event(event("a", 1, HASHES[:2]))
    index.apply_event(event("b", 1, removed=HASHES[:2]))
    assert index.matched_blocks(HASHES) == {"a": 2}


def test_cleared_applies_before_removed_and_stored_in_one_event():
    index = synced_index("w", "other")
    index.apply_event(event("w", 1, HASHES))
    index.apply_event(event("other", 1, HASHES[:2]))
    index.apply_event(event("w", 2, stored=HASHES[:2], removed=HASHES[:1], cleared=True))
    assert index.block_hashes("w") == frozenset(HASHES[:2])
    assert index.matched_blocks(HASHES) == {"w": 2, "other": 2}


def test_events_of_unknown_workers_are_ignored():
    index = synced_index("w")
    assert index.apply_event(event("stranger", 7, HASHES)) is False
    assert index.matched_blocks(HASHES) == {}
    assert "stranger" not in index


def test_a_never_synced_worker_takes_its_first_event_directly():
    # Sequence 1 is a fresh process's first event: an empty index plus it is exact.
    index = KvIndex()
    index.add_worker("w")
    assert index.apply_event(event("w", 1, HASHES[:2])) is False
    assert index.block_hashes("w") == frozenset(HASHES[:2])
    assert index.last_sequence("w") == 1


def test_a_never_synced_worker_joining_mid_stream_requests_a_snapshot():
    index = KvIndex()
    index.add_worker("w")
    assert index.apply_event(event("w", 40, HASHES[:2])) is True
    assert index.resync_pending("w")


# -- gaps, snapshots, restarts -------------------------------------------------------
def test_a_gap_requests_one_resync_and_buffers_events_until_the_snapshot():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:2]))
    assert index.apply_event(event("w", 3, HASHES[2:3])) is True
    assert index.apply_event(event("w", 4, HASHES[3:4])) is False
    assert index.apply_event(event("w", 5, HASHES[4:5])) is False
    assert index.block_hashes("w") == frozenset(HASHES[:2])  # buffered, not applied
    assert index.load_snapshot("w", 3, HASHES[:3]) is False
    assert index.block_hashes("w") == frozenset(HASHES[:5])
    assert index.last_sequence("w") == 5
    assert not index.resync_pending("w")
    index.apply_event(event("w", 6, HASHES[5:6]))
    assert index.matched_blocks(HASHES) == {"w": 6}


def test_snapshot_ahead_of_the_stream_skips_events_it_already_reflects():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:1]))
    assert index.apply_event(event("w", 3, HASHES[2:3])) is True
    # The snapshot reflects events up to 6; 4..6 still arrive afterwards.
    assert index.load_snapshot("w", 6, HASHES[:6]) is False
    for seq in (4, 5, 6):
        assert index.apply_event(event("w", seq, HASHES[seq - 1 : seq])) is False
    assert index.apply_event(event("w", 7, HASHES[6:7])) is False
    assert index.block_hashes("w") == frozenset(HASHES[:7])
    assert not index.resync_pending("w")


def test_snapshot_may_reflect_events_past_its_sequence_and_replay_converges():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:3]))
    assert index.apply_event(event("w", 3, removed=HASHES[2:3])) is True
    index.apply_event(event("w", 4, stored=HASHES[2:3]))
    # Sequence 2, but the blocks already reflect event 3 (HASHES[2] gone) and not yet 4.
    assert index.load_snapshot("w", 2, HASHES[:2]) is False
    assert index.block_hashes("w") == frozenset(HASHES[:3])


def test_a_gap_inside_the_replay_asks_for_another_snapshot():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:1]))
    assert index.apply_event(event("w", 5, HASHES[4:5])) is True
    assert index.load_snapshot("w", 2, HASHES[:2]) is True  # 3 and 4 are nowhere
    assert index.resync_pending("w")
    assert index.load_snapshot("w", 5, HASHES[:5]) is False
    assert index.block_hashes("w") == frozenset(HASHES[:5])


def test_a_sequence_regression_means_a_restart_and_requests_a_resync():
    index = synced_index("w")
    for seq in (1, 2, 3):
        index.apply_event(event("w", seq, HASHES[seq - 1 : seq]))
    assert index.apply_event(event("w", 1, HASHES[7:8])) is True
    assert index.apply_event(event("w", 2, HASHES[8:9])) is False
    assert index.load_snapshot("w", 1, HASHES[7:8]) is False
    assert index.block_hashes("w") == frozenset(HASHES[7:9])


def test_a_restart_during_a_pending_resync_asks_for_one_more_snapshot():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:1]))
    assert index.apply_event(event("w", 5, HASHES[:5])) is True  # gap; a snapshot is fetched
    assert index.apply_event(event("w", 1, HASHES[9:10])) is True  # the worker restarted meanwhile
    # The reply may come from the old process: load it, but fetch again.
    assert index.load_snapshot("w", 5, HASHES[:5]) is True
    assert index.load_snapshot("w", 1, HASHES[9:10]) is False
    assert index.block_hashes("w") == frozenset(HASHES[9:10])


def test_buffer_overflow_keeps_waiting_and_a_later_snapshot_converges():
    index = synced_index("w", max_buffered_events=3)
    index.apply_event(event("w", 1))
    assert index.apply_event(event("w", 3)) is True
    for seq in range(4, 10):
        assert index.apply_event(event("w", seq, [seq])) is False
    # The buffer kept only 9; a snapshot at 3 cannot bridge to it: ask again.
    assert index.load_snapshot("w", 3, []) is True
    assert index.load_snapshot("w", 9, range(4, 10)) is False
    assert index.block_hashes("w") == frozenset(range(4, 10))
    assert index.apply_event(event("w", 10, [10])) is False
    assert index.last_sequence("w") == 10


def test_a_snapshot_taken_after_an_overflow_replays_what_the_buffer_kept():
    index = synced_index("w", max_buffered_events=3)
    index.apply_event(event("w", 1))
    assert index.apply_event(event("w", 3)) is True
    for seq in range(4, 10):
        index.apply_event(event("w", seq, [seq]))
    assert index.load_snapshot("w", 8, range(4, 9)) is False  # the buffer kept only 9
    assert index.block_hashes("w") == frozenset(range(4, 10))
    assert index.last_sequence("w") == 9


def test_mark_resync_buffers_events_and_clear_drops_blocks_now():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:3]))
    index.mark_resync("w", clear=True)
    assert index.matched_blocks(HASHES) == {}
    assert index.apply_event(event("w", 1, HASHES[:1])) is False  # already asked for
    assert index.load_snapshot("w", 0, []) is False
    assert index.block_hashes("w") == frozenset(HASHES[:1])


def test_mark_resync_during_a_pending_resync_loads_one_more_snapshot():
    index = synced_index("w")
    index.apply_event(event("w", 1))
    assert index.apply_event(event("w", 3)) is True
    index.mark_resync("w", clear=True)  # e.g. a new pid: a snapshot in flight may predate it
    assert index.load_snapshot("w", 3, HASHES[:1]) is True
    assert index.load_snapshot("w", 0, []) is False
    assert index.block_hashes("w") == frozenset()


def test_a_snapshot_older_than_the_stream_exposes_the_gap_on_the_next_event():
    index = synced_index("w")
    for seq in (1, 2, 3):
        index.apply_event(event("w", seq, [seq]))
    assert index.load_snapshot("w", 1, [1]) is False
    assert index.apply_event(event("w", 4, [4])) is True


# -- workers and slots -----------------------------------------------------------------
def test_remove_worker_drops_its_bits_and_its_slot_is_reused_clean():
    index = synced_index("a", "b", "c")
    for w in ("a", "b", "c"):
        index.apply_event(event(w, 1, HASHES))
    slot_b = index.slot("b")
    index.remove_worker("b")
    assert index.matched_blocks(HASHES) == {"a": 10, "c": 10}
    assert index.indexed_blocks("b") == 0
    assert index.add_worker("d") == slot_b
    index.load_snapshot("d", 0, [])
    assert index.matched_blocks(HASHES) == {"a": 10, "c": 10}
    index.apply_event(event("d", 1, HASHES[:2]))
    assert index.matched_blocks(HASHES) == {"a": 10, "c": 10, "d": 2}
    index.remove_worker("a")
    index.remove_worker("c")
    index.remove_worker("d")
    assert index.distinct_blocks() == 0
    assert index.total_indexed_blocks() == 0


def test_add_worker_twice_keeps_its_slot_and_blocks():
    index = synced_index("w")
    index.apply_event(event("w", 1, HASHES[:2]))
    slot = index.slot("w")
    assert index.add_worker("w") == slot
    assert index.indexed_blocks("w") == 2


def test_indexed_block_counts_count_shared_blocks_per_worker():
    index = synced_index("a", "b")
    index.apply_event(event("a", 1, HASHES[:4]))
    index.apply_event(event("b", 1, HASHES[:2]))
    assert (index.indexed_blocks("a"), index.indexed_blocks("b")) == (4, 2)
    assert index.total_indexed_blocks() == 6
    assert index.distinct_blocks() == 4


# -- property: lossy, delayed streams with snapshots converge to the truth ---------------------
class _Worker:
    """A worker process as the index sees it: a block set and numbered events."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.sequence = 0

    def next_event(self, worker_id: str, rng: random.Random, universe: int) -> common_pb2.KvEvent:
        cleared = rng.random() < 0.03
        if cleared:
            self.blocks.clear()
        removed = rng.sample(sorted(self.blocks), rng.randint(0, min(3, len(self.blocks))))
        self.blocks.difference_update(removed)
        free = sorted(set(range(1, universe)) - self.blocks)
        stored = rng.sample(free, rng.randint(0, min(4, len(free))))
        self.blocks.update(stored)
        self.sequence += 1
        return event(worker_id, self.sequence, stored, removed, cleared)


def _simulate(seed: int, *, restarts: bool) -> None:
    rng = random.Random(seed)
    ids = ["w0", "w1", "w2"]
    universe = 40
    index = KvIndex(max_buffered_events=rng.choice([2, 5, 10_000]))
    reference = KvIndex()  # sees every event, in order, at once
    workers = {w: _Worker() for w in ids}
    for w in ids:
        index.add_worker(w)
        reference.add_worker(w)
    drop, delay = rng.choice([0.0, 0.05, 0.3]), rng.randint(0, 3)
    queue: list = []  # (time, n, kind, payload): deliveries in time order, FIFO within a time
    n = 0
    in_flight: set[str] = set()
    wanted: set[str] = set()

    def schedule(at: int, kind: str, payload) -> None:
        nonlocal n
        n += 1
        heapq.heappush(queue, (at, n, kind, payload))

    def want(worker_id: str, now: int) -> None:
        # Like the router's resync loop: one fetch per worker at a time, later wants wait for it.
        if worker_id in in_flight:
            wanted.add(worker_id)
        else:
            in_flight.add(worker_id)
            schedule(now + rng.randint(0, 3), "take", worker_id)

    def step(now: int, *, generate: bool, lossy: bool) -> None:
        for w in ids:
            if generate and restarts and lossy and rng.random() < 0.01:
                workers[w] = _Worker()
                schedule(now + rng.randint(0, 4), "reregister", w)
            if generate and (rng.random() < 0.7 or not lossy):
                e = workers[w].next_event(w, rng, universe)
                if not restarts:
                    assert reference.apply_event(e) is False
                if not (lossy and rng.random() < drop):
                    schedule(now + delay, "event", e)
        while queue and queue[0][0] <= now:
            _, _, kind, payload = heapq.heappop(queue)
            if kind == "event":
                if index.apply_event(payload):
                    want(payload.worker_id, now)
            elif kind == "reregister":
                index.mark_resync(payload, clear=True)
                want(payload, now)
            elif kind == "take":
                worker = workers[payload]
                # The sequence is read before the blocks: later events may already be reflected.
                lag = rng.randint(0, min(2, worker.sequence))
                schedule(now + rng.randint(0, 3), "load", (payload, worker.sequence - lag, frozenset(worker.blocks)))
            else:
                worker_id, sequence, blocks = payload
                in_flight.discard(worker_id)
                again = index.load_snapshot(worker_id, sequence, blocks)
                if again or worker_id in wanted:
                    wanted.discard(worker_id)
                    want(worker_id, now)

    for now in range(300):
        step(now, generate=True, lossy=True)
    for now in range(300, 302):  # more events, none lost, expose any trailing gap
        step(now, generate=True, lossy=False)
    now = 302
    while queue or wanted:
        now += 1
        step(now, generate=False, lossy=False)

    for w in ids:
        assert index.block_hashes(w) == frozenset(workers[w].blocks), (seed, w)
        assert not index.resync_pending(w)
        if not restarts:
            assert reference.block_hashes(w) == index.block_hashes(w)
    for h in range(1, universe):
        assert index.matched_blocks([h]) == {w: 1 for w in ids if h in workers[w].blocks}
    assert index.total_indexed_blocks() == sum(len(workers[w].blocks) for w in ids)


@pytest.mark.parametrize("seed", range(40))
def test_lossy_streams_with_snapshots_converge_to_the_ungapped_state(seed):
    _simulate(seed, restarts=False)


@pytest.mark.parametrize("seed", range(40))
def test_lossy_streams_with_restarts_converge_to_each_workers_blocks(seed):
    _simulate(1000 + seed, restarts=True)
