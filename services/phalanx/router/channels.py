"""The router's gRPC channels to its workers: one per worker address, kept a while after the worker leaves."""

from __future__ import annotations

import asyncio

import grpc

from phalanx._proto import worker_pb2_grpc
from phalanx.common.telemetry import grpc_client_interceptors
from phalanx.common.tls import open_channel
from phalanx.router.multiplex import WorkerMultiplexer

__all__ = ["WorkerChannels"]


class WorkerChannels:
    """One gRPC channel per worker address, with trace context propagation.

    Closing a channel cancels every call on it, so a worker that leaves etcd keeps its channel for `linger_s`:
    a live worker whose lease lapsed (etcd unreachable, an overloaded host) still streams its requests, and one
    that registers again reuses the channel. A dead worker's streams have broken on their own long before.
    """

    def __init__(self, max_message_bytes: int, *, linger_s: float = 30.0, multiplex: bool = True) -> None:
        self.linger_s = linger_s
        self.multiplex = multiplex
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
        ]
        self._channels: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._multiplexers: dict[str, WorkerMultiplexer] = {}
        self._retiring: dict[str, asyncio.TimerHandle] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        timer = self._retiring.pop(address, None)
        if timer is not None:
            timer.cancel()  # in use again (re-registered, or a resume on it)
        entry = self._channels.get(address)
        if entry is None:
            channel = open_channel(address, options=self._options, interceptors=grpc_client_interceptors())
            entry = self._channels[address] = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
        return entry[1]

    def streams(self, address: str) -> WorkerMultiplexer:
        """How requests' token streams are read from the worker at `address`: its multiplexed stream, or per-request calls."""
        stub = self.stub(address)
        multiplexer = self._multiplexers.get(address)
        if multiplexer is None or multiplexer.stub is not stub:
            multiplexer = self._multiplexers[address] = WorkerMultiplexer(stub, address, enabled=self.multiplex)
        return multiplexer

    def retire(self, address: str) -> None:
        """The worker left membership: close its channel after `linger_s` unless it is used again before."""
        if address in self._channels and address not in self._retiring:
            loop = asyncio.get_running_loop()
            self._retiring[address] = loop.call_later(self.linger_s, lambda: loop.create_task(self._close_retired(address)))

    async def _close_retired(self, address: str) -> None:
        if self._retiring.pop(address, None) is not None:
            await self.drop(address)

    async def drop(self, address: str) -> None:
        timer = self._retiring.pop(address, None)
        if timer is not None:
            timer.cancel()
        multiplexer = self._multiplexers.pop(address, None)
        if multiplexer is not None:
            await multiplexer.close()
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close(grace=None)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
