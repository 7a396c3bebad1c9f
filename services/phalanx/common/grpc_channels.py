"""gRPC channels to peers, one per address, kept between calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc

from phalanx.common.telemetry import grpc_client_interceptors
from phalanx.common.tls import open_channel

# Calls still running on a discarded channel get this long to finish before it closes under them.
_DISCARD_GRACE_S = 60.0


class GrpcChannels:
    """One channel per peer address, made at first use and kept (each new one costs a TCP and an HTTP/2 handshake).

    ``discard`` a peer after its calls failed for want of a connection: a kept
    channel to a restarted peer can sit in reconnect backoff, a new one
    connects at once.
    """

    def __init__(self, options: Sequence[tuple[str, object]] = (), *, traced: bool = True) -> None:
        self._options = list(options)
        self._traced = traced
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._discarded: dict[grpc.aio.Channel, asyncio.Future[None]] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            interceptors = grpc_client_interceptors() if self._traced else None
            channel = self._channels[address] = open_channel(address, options=self._options, interceptors=interceptors)
        return channel

    def discard(self, address: str) -> None:
        """The next ``get`` makes a new channel; calls in flight on the old one may finish first."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            closing = self._discarded[channel] = asyncio.ensure_future(channel.close(grace=_DISCARD_GRACE_S))
            closing.add_done_callback(lambda _f: self._discarded.pop(channel, None))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        discarded, self._discarded = dict(self._discarded), {}
        for closing in discarded.values():
            closing.cancel()
        for channel in [*channels, *discarded]:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)
