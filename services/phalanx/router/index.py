"""Which worker holds which KV blocks, kept from the workers' KvEvent streams and KvSnapshot replies.

Layout, chosen for the routing hot path: each worker owns a small integer
slot, and `_masks` maps a block hash to the bitmask of the slots holding it.
A prompt's prefix overlap with every worker at once is then a walk over its
block hashes AND-ing masks; a worker's match length is the position where its
bit drops out, and the walk stops when no bit is left. Each worker also keeps
the `set` of its hashes, for `cleared`, removal of the worker and snapshots.

Keeping a worker's view exact (per worker, by `sequence`):

- `last`: every event up to `last` is reflected. A worker that was never
  synced has `last == 0` with nothing indexed, which is exactly right for a
  fresh worker process, so its event 1 applies directly; any other first
  event is a gap.
- `seen`: the highest sequence received from the stream in its current run.
  After a snapshot at S the stream may still deliver events <= S (the
  snapshot ran ahead of it): those are skipped while they keep rising past
  `seen`. An event at or below `seen` means the worker restarted (or a
  duplicate): resync.
- Gap or restart: the worker goes `pending`, and its events are buffered
  (bounded) until `load_snapshot`, which replays the buffered events past
  the snapshot's sequence in order. `apply_event` asks for a snapshot once
  per pending resync. If the replay meets a gap (the snapshot is older than
  events that were lost or dropped from a full buffer), the rest is dropped
  and one more snapshot is asked for; with no new events that one ends the
  resync, so an idle worker is never asked forever.
- A snapshot may have been taken before the reason for the resync became
  known (the worker restarted while a resync was pending, or `mark_resync`
  was called during one); the load after such a change asks for one more
  snapshot, which is then certain to postdate it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from phalanx._proto import common_pb2

DEFAULT_MAX_BUFFERED_EVENTS = 10_000


class _WorkerKv:
    __slots__ = ("slot", "bit", "hashes", "last", "seen", "pending", "buffer", "refetch")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.hashes: set[int] = set()
        self.last = 0
        self.seen = 0
        self.pending = False
        self.buffer: list[common_pb2.KvEvent] = []
        # A snapshot requested before now may predate the reason to resync: load one more.
        self.refetch = False


class KvIndex:
    """Per-worker KV block residency with prefix-overlap queries over all workers at once."""

    def __init__(self, *, max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS) -> None:
        if max_buffered_events < 1:
            raise ValueError("max_buffered_events must be >= 1")
        self.max_buffered_events = max_buffered_events
        self._masks: dict[int, int] = {}
        self._workers: dict[str, _WorkerKv] = {}
        self._slot_owner: dict[int, str] = {}
        self._free_slots: list[int] = []  # a heap: the lowest slot first keeps masks short
        self._next_slot = 0

    # -- workers --------------------------------------------------------------
    def add_worker(self, worker_id: str) -> int:
        """Registers a worker (no-op if known); returns its slot."""
        w = self._workers.get(worker_id)
        if w is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            w = self._workers[worker_id] = _WorkerKv(slot)
            self._slot_owner[slot] = worker_id
        return w.slot

    def remove_worker(self, worker_id: str) -> None:
        """Drops the worker's blocks and frees its slot for reuse."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._drop_all(w)
        del self._slot_owner[w.slot]
        heapq.heappush(self._free_slots, w.slot)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def slot(self, worker_id: str) -> int:
        return self._workers[worker_id].slot

    def slot_owner(self, slot: int) -> str:
        return self._slot_owner[slot]

    def indexed_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return 0 if w is None else len(w.hashes)

    def total_indexed_blocks(self) -> int:
        """(worker, block) pairs: a block two workers hold counts twice."""
        return sum(len(w.hashes) for w in self._workers.values())

    def distinct_blocks(self) -> int:
        return len(self._masks)

    def last_sequence(self, worker_id: str) -> int:
        return self._workers[worker_id].last

    def resync_pending(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.pending

    def block_hashes(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._workers[worker_id].hashes)

    # -- queries ----------------------------------------------------------------
    def match_slots(self, block_hashes: list[int]) -> dict[int, int]:
        """slot -> number of leading `block_hashes` that slot's worker holds (>= 1 only)."""
        if not block_hashes:
            return {}
        get = self._masks.get
        hashes = iter(block_hashes)
        live = get(next(hashes), 0)
        matched: dict[int, int] = {}
        if not live:
            return matched
        position = 1
        for h in hashes:
            mask = live & get(h, 0)
            if mask != live:
                dropped = live ^ mask
                while dropped:
                    low = dropped & -dropped
                    matched[low.bit_length() - 1] = position
                    dropped ^= low
                live = mask
                if not live:
                    return matched
            position += 1
        while live:
            low = live & -live
            matched[low.bit_length() - 1] = position
            live ^= low
        return matched

    def matched_blocks(self, block_hashes: list[int]) -> dict[str, int]:
        """worker_id -> number of leading `block_hashes` it holds (workers holding >= 1 only)."""
        owner = self._slot_owner
        return {owner[slot]: n for slot, n in self.match_slots(block_hashes).items()}

    # -- events -------------------------------------------------------------------
    def apply_event(self, event: common_pb2.KvEvent) -> bool:
        """Applies or buffers one event; True: fetch a KvSnapshot of event.worker_id and call load_snapshot."""
        w = self._workers.get(event.worker_id)
        if w is None:
            return False  # not registered (yet): its snapshot on registration covers this
        seq = event.sequence
        if w.pending:
            return self._buffer(w, event)
        if seq == w.last + 1:
            self._apply(w, event)
            w.last = w.seen = seq
            return False
        if w.seen < seq <= w.last:
            w.seen = seq  # the snapshot this state came from already reflects it
            return False
        # A gap (seq > last + 1) or a restart / duplicate (seq <= seen).
        w.pending = True
        w.buffer = [event]
        w.seen = seq
        return True

    def mark_resync(self, worker_id: str, *, clear: bool = False) -> None:
        """Forces a resync; the caller fetches a snapshot. `clear` drops the worker's blocks now
        (its process restarted: what it held is gone)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        if clear:
            self._drop_all(w)
        # A snapshot requested from now on reflects every event received so far (or comes from a
        # newer process, for which they are meaningless): the buffer can go.
        w.refetch = w.pending
        w.pending = True
        w.buffer = []
        w.seen = 0  # the next event starts the run that is matched against the snapshot

    def load_snapshot(self, worker_id: str, sequence: int, block_hashes: Iterable[int]) -> bool:
        """Replaces the worker's blocks with a KvSnapshot reply and replays buffered events past `sequence`.
        True: the result is still not known to be exact; fetch another snapshot."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        self._replace(w, set(block_hashes))
        w.last = sequence
        gap = False
        for event in w.buffer:
            if event.sequence <= w.last:
                continue
            if event.sequence != w.last + 1:
                # Events this snapshot does not cover were lost (or the buffered ones come from
                # another process). Drop the rest: a later snapshot covers them, and dropping
                # keeps an idle worker from being asked forever.
                gap = True
                break
            self._apply(w, event)
            w.last = event.sequence
        again = gap or w.refetch
        w.buffer, w.refetch, w.pending = [], False, again
        if w.seen > w.last:
            # The snapshot is older than the stream (or from a restarted process): judge the
            # next events against it, so that a gap shows.
            w.seen = w.last
        return again

    # -- internals ----------------------------------------------------------------
    def _buffer(self, w: _WorkerKv, event: common_pb2.KvEvent) -> bool:
        seq = event.sequence
        if seq <= w.seen:
            # The worker restarted during the resync: only the new run can be replayed, and a
            # snapshot already under way may come from the old process.
            w.buffer = [event]
            w.seen = seq
            w.refetch = True
            return True
        w.seen = seq
        if len(w.buffer) >= self.max_buffered_events:
            # Keep waiting: a snapshot taken after the dropped events still converges, and
            # an older one finds the buffer starting past its sequence, a gap.
            w.buffer = []
        w.buffer.append(event)
        return False

    def _apply(self, w: _WorkerKv, event: common_pb2.KvEvent) -> None:
        if event.cleared:
            self._drop_all(w)
        masks, hashes, bit = self._masks, w.hashes, w.bit
        if event.removed:
            keep = ~bit
            for h in event.removed:
                if h in hashes:
                    hashes.discard(h)
                    mask = masks[h] & keep
                    if mask:
                        masks[h] = mask
                    else:
                        del masks[h]
        for block in event.stored:
            h = block.block_hash
            if h not in hashes:
                hashes.add(h)
                masks[h] = masks.get(h, 0) | bit

    def _replace(self, w: _WorkerKv, new: set[int]) -> None:
        masks, old, bit = self._masks, w.hashes, w.bit
        keep = ~bit
        for h in old - new:
            mask = masks[h] & keep
            if mask:
                masks[h] = mask
            else:
                del masks[h]
        for h in new - old:
            masks[h] = masks.get(h, 0) | bit
        w.hashes = new

    def _drop_all(self, w: _WorkerKv) -> None:
        masks, keep = self._masks, ~w.bit
        for h in w.hashes:
            mask = masks[h] & keep
            if mask:
                masks[h] = mask
            else:
                del masks[h]
        w.hashes = set()
