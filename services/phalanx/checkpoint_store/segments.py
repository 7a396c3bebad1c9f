"""What a writer streams to the checkpoint store and what it is told back: the KV layout, the writer, the ack.

A segment's KV arrives as bytes; ``segment_tensor`` checks its range and byte count and views it as a tensor of the
writer's layout. The rules by which the store applies segments are in ``phalanx.checkpoint_store.store``.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import torch

from phalanx._proto import checkpoint_pb2
from phalanx.checkpoint_store.errors import InvalidCheckpointError
from phalanx.common.subjects import validate_request_id, validate_worker_id

__all__ = ["Ack", "KvLayout", "SegmentResult", "Writer", "segment_tensor"]


@dataclass(frozen=True)
class KvLayout:
    """Shape of one token position of KV: [num_layers, 2 (k, v), num_kv_heads, head_dim] of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_proto(cls, layout: checkpoint_pb2.KvLayout) -> KvLayout:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(layout, name) < 1:
                raise InvalidCheckpointError(f"layout.{name}", "must be at least 1")
        dtype = getattr(torch, layout.dtype, None) if layout.dtype else None
        if not isinstance(dtype, torch.dtype):
            raise InvalidCheckpointError("layout.dtype", f"{layout.dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype)

    def to_proto(self) -> checkpoint_pb2.KvLayout:
        return checkpoint_pb2.KvLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype_name
        )

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token position."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """[num_layers, 2, tokens, num_kv_heads, head_dim]: the layout of segments and restores."""
        return (self.num_layers, 2, tokens, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class Writer:
    """The worker behind one Stream, as its Hello described it."""

    worker_id: str
    layout: KvLayout
    model_version: str = ""

    @classmethod
    def from_hello(cls, hello: checkpoint_pb2.Hello) -> Writer:
        try:
            validate_worker_id(hello.worker_id)
        except ValueError as error:
            raise InvalidCheckpointError("hello.worker_id", str(error)) from None
        return cls(hello.worker_id, KvLayout.from_proto(hello.layout), hello.model_version)


class SegmentResult(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"
    CORRUPT = "corrupt"  # its KV fails its checksum: not applied, resync
    SUPERSEDED = "superseded"  # of a copy the commit moved away from: not applied, no resync


@dataclass(frozen=True)
class Ack:
    """What the store did with a segment, and the request's commit point afterwards."""

    request_id: str
    seq: int
    kv_tokens: int
    result: SegmentResult
    kv_bytes: int = 0  # of KV the segment carried, whatever became of it
    copy_id: int = 0  # the segment's (Segment.copy_id)

    @property
    def resync(self) -> bool:
        """True for a gap or a corrupt segment: the worker must send the request again from KV position 0."""
        return self.result in (SegmentResult.GAP, SegmentResult.CORRUPT)

    def to_proto(self) -> checkpoint_pb2.SegmentAck:
        return checkpoint_pb2.SegmentAck(request_id=self.request_id, seq=self.seq, kv_tokens=self.kv_tokens, resync=self.resync,
                                         superseded=self.result is SegmentResult.SUPERSEDED, copy_id=self.copy_id)


def segment_tensor(layout: KvLayout, segment: checkpoint_pb2.Segment, data: bytes) -> torch.Tensor:
    """The segment's KV (``data``, its ``kv``) as a [L, 2, t, H, D] view of those bytes, after checking the range and the byte count."""
    try:
        validate_request_id(segment.request_id)
    except ValueError as error:
        raise InvalidCheckpointError("segment.request_id", str(error)) from None
    if segment.kv_start < 0 or segment.kv_end < segment.kv_start:
        raise InvalidCheckpointError("segment.kv_end", f"[{segment.kv_start}, {segment.kv_end}) is not a range of KV positions")
    tokens = segment.kv_end - segment.kv_start
    if len(data) != tokens * layout.token_bytes:
        raise InvalidCheckpointError(
            "segment.kv", f"{len(data)} bytes for {tokens} positions of {layout.token_bytes} bytes each ({layout})"
        )
    if tokens == 0:
        return torch.empty(layout.shape(0), dtype=layout.dtype)
    with warnings.catch_warnings():
        # Read-only bytes: the tensor is only ever copied from, never written.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=layout.dtype)
    return flat.view(layout.shape(tokens))
