"""Errors of the encoder pool; media the caller must fix are INVALID_ARGUMENT, a full pool RESOURCE_EXHAUSTED."""

from __future__ import annotations

from phalanx.common.errors import InvalidRequestError, ResourceExhaustedError

__all__ = ["EncoderOverloadedError", "MediaError"]


class MediaError(InvalidRequestError):
    """Unsupported format, corrupt bytes, too large or too many frames: retrying the same media fails again."""

    reason = "INVALID_MEDIA"


class EncoderOverloadedError(ResourceExhaustedError):
    """The encoder's backlog is past its bound; retry after the hint (on another encoder, or later)."""

    reason = "ENCODER_OVERLOADED"
