"""Checkpoint KV from the engine process to the worker through one shared buffer, mapped by both once.

The engine process captures checkpoints (engine_core.py) and the worker streams them to the store. A capture's KV
pickled as a tensor crossed the pipe as torch shared memory: a new segment per capture (created, filled by a
copy, its file descriptor handed over through multiprocessing's resource sharer, mapped by the worker), 1.4-7.6 ms
of the two processes' CPU per capture on a 2-core box, about one capture per step. Here the child copies each
piece's KV into a ring of shared memory it sent the worker once, at start, and the piece carries only where it lies
(`RingSlice`); the worker reads it there as a tensor view.

Space is freed in capture order, as the worker reports the bytes it sent (`CaptureControl.sent_bytes`, which the
streamer sends after each message was built, with the KV copied into it), and all of it when every request is
re-synced (the worker then drops whatever it had not sent, and captures still in the pipe with it). A capture
that does not fit while the ring is full of unsent ones crosses the pipe as before.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from phalanx.worker.checkpointing import _Capture

_ALIGN = 64  # every slice starts on a cache line: any dtype's view of it is aligned


@dataclass(frozen=True, slots=True)
class RingSlice:
    """A checkpoint piece's KV in the capture ring: a contiguous tensor of `shape` and `dtype` from byte `offset`."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


class CaptureRing:
    """The engine process's side: places captures' KV in the ring and frees it as the worker reports it sent."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # uint8, shared with the worker
        self.size = data.numel() - data.numel() % _ALIGN
        self.head = 0  # bytes ever taken (padding at the end included) and ever freed: head - tail are in use
        self.tail = 0
        self._captures: collections.deque[tuple[int, int]] = collections.deque()  # (capture's nbytes, ring bytes it holds)

    @property
    def used(self) -> int:
        return self.head - self.tail

    def place(self, capture: _Capture) -> bool:
        """Moves the capture's KV into the ring (its pieces then hold RingSlices); False if it does not fit (unchanged)."""
        if capture.nbytes == 0:
            return False
        pieces = [p for p in capture.pieces if p.kv is not None]
        taken = self._take(sum(_aligned(p.kv.nbytes) for p in pieces))
        if taken is None:
            self._captures.append((capture.nbytes, 0))  # sent the old way; its bytes are still reported
            return False
        offset, held = taken
        for piece in pieces:
            kv = piece.kv
            view = self.data[offset : offset + kv.nbytes].view(kv.dtype).view(kv.shape)
            view.copy_(kv)
            piece.kv = RingSlice(offset, tuple(kv.shape), str(kv.dtype).removeprefix("torch."))
            offset += _aligned(kv.nbytes)
        self._captures.append((capture.nbytes, held))
        return True

    def sent(self, nbytes: int) -> None:
        """The worker sent the next captures, `nbytes` of KV in all (whole captures, in order): their space is free."""
        while nbytes > 0 and self._captures:
            capture_bytes, held = self._captures.popleft()
            nbytes -= capture_bytes
            self.tail += held

    def reset(self) -> None:
        """Every request re-synced: the worker holds none of the ring any more."""
        self.tail = self.head
        self._captures.clear()

    def _take(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, bytes held, the end's padding included) of `nbytes` in one piece, or None while they are not free."""
        if self.used == 0:  # empty: start again at the beginning
            self.head = self.tail = self.head + (-self.head) % self.size
        position = self.head % self.size
        padding = self.size - position if position + nbytes > self.size else 0  # wraps: skips the end
        if nbytes > self.size or self.used + padding + nbytes > self.size:
            return None
        self.head += padding
        offset = self.head % self.size
        self.head += nbytes
        return offset, padding + nbytes


def ring_view(data: torch.Tensor, where: RingSlice) -> torch.Tensor:
    """The worker's side: the tensor a RingSlice names, a view of the shared ring (valid until its bytes are reported sent)."""
    import torch

    dtype = getattr(torch, where.dtype)
    nbytes = dtype.itemsize
    for n in where.shape:
        nbytes *= n
    return data[where.offset : where.offset + nbytes].view(dtype).view(where.shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
