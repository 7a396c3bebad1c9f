"""A request's commit in the checkpoint store, and which copy of the request owns it.

An ``Entry`` holds one request's ``CommitRecord`` with its KV and media embeddings. Each segment names its writer's
copy of the request (``Segment.copy_id``); when another copy takes the commit over, the copy it took it from is
superseded (the rules: ``phalanx.checkpoint_store.store``). ``Tombstones`` remembers, for a while after a release,
the copies a request superseded, so that an old copy cannot start it again from position 0.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from phalanx._proto import checkpoint_pb2
from phalanx.checkpoint_store.kv_track import KvTrack
from phalanx.checkpoint_store.media_track import MediaTrack
from phalanx.checkpoint_store.segments import Writer

__all__ = ["Entry", "Tombstones", "commit", "new_record", "superseded", "take_state"]

# Released requests whose superseded copies are remembered (an old copy must not start one again from position 0).
_TOMBSTONES = 16384


@dataclass
class Entry:
    record: checkpoint_pb2.CommitRecord
    kv: KvTrack
    # Embeddings of the media in record.state.media (Segment.media): in memory, spilled with the KV.
    media: MediaTrack
    # (start, end, crc32) of each range of KV written with a checksum, in position order, within [0, kv_tokens).
    checksums: list[tuple[int, int, int]] = field(default_factory=list)
    copy_id: int = 0  # the owner's copy (Segment.copy_id); 0: unknown
    # Former owners -> their newest copy that lost the commit: segments of those copies (or older ones) are superseded.
    superseded: dict[str, int] = field(default_factory=dict)
    # Its KV was dropped because it could not spill: segments update the commit only, until a resync.
    kv_dropped: bool = False

    @property
    def memory_bytes(self) -> int:
        return self.kv.memory_bytes + self.media.memory_bytes

    @property
    def disk_bytes(self) -> int:
        return self.kv.disk_bytes + self.media.disk_bytes

    def is_duplicate(self, worker_id: str, segment: checkpoint_pb2.Segment) -> bool:
        """Whether ``segment`` is one the owner's copy sent before (an old ``seq``)."""
        return self.record.worker_id == worker_id and segment.copy_id == self.copy_id and segment.seq <= self.record.seq

    def take_over(self, worker_id: str, copy: int) -> None:
        """``worker_id``'s copy ``copy`` owns the commit from now on; the copy it had before is superseded."""
        owner = self.record.worker_id
        if self.copy_id and (owner, self.copy_id) != (worker_id, copy):
            self.superseded[owner] = max(self.copy_id, self.superseded.get(owner, 0))
        self.copy_id = copy

    def lost_copies(self) -> dict[str, int]:
        """What a release leaves superseded: the former owners' copies and the owner's own."""
        lost = dict(self.superseded)
        if self.copy_id:
            lost[self.record.worker_id] = max(self.copy_id, lost.get(self.record.worker_id, 0))
        return lost


class Tombstones:
    """Released requests -> the copies they superseded, their last owner's included (oldest first, bounded)."""

    def __init__(self, limit: int = _TOMBSTONES) -> None:
        self._limit = limit
        self._lost: collections.OrderedDict[str, dict[str, int]] = collections.OrderedDict()

    def lost(self, request_id: str) -> dict[str, int]:
        return self._lost.get(request_id, {})

    def bury(self, request_id: str, lost: dict[str, int]) -> None:
        """Remember ``lost`` (worker id -> its newest superseded copy) of a released request; the oldest go past the limit."""
        if lost:
            self._lost[request_id] = lost
            while len(self._lost) > self._limit:
                self._lost.popitem(last=False)

    def pop(self, request_id: str) -> dict[str, int]:
        """What a released request superseded, forgotten here: it starts again (its entry remembers from now on)."""
        return self._lost.pop(request_id, {})


def superseded(entry: Entry | None, tombstones: Tombstones, worker_id: str, segment: checkpoint_pb2.Segment) -> bool:
    """Whether ``segment`` comes from a copy of the request that lost its commit (``entry``; None: released or never seen)."""
    copy = segment.copy_id
    if not copy:
        return False
    if entry is None:
        return copy <= tombstones.lost(segment.request_id).get(worker_id, 0)
    if entry.record.worker_id == worker_id:
        return copy < entry.copy_id
    return copy <= entry.superseded.get(worker_id, 0)


def new_record(writer: Writer, segment: checkpoint_pb2.Segment) -> checkpoint_pb2.CommitRecord:
    """The commit record of a request (re)started by ``segment`` (``kv_start`` 0): its whole state, no KV yet."""
    record = checkpoint_pb2.CommitRecord(
        request_id=segment.request_id, worker_id=writer.worker_id, seed=segment.seed, model_version=writer.model_version,
        layout=writer.layout.to_proto(), last_index=-1,
    )
    record.state.CopyFrom(segment.state)
    record.state.request_id = segment.request_id
    if segment.generator_state:
        record.state.generator_state = segment.generator_state
    return record


def take_state(record: checkpoint_pb2.CommitRecord, writer: Writer, segment: checkpoint_pb2.Segment) -> None:
    """A segment's tokens and sampling state into the commit (not its KV)."""
    if segment.HasField("state"):  # a new owner takes the commit over (restored from it): its whole state
        record.state.CopyFrom(segment.state)
    record.state.output_token_ids.extend(segment.appended_output_ids)
    if segment.generator_state:
        record.state.generator_state = segment.generator_state
    record.worker_id = writer.worker_id
    record.model_version = writer.model_version


def commit(record: checkpoint_pb2.CommitRecord, segment: checkpoint_pb2.Segment, now: float) -> None:
    """The commit point moves to ``segment``'s end, at ``now``."""
    record.kv_tokens = segment.kv_end
    record.seq = segment.seq
    record.last_index = len(record.state.output_token_ids) - 1
    record.updated_at = now
