"""The capture ring (worker/capture_ring.py): checkpoint KV placed in shared memory in capture order, freed as the
worker reports it sent, reset by a resync of every request, and a capture that does not fit left as it was."""

from __future__ import annotations

import pytest
import torch

from phalanx.worker.capture_ring import CaptureRing, RingSlice, ring_view
from phalanx.worker.checkpointing import _Capture, _Piece

pytestmark = pytest.mark.unit


def capture(*positions: int, fill: float = 1.0) -> _Capture:
    """A capture with one piece per entry, each [2 layers, 2, positions, 2 heads, 8] float32 (256 bytes a position)."""
    pieces = [
        _Piece(f"r{i}", 1, 0, n, torch.full((2, 2, n, 2, 8), fill + i) if n else None, None, [], b"", 0)
        for i, n in enumerate(positions)
    ]
    return _Capture(pieces, nbytes=sum(p.kv.nbytes for p in pieces if p.kv is not None))


def test_pieces_land_in_the_ring_as_slices_that_read_back_their_kv():
    ring = CaptureRing(torch.zeros(4096, dtype=torch.uint8))
    item = capture(3, 0, 2, fill=5.0)
    expected = [p.kv.clone() if p.kv is not None else None for p in item.pieces]
    assert ring.place(item)
    assert isinstance(item.pieces[0].kv, RingSlice) and item.pieces[1].kv is None and isinstance(item.pieces[2].kv, RingSlice)
    assert torch.equal(ring_view(ring.data, item.pieces[0].kv), expected[0])
    assert torch.equal(ring_view(ring.data, item.pieces[2].kv), expected[2])
    assert item.pieces[2].kv.offset == 768  # 3 x 256 bytes, on a 64-byte boundary
    assert ring.used == 768 + 512


def test_space_is_freed_in_capture_order_as_sent_and_reused_after_the_end():
    ring = CaptureRing(torch.zeros(4096, dtype=torch.uint8))
    first, second = capture(6), capture(6)  # 1,536 bytes each
    assert ring.place(first) and ring.place(second)
    third = capture(6, fill=9.0)
    assert not ring.place(third) and isinstance(third.pieces[0].kv, torch.Tensor)  # full: it crosses the old way
    ring.sent(first.nbytes)
    fourth = capture(6, fill=7.0)
    assert ring.place(fourth) and fourth.pieces[0].kv.offset == 0  # the end's 1,024 bytes skipped: wrapped
    assert torch.equal(ring_view(ring.data, fourth.pieces[0].kv), torch.full((2, 2, 6, 2, 8), 7.0))
    ring.sent(second.nbytes + third.nbytes)  # the one that did not fit counts in the bytes sent, and frees nothing
    assert ring.used == 1024 + 1536  # the fourth, and the end it skipped
    ring.sent(fourth.nbytes)
    assert ring.used == 0


def test_a_resync_of_every_request_frees_the_whole_ring():
    ring = CaptureRing(torch.zeros(4096, dtype=torch.uint8))
    assert ring.place(capture(8)) and ring.place(capture(4))
    ring.reset()
    assert ring.used == 0
    big = capture(16)  # 4,096 bytes: the whole ring
    assert ring.place(big)
    ring.sent(big.nbytes)
    assert ring.used == 0 and not ring.place(capture(17))  # larger than the ring: never placed
