"""Commit records and KV of in-flight requests: the checkpoint store's logic, with no network.

Workers stream every request's newly computed KV as segments of token
positions ``[kv_start, kv_end)``. Per request the store keeps a
``CommitRecord`` (prompt, committed outputs, sampling, generator state, seed)
and the KV of positions ``[0, kv_tokens)``:

- ``kv_start == 0`` (re)starts the request: full state, new owner, old KV dropped;
- ``0 < kv_start <= kv_tokens`` with a newer ``seq`` (or from another worker,
  which after a migration may number its segments afresh) truncates the KV to
  ``kv_start`` and appends; one that carries a full state replaces the
  commit's (a worker that restored the request from this commit takes it
  over without sending its KV again);
- an old ``seq`` from the owner (its copy of the request) is a duplicate and changes nothing;
- anything that would leave a hole is a gap: nothing is applied and the ack
  asks the worker to resync (send the request again from position 0);
- a segment whose KV does not match its ``kv_crc32`` is corrupt: nothing of it
  is applied, it is counted, and the ack asks for a resync as for a gap. A
  segment without a checksum (a writer from before checksums) is applied and
  counted as unchecked;
- a segment of a superseded copy changes nothing (ack ``superseded``, no
  resync): each segment names its writer's copy of the request (``copy_id``,
  when that worker admitted or restored it). When another writer takes the
  commit over, the copy it took it from is superseded, and so is any copy of
  that writer no newer than it, and any copy of the owner older than the
  owner's: a worker cut off by a partition, or hung, runs its copy on while
  the request moves elsewhere, and must not take the commit back once it is
  reachable again (two owners of one request). A newer copy of a former owner
  (the request migrated back to it) takes the commit over as any writer does.
  Released requests keep what they superseded for a while (``commits.Tombstones``),
  so that an old copy cannot start them again from position 0.

A whole state may bring the embeddings of the request's media
(``Segment.media``): kept with the commit for restores that have no other
copy of them, and kept across a restart of the request whose state names the
same media. An item that does not fit its state (unknown span, wrong byte
count or dtype) is left out, not the segment: the commit stays good for a
caller that brings them. They count in ``memory_bytes`` and spill with the
request's KV (first, into a ``.media`` file beside its ``.kv`` one, each item
with its CRC-32), are read back from there for ``media()``, and go with the
commit. A spill of them that fails is a failed spill like the KV's (below):
the embeddings in memory are dropped with the KV (``media_held`` says what
is left) and the resync brings both again. Embeddings that cannot be read
back (a short file, a checksum that fails) are dropped and not answered.

The checksum of every range of KV written is kept with the request, and the
KV a restore reads is checked against them before it leaves the store (a bit
flipped in memory or in a spill file since): a mismatch drops the request's
KV (its commit record stays, for a re-prefill) and the restore fails with
``CorruptCheckpointError``, so migration recomputes instead of restoring
wrong KV.

KV lives in memory up to ``memory_limit_bytes``; beyond it the least recently
updated requests' KV is appended to one spill file per request and read back
from there (file part + memory tail) on restore. A spill that fails (ENOSPC:
the disk is full, or any other OSError) leaves no partial chunk behind; the
memory limit still holds, so the KV that could not spill is dropped, the
request's commit record staying (``kv_tokens`` 0: a restore re-prefills from
it). Its later segments update the commit without KV. The store logs the
failure once per outage and counts it; it tries the disk again
``spill_retry_s`` later (meanwhile what would spill is dropped at once), and
from then on the requests whose KV was dropped are asked to resync (their
next segment gets a resync ack), so that they are checkpointed in full again
once there is room. How a request's KV is held, in memory and in its spill
file: ``kv_track``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx._proto import checkpoint_pb2, common_pb2
from phalanx.checkpoint_store.commits import Entry, Tombstones, commit, new_record, superseded, take_state
from phalanx.checkpoint_store.errors import (
    CheckpointStoreError,
    CorruptCheckpointError,
    InvalidCheckpointError,
    NotCommittedError,
    UnknownRequestError,
)
from phalanx.checkpoint_store.kv_track import BlockPool, KvTrack
from phalanx.checkpoint_store.media_track import MediaTrack, fits
from phalanx.checkpoint_store.segments import Ack, KvLayout, SegmentResult, Writer, segment_tensor
from phalanx.checkpoint_store.spill_files import byte_view
from phalanx.checkpoint_store.spill_outage import SpillOutage

__all__ = [
    "Ack",
    "CheckpointStore",
    "CheckpointStoreError",
    "CorruptCheckpointError",
    "InvalidCheckpointError",
    "KvLayout",
    "NotCommittedError",
    "SegmentResult",
    "StoreStats",
    "UnknownRequestError",
    "Writer",
    "byte_view",
]

log = logging.getLogger(__name__)

# Spilling goes on until memory is back under this share of the limit, so that a
# store at its limit does not write a sliver of KV on every segment.
_SPILL_LOW_WATER = 0.75
# Token positions of one KV block (see BlockPool) ...
_BLOCK_TOKENS = 64
# ... fewer where the memory limit would hold fewer than this many blocks: a request holds at most one block it has
# not filled, and a small limit must not be taken up by such slack.
_MIN_BLOCKS_IN_LIMIT = 64


@dataclass(frozen=True)
class StoreStats:
    requests: int
    memory_bytes: int
    spilled_bytes: int
    committed_tokens: int
    bytes_received_total: int
    segments_total: dict[SegmentResult, int]
    unchecked_segments_total: int = 0  # applied without a checksum (a writer from before checksums)
    corrupt_restores_total: int = 0  # restores refused: held KV failed its checksum
    spill_failures_total: int = 0  # spills that failed (disk full, I/O error): their KV was dropped
    kv_dropped_total: int = 0  # requests' KV dropped because it could not spill (their restores re-prefill)
    spill_failing: bool = False  # the last spill failed and spilling has not worked since


class CheckpointStore:
    """Commit records and KV of in-flight requests, bounded in memory, spilling to ``spill_dir``.

    Not thread-safe: the service calls it from its event loop only.
    """

    def __init__(
        self,
        spill_dir: Path | str,
        *,
        memory_limit_bytes: int = 1 << 30,
        retention_s: float = 600.0,
        spill_retry_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spill_dir = Path(spill_dir)
        self.memory_limit_bytes = memory_limit_bytes
        self.retention_s = retention_s
        self._outage = SpillOutage(spill_retry_s)
        self._kv_dropped = 0
        self._clock = clock
        self._entries: dict[str, Entry] = {}
        self._pools: dict[KvLayout, BlockPool] = {}
        self._files = 0
        self._memory = 0
        self._disk = 0
        self._committed_tokens = 0
        self._bytes_received = 0
        self._segments = dict.fromkeys(SegmentResult, 0)
        self._unchecked = 0
        self._corrupt_restores = 0
        self._tombstones = Tombstones()

    # -- writes ---------------------------------------------------------------------------------

    def apply(self, writer: Writer, segment: checkpoint_pb2.Segment) -> Ack:
        """Apply one segment from ``writer`` by the rules in the module docstring."""
        data = segment.kv  # each read of a bytes field copies it (upb): once only
        kv = segment_tensor(writer.layout, segment, data)
        self._bytes_received += len(data)
        entry = self._entries.get(segment.request_id)
        if data and segment.HasField("kv_crc32") and zlib.crc32(data) != segment.kv_crc32:
            kv_tokens = 0 if entry is None else entry.record.kv_tokens
            log.warning("request %s from %s: KV [%d, %d) fails its checksum; not applied, resync",
                        segment.request_id, writer.worker_id, segment.kv_start, segment.kv_end)
            return self._count(Ack(segment.request_id, segment.seq, kv_tokens, SegmentResult.CORRUPT, len(data)))
        if superseded(entry, self._tombstones, writer.worker_id, segment):
            kv_tokens = 0 if entry is None else entry.record.kv_tokens
            log.info("request %s: segment of %s's copy %d refused, the commit belongs to %s now", segment.request_id, writer.worker_id,
                     segment.copy_id, "nobody (released)" if entry is None else entry.record.worker_id)
            return self._count(Ack(segment.request_id, segment.seq, kv_tokens, SegmentResult.SUPERSEDED, len(data), segment.copy_id))
        if entry is not None and entry.is_duplicate(writer.worker_id, segment):
            return self._count(Ack(segment.request_id, entry.record.seq, entry.record.kv_tokens, SegmentResult.DUPLICATE, len(data)))
        if segment.kv_start == 0:
            entry = self._restart(writer, segment, entry)
        elif entry is not None and entry.kv_dropped:
            return self._count(self._apply_without_kv(writer, entry, segment, len(data)))
        elif entry is None or segment.kv_start > entry.record.kv_tokens or entry.kv.layout != writer.layout:
            kv_tokens = 0 if entry is None else entry.record.kv_tokens
            return self._count(Ack(segment.request_id, segment.seq, kv_tokens, SegmentResult.GAP, len(data)))
        else:
            entry.take_over(writer.worker_id, segment.copy_id)  # before the state names the writer as the owner
            self._take_state(entry, writer, segment)
        record = entry.record
        if kv.shape[2] == 0 and segment.kv_start == record.kv_tokens:
            # Output tokens only, most segments: the KV and the totals stay as they are (a whole state's media do not).
            commit(record, segment, self._clock())
            if segment.media:
                self._enforce_limit()
            return self._count(Ack(segment.request_id, segment.seq, segment.kv_end, SegmentResult.APPLIED, len(data)))
        with self._accounting(entry):
            entry.kv.truncate(segment.kv_start)
            entry.kv.append(kv)
            commit(record, segment, self._clock())
        # A range cut by the truncation loses its checksum (the part kept is unverified from then on).
        entry.checksums = [c for c in entry.checksums if c[1] <= segment.kv_start]
        if segment.HasField("kv_crc32"):
            entry.checksums.append((segment.kv_start, segment.kv_end, segment.kv_crc32))
        else:
            self._unchecked += 1
        self._enforce_limit()
        return self._count(Ack(segment.request_id, segment.seq, segment.kv_end, SegmentResult.APPLIED, len(data)))

    def _apply_without_kv(self, writer: Writer, entry: Entry, segment: checkpoint_pb2.Segment, nbytes: int) -> Ack:
        """A segment of a request whose KV was dropped: its tokens and state go into the commit (a re-prefill needs
        them), its KV nowhere. From the next try of the disk on, a resync instead: the whole request comes again, KV
        included (held in memory while there is room; dropped again if it must spill and the disk is still full)."""
        if not self._outage.waiting(self._clock()):
            return Ack(segment.request_id, segment.seq, 0, SegmentResult.GAP, nbytes)
        record = entry.record
        entry.take_over(writer.worker_id, segment.copy_id)
        self._take_state(entry, writer, segment)
        commit(record, segment, self._clock())
        record.kv_tokens = 0
        if segment.media:
            self._enforce_limit()  # while the disk is tried again, these go at once (the resync brings them back)
        return Ack(segment.request_id, segment.seq, 0, SegmentResult.APPLIED, nbytes)

    def release(self, request_id: str, *, worker_id: str | None = None) -> bool:
        """Drop a request's commit and KV; with ``worker_id``, only if that worker owns it. True if dropped.

        A worker that handed a request over may release it after the new owner
        started checkpointing it; the owner check keeps the new owner's commit.
        """
        entry = self._entries.get(request_id)
        if entry is None or (worker_id is not None and entry.record.worker_id != worker_id):
            return False
        self._drop(request_id)
        self._tombstones.bury(request_id, entry.lost_copies())
        return True

    def expire(self) -> list[str]:
        """Drop the requests not updated for ``retention_s``; their ids."""
        cutoff = self._clock() - self.retention_s
        expired = [request_id for request_id, entry in self._entries.items() if entry.record.updated_at < cutoff]
        for request_id in expired:
            self._drop(request_id)
        return expired

    def close(self) -> None:
        """Drop everything (memory and spill files)."""
        for request_id in list(self._entries):
            self._drop(request_id)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, request_id: str) -> checkpoint_pb2.CommitRecord:
        """A copy of the request's commit record."""
        entry = self._entry(request_id)
        record = checkpoint_pb2.CommitRecord()
        record.CopyFrom(entry.record)
        return record

    def media(self, request_id: str) -> list[common_pb2.MediaEmbedding]:
        """The embeddings of the request's media that the store holds (``CommitRecord.media_held`` of them), spilled
        ones read back. Those that cannot be read back are dropped (``media_held`` 0 from then on): ask before ``get``."""
        entry = self._entry(request_id)
        try:
            return entry.media.read()
        except OSError as error:
            log.warning("request %s: cannot read its media embeddings back (%s); dropped", request_id, error)
            with self._accounting(entry):
                entry.media.drop()
                entry.record.media_held = 0
            return []

    def records(self, worker_id: str = "") -> list[checkpoint_pb2.CommitRecord]:
        """Copies of the commit records owned by ``worker_id`` (every record if empty), by request id."""
        return [self.get(request_id) for request_id, entry in sorted(self._entries.items())
                if not worker_id or entry.record.worker_id == worker_id]

    def check(self, request_id: str, kv_tokens: int) -> KvLayout:
        """The request's KV layout if positions [0, kv_tokens) are committed; else UnknownRequestError / NotCommittedError."""
        entry = self._entry(request_id)
        if kv_tokens < 0 or kv_tokens > entry.record.kv_tokens:
            raise NotCommittedError(request_id, kv_tokens, entry.record.kv_tokens)
        return entry.kv.layout

    def read_kv(self, request_id: str, kv_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Positions [0, kv_tokens) as a contiguous [num_layers, 2, kv_tokens, num_kv_heads, head_dim] tensor.

        A new one, or ``out`` filled (a reused buffer: a new one costs page faults).
        """
        self.check(request_id, kv_tokens)
        entry = self._entries[request_id]
        kv = entry.kv.read(kv_tokens, out)
        for start, end, crc in entry.checksums:
            if end > kv_tokens:
                break
            if zlib.crc32(byte_view(kv[:, :, start:end].contiguous())) != crc:
                self._corrupt_restores += 1
                log.warning("request %s: held KV [%d, %d) fails its checksum; dropped", request_id, start, end)
                with self._accounting(entry):
                    entry.kv.truncate(0)
                    entry.record.kv_tokens = 0
                entry.checksums.clear()
                raise CorruptCheckpointError(request_id, start, end)
        return kv

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def memory_bytes(self) -> int:
        return self._memory

    @property
    def spilled_bytes(self) -> int:
        return self._disk

    @property
    def committed_tokens(self) -> int:
        return self._committed_tokens

    @property
    def pooled_bytes(self) -> int:
        """Memory of KV blocks kept for reuse (released requests'): ``memory_bytes`` plus this stays within the limit."""
        return sum(pool.free_bytes for pool in self._pools.values())

    def stats(self) -> StoreStats:
        return StoreStats(
            requests=len(self._entries), memory_bytes=self._memory, spilled_bytes=self._disk,
            committed_tokens=self._committed_tokens, bytes_received_total=self._bytes_received, segments_total=dict(self._segments),
            unchecked_segments_total=self._unchecked, corrupt_restores_total=self._corrupt_restores,
            spill_failures_total=self._outage.failures, kv_dropped_total=self._kv_dropped, spill_failing=self.spill_failing,
        )

    @property
    def spill_retry_s(self) -> float:
        """Seconds after a failed spill before the disk is tried again."""
        return self._outage.retry_s

    @property
    def spill_failures_total(self) -> int:
        return self._outage.failures

    @property
    def kv_dropped_total(self) -> int:
        return self._kv_dropped

    @property
    def spill_failing(self) -> bool:
        """Whether the last spill failed (and none worked since)."""
        return self._outage.failing

    # -- internals ------------------------------------------------------------------------------

    def _entry(self, request_id: str) -> Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise UnknownRequestError(request_id)
        return entry

    def _restart(self, writer: Writer, segment: checkpoint_pb2.Segment, previous: Entry | None) -> Entry:
        moved: MediaTrack | None = None  # the previous commit's embeddings, for a restart that brings none
        if previous is not None:
            previous.take_over(writer.worker_id, segment.copy_id)
            lost = previous.superseded
            with self._accounting(previous):
                moved, previous.media = previous.media, MediaTrack(previous.media.path)
            self._drop(segment.request_id)
        else:
            lost = self._tombstones.pop(segment.request_id)
        self._files += 1
        track = KvTrack(self._pool(writer.layout), self.spill_dir / f"{self._files:08d}.kv")
        media = MediaTrack(self.spill_dir / f"{self._files:08d}.media")
        entry = self._entries[segment.request_id] = Entry(
            new_record(writer, segment), track, media, copy_id=segment.copy_id, superseded=lost
        )
        if moved is not None and not segment.media:
            with self._accounting(entry):
                entry.media = moved
        elif moved is not None:
            moved.drop()
        self._keep_media(entry, list(segment.media))
        return entry

    def _take_state(self, entry: Entry, writer: Writer, segment: checkpoint_pb2.Segment) -> None:
        """A segment's tokens and sampling state into the commit (not its KV); a whole state's media too."""
        take_state(entry.record, writer, segment)
        if segment.HasField("state"):
            self._keep_media(entry, list(segment.media))

    def _keep_media(self, entry: Entry, media: list[common_pb2.MediaEmbedding]) -> None:
        """Of ``media`` (a segment's, replacing what the entry holds; none: what it holds), the embeddings that fit the
        state's media spans, one per span."""
        spans = {(m.start, m.rows, m.media_hash) for m in entry.record.state.media}
        if not media:
            with self._accounting(entry):
                entry.media.keep(spans)
            entry.record.media_held = len(entry.media)
            return
        kept: dict[tuple[int, int, int], common_pb2.MediaEmbedding] = {}
        for item in media:
            if not fits(item, spans):
                log.warning("request %s: media embeddings at %d (%d rows x %d %s, %d bytes) do not fit its state; not kept",
                            entry.record.request_id, item.start, item.rows, item.hidden, item.dtype, len(item.data))
                continue
            kept[(item.start, item.rows, item.media_hash)] = item
        with self._accounting(entry):
            entry.media.replace(list(kept.values()))
        entry.record.media_held = len(entry.media)

    def _pool(self, layout: KvLayout) -> BlockPool:
        pool = self._pools.get(layout)
        if pool is None:
            fit = self.memory_limit_bytes // (_MIN_BLOCKS_IN_LIMIT * layout.token_bytes)
            pool = self._pools[layout] = BlockPool(layout, max(1, min(_BLOCK_TOKENS, fit)))
        return pool

    def _drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id)
        with self._accounting(entry):
            entry.kv.drop()
            entry.media.drop()
            entry.record.kv_tokens = 0
        self._trim_pools()

    @contextlib.contextmanager
    def _accounting(self, entry: Entry) -> Iterator[None]:
        """Keep the running totals right across a change of one entry's KV or media embeddings."""
        memory, disk, tokens = entry.memory_bytes, entry.disk_bytes, entry.record.kv_tokens
        try:
            yield
        finally:
            self._memory += entry.memory_bytes - memory
            self._disk += entry.disk_bytes - disk
            self._committed_tokens += entry.record.kv_tokens - tokens
            entry.record.spilled = entry.kv.spilled or entry.media.spilled

    def _enforce_limit(self) -> None:
        if self._memory <= self.memory_limit_bytes:
            return
        target = int(self.memory_limit_bytes * _SPILL_LOW_WATER)
        # Least recently updated first (a finished or dead worker's requests), the largest among equals.
        victims = sorted(
            (e for e in self._entries.values() if e.memory_bytes), key=lambda e: (e.record.updated_at, -e.memory_bytes)
        )
        for entry in victims:
            if self._memory <= target:
                break
            with self._accounting(entry):
                if self._outage.waiting(self._clock()):
                    self._drop_kv(entry)
                    continue
                try:
                    entry.media.spill()  # first: KV that spilled while they could not would be dropped all the same
                    entry.kv.spill()
                except OSError as error:
                    self._spill_failed(entry, error)
                else:
                    self._spill_worked()
        self._trim_pools()

    def _spill_failed(self, entry: Entry, error: OSError) -> None:
        if self._outage.failed(self._clock()):
            log.warning(
                "cannot spill KV to %s (%s): requests whose KV does not fit in memory lose it (their restores re-prefill); "
                "trying again every %.0f s", self.spill_dir, error.strerror or error, self.spill_retry_s,
            )
        self._drop_kv(entry)

    def _spill_worked(self) -> None:
        if self._outage.worked():
            log.warning("spilling KV to %s works again (%d spills failed meanwhile, %d requests' KV dropped in all); "
                        "the requests that lost it resync", self.spill_dir, self._outage.failures, self._kv_dropped)

    def _drop_kv(self, entry: Entry) -> None:
        """The KV that cannot spill goes, and the media embeddings still in memory; the commit record stays (kv_tokens
        0), for a re-prefill (with the embeddings spilled before, if any). Within _accounting."""
        entry.kv.drop()
        entry.media.drop_memory()
        entry.record.kv_tokens = 0
        entry.record.media_held = len(entry.media)
        entry.checksums.clear()
        if not entry.kv_dropped:
            entry.kv_dropped = True
            self._kv_dropped += 1

    def _trim_pools(self) -> None:
        """Frees pooled blocks beyond the memory limit: KV held plus blocks kept for reuse stay within it."""
        excess = self._memory + self.pooled_bytes - self.memory_limit_bytes
        for pool in self._pools.values():
            if excess <= 0:
                break
            excess -= pool.shrink(excess)

    def _count(self, ack: Ack) -> Ack:
        self._segments[ack.result] += 1
        return ack
