"""Tensor channels: ordered point-to-point tensor transfer between two processes (see ``endpoint``)."""

from phalanx.common.channels.endpoint import (
    CHUNK_BYTES,
    ChannelEndpoint,
    ChannelError,
    ChannelNotKeptError,
    TensorChannel,
    TensorStreamServicer,
    channel_key,
)

__all__ = [
    "CHUNK_BYTES",
    "ChannelEndpoint",
    "ChannelError",
    "ChannelNotKeptError",
    "TensorChannel",
    "TensorStreamServicer",
    "channel_key",
]
