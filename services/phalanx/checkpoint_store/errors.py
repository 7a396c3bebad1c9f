"""The checkpoint store's errors: one root, and what the gRPC boundary maps each to (phalanx.common.errors)."""

from __future__ import annotations

from phalanx.common.errors import FailedPreconditionError, InvalidRequestError, NotFoundError, PhalanxError

__all__ = ["CheckpointStoreError", "CorruptCheckpointError", "InvalidCheckpointError", "NotCommittedError", "UnknownRequestError"]


class CheckpointStoreError(PhalanxError):
    """Root of the checkpoint store's errors."""

    reason = "CHECKPOINT_STORE_ERROR"


class InvalidCheckpointError(CheckpointStoreError, InvalidRequestError):
    """A Hello or Segment that breaks the protocol (bad layout, wrong byte count, reversed range)."""

    reason = "INVALID_CHECKPOINT"


class UnknownRequestError(CheckpointStoreError, NotFoundError):
    """The store holds no commit for this request (never streamed, released or expired)."""

    reason = "CHECKPOINT_NOT_FOUND"

    def __init__(self, request_id: str) -> None:
        super().__init__(f"the checkpoint store holds no commit of request {request_id!r}")
        self.request_id = request_id


class NotCommittedError(CheckpointStoreError, FailedPreconditionError):
    """More KV was asked for than is committed (the caller's view is ahead of the store's)."""

    reason = "KV_NOT_COMMITTED"

    def __init__(self, request_id: str, wanted: int, committed: int) -> None:
        super().__init__(
            f"request {request_id!r}: {wanted} KV tokens asked for, but only {committed} are committed in the checkpoint store",
            subject=request_id, metadata={"request_id": request_id, "wanted": str(wanted), "committed": str(committed)},
        )
        self.request_id = request_id
        self.wanted = wanted
        self.committed = committed


class CorruptCheckpointError(CheckpointStoreError, FailedPreconditionError):
    """KV held for a request no longer matches the checksums it was written with; it was dropped (re-prefill instead)."""

    reason = "CHECKPOINT_CORRUPT"

    def __init__(self, request_id: str, start: int, end: int) -> None:
        super().__init__(
            f"request {request_id!r}: the KV of positions [{start}, {end}) held in the checkpoint store fails its checksum; "
            "it was dropped: restore by re-prefill",
            subject=request_id, metadata={"request_id": request_id, "kv_start": str(start), "kv_end": str(end)},
        )
        self.request_id = request_id
