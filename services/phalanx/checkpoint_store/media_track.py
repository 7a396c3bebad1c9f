"""One request's media embeddings in the checkpoint store: in memory until the request spills, then in a ``.media`` file.

Each spilled item keeps the CRC-32 of its bytes; one that is short or fails it when read back is an OSError, and the
store drops the request's embeddings (see ``phalanx.checkpoint_store.store``).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

from phalanx._proto import common_pb2
from phalanx.checkpoint_store.spill_files import append_to_file

__all__ = ["MediaTrack", "fits"]

log = logging.getLogger(__name__)

# Bytes per value of the dtypes media embeddings travel in (MediaEmbedding.dtype).
_MEDIA_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def fits(item: common_pb2.MediaEmbedding, spans: set[tuple[int, int, int]]) -> bool:
    """Whether ``item`` embeds one of ``spans`` (start, rows, media_hash) with the byte count its shape and dtype make."""
    size = _MEDIA_DTYPE_BYTES.get(item.dtype, 0)
    if (item.start, item.rows, item.media_hash) not in spans or not size or item.hidden < 1:
        return False
    return len(item.data) == item.rows * item.hidden * size


@dataclass
class _HeldMedia:
    """One media item's embeddings: ``data`` in memory, or at ``offset`` of the media spill file once spilled."""

    item: common_pb2.MediaEmbedding  # without its data: a message of its own (a segment's would keep the segment alive)
    data: bytes | None
    nbytes: int
    offset: int = -1  # in the media spill file; -1: in memory
    crc: int = 0  # of the bytes spilled

    @classmethod
    def of(cls, item: common_pb2.MediaEmbedding) -> _HeldMedia:
        data = item.data  # a copy (upb), once
        meta = common_pb2.MediaEmbedding(start=item.start, rows=item.rows, hidden=item.hidden, dtype=item.dtype,
                                         media_hash=item.media_hash)
        if item.HasField("source"):
            meta.source.CopyFrom(item.source)
        return cls(meta, data, len(data))

    def with_data(self, data: bytes) -> common_pb2.MediaEmbedding:
        item = common_pb2.MediaEmbedding()
        item.CopyFrom(self.item)
        item.data = data
        return item


class MediaTrack:
    """One request's media embeddings: in memory until the request spills, then in its own spill file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[_HeldMedia] = []
        self._end = 0  # bytes of the spill file in use

    @property
    def memory_bytes(self) -> int:
        return sum(h.nbytes for h in self.items if h.offset < 0)

    @property
    def disk_bytes(self) -> int:
        return self._end

    @property
    def spilled(self) -> bool:
        return any(h.offset >= 0 for h in self.items)

    def __len__(self) -> int:
        return len(self.items)

    def replace(self, items: list[common_pb2.MediaEmbedding]) -> None:
        """Hold ``items`` (in memory) instead of what was held."""
        self.drop()
        self.items = [_HeldMedia.of(item) for item in items]

    def keep(self, keys: set[tuple[int, int, int]]) -> None:
        """Only the items whose (start, rows, media_hash) is in ``keys``; a spilled one's bytes stay in the file."""
        self.items = [h for h in self.items if (h.item.start, h.item.rows, h.item.media_hash) in keys]
        if not self.spilled:
            self._trim()

    def spill(self) -> int:
        """Append the items in memory to the spill file; the bytes written.

        OSError if a write fails: the file is cut back to what it held and the items stay in memory.
        """
        pending = [h for h in self.items if h.offset < 0]
        if not pending:
            return 0
        data: list[bytes] = []
        for held in pending:
            assert held.data is not None  # in memory
            data.append(held.data)
        offsets, end = append_to_file(self.path, self._end, [memoryview(d) for d in data])
        for held, bytes_, offset in zip(pending, data, offsets, strict=True):
            held.offset, held.crc, held.data = offset, zlib.crc32(bytes_), None
        start, self._end = self._end, end
        return end - start

    def read(self) -> list[common_pb2.MediaEmbedding]:
        """The items with their data, spilled ones read back and checked; OSError if one cannot be."""
        out = []
        with contextlib.ExitStack() as stack:
            file = None
            for held in self.items:
                if held.data is not None:
                    out.append(held.with_data(held.data))
                    continue
                if file is None:
                    file = stack.enter_context(open(self.path, "rb"))
                file.seek(held.offset)
                data = file.read(held.nbytes)
                if len(data) != held.nbytes or zlib.crc32(data) != held.crc:
                    raise OSError(f"media spill file {self.path}: {held.nbytes} bytes at {held.offset} are short or fail their checksum")
                out.append(held.with_data(data))
        return out

    def drop_memory(self) -> None:
        """Drop the items held in memory (they could not spill); spilled ones stay."""
        self.items = [h for h in self.items if h.offset >= 0]

    def drop(self) -> None:
        """Drop every item and delete the spill file."""
        self.items = []
        self._trim()

    def _trim(self) -> None:
        if self._end:
            self._end = 0
            try:
                self.path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("cannot delete the media spill file %s: %s", self.path, error)
