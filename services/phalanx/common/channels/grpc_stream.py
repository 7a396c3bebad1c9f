"""The gRPC byte-stream fallback: tensors over ``TensorStream.Push``, for pairs where a process group cannot form.

Each tensor is one client stream of 1 MiB chunks. It is also the baseline
the channels are measured against (``phalanx.bench.channel``). A gRPC
channel is one-way: the ``open_grpc`` side sends, the ``accept_grpc`` side
receives.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch

from phalanx._proto import channel_pb2, channel_pb2_grpc
from phalanx.common.channels.channel import ChannelError, TensorChannel, _nbytes
from phalanx.common.tls import open_channel

if TYPE_CHECKING:
    from phalanx.common.channels.endpoint import ChannelEndpoint

# One gRPC message per MiB: whole large messages crawl (MEASURED: 0.35 GB/s for 64 MiB).
CHUNK_BYTES = 1 << 20
# Tensors pushed over gRPC but not yet received, per channel: beyond it Push is refused.
_MAX_UNREAD_MESSAGES = 64
# Handshake chunk of a gRPC channel: message 0, data = the opener's name.
_HELLO = 0
# Call metadata of a Push: which channel and message it carries, known before its first chunk.
_CHANNEL_HEADER = "phalanx-channel-id"
_MESSAGE_HEADER = "phalanx-channel-message"


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without a copy (numpy is no dependency)."""
    size = _nbytes(tensor)
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Pushed:
    """One tensor received over gRPC: its chunks, kept as they came (copied once, into the receiver's tensor)."""

    total: int
    dtype: str
    shape: tuple[int, ...]
    chunks: list[bytes] = field(default_factory=list)


class _Inbox:
    """What Push delivered for one channel id, waiting for accept_grpc / recv_into."""

    def __init__(self) -> None:
        self.opener: str | None = None
        self.accepted = False
        self.messages: dict[int, _Pushed] = {}
        self.failure: str | None = None
        self.changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

class _Inboxes:
    """One endpoint's inboxes, by channel id: what Push delivered, until its receiver takes it."""

    def __init__(self, endpoint_id: str) -> None:
        self._endpoint_id = endpoint_id
        self._by_id: dict[str, _Inbox] = {}

    def accepting(self, channel_id: str) -> _Inbox:
        """The inbox ``accept_grpc`` waits on; ValueError if one already does."""
        inbox = self._by_id.setdefault(channel_id, _Inbox())
        if inbox.accepted:
            raise ValueError(f"gRPC channel {channel_id!r} is already accepted on {self._endpoint_id!r}")
        inbox.accepted = True
        return inbox

    def drop(self, channel_id: str, inbox: _Inbox) -> None:
        if self._by_id.get(channel_id) is inbox:
            del self._by_id[channel_id]

    async def fail(self, channel_id: str, why: str) -> None:
        inbox = self._by_id.get(channel_id)
        if inbox is not None and inbox.failure is None:
            inbox.failure = why
            await inbox.notify()

    async def fail_all(self, why: str) -> None:
        """Fail every receiver and forget every inbox (the endpoint closes)."""
        for channel_id in list(self._by_id):
            await self.fail(channel_id, why)
        self._by_id.clear()

    async def deliver(self, channel_id: str, message: int, pushed: _Pushed) -> tuple[grpc.StatusCode, str] | None:
        """Hand a received Push to its channel; the status to answer with if it is refused."""
        if message == _HELLO:
            inbox = self._by_id.get(channel_id)
            if inbox is not None and inbox.opener is not None:
                return grpc.StatusCode.ALREADY_EXISTS, f"channel {channel_id!r} is open already"
            inbox = self._by_id.setdefault(channel_id, _Inbox())
            inbox.opener = b"".join(pushed.chunks).decode(errors="replace")
        else:
            inbox = self._by_id.get(channel_id)
            if inbox is None or inbox.opener is None or inbox.failure is not None:
                return grpc.StatusCode.FAILED_PRECONDITION, f"channel {channel_id!r} is not open here"
            if len(inbox.messages) >= _MAX_UNREAD_MESSAGES:
                return grpc.StatusCode.RESOURCE_EXHAUSTED, f"channel {channel_id!r} has {_MAX_UNREAD_MESSAGES} unread tensors"
            if message in inbox.messages:
                return grpc.StatusCode.ALREADY_EXISTS, f"message {message} of {channel_id!r} was delivered already"
            inbox.messages[message] = pushed
        await inbox.notify()
        return None


async def _say_hello(endpoint_id: str, peer_grpc_address: str, channel_id: str, timeout: float) -> grpc.aio.Channel:
    """The connection of a new sending side, once the peer took its hello; ChannelError if it did not."""
    grpc_channel = open_channel(peer_grpc_address)
    hello = channel_pb2.PushRequest(
        channel_id=channel_id, message=_HELLO, total_bytes=len(endpoint_id.encode()), data=endpoint_id.encode()
    )
    try:
        await channel_pb2_grpc.TensorStreamStub(grpc_channel).Push(iter([hello]), timeout=timeout)
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
        await grpc_channel.close()
        if isinstance(error, asyncio.CancelledError):
            raise
        raise ChannelError(
            f"cannot open gRPC channel {channel_id!r} to {peer_grpc_address}: {error.code().name} {error.details()}",
            channel_id=channel_id,
            peer=peer_grpc_address,
        ) from error
    return grpc_channel


async def _await_hello(inboxes: _Inboxes, endpoint_id: str, channel_id: str, timeout: float) -> tuple[_Inbox, str]:
    """The inbox of a new receiving side and the opener's name, once its hello came; ChannelError at the timeout."""
    inbox = inboxes.accepting(channel_id)
    try:
        async with asyncio.timeout(timeout), inbox.changed:
            await inbox.changed.wait_for(lambda: inbox.opener is not None or inbox.failure is not None)
    except TimeoutError as error:
        inboxes.drop(channel_id, inbox)
        raise ChannelError(
            f"cannot accept gRPC channel {channel_id!r} on {endpoint_id!r}: no peer opened it within {timeout:g} s",
            channel_id=channel_id,
        ) from error
    except BaseException:
        inboxes.drop(channel_id, inbox)
        raise
    if inbox.failure is not None or inbox.opener is None:
        inboxes.drop(channel_id, inbox)
        raise ChannelError(f"cannot accept gRPC channel {channel_id!r}: {inbox.failure}", channel_id=channel_id)
    return inbox, inbox.opener


class _GrpcSender(TensorChannel):
    """Sending side of a gRPC channel: each tensor is one Push stream of 1 MiB chunks."""

    backend = "grpc"
    _directions = frozenset({"send"})

    def __init__(self, endpoint: ChannelEndpoint, channel_id: str, peer: str, grpc_channel: grpc.aio.Channel) -> None:
        super().__init__(endpoint, channel_id, peer)
        self._grpc_channel = grpc_channel
        self._stub = channel_pb2_grpc.TensorStreamStub(grpc_channel)
        self._sent = 1  # message 0 was the hello

    async def _send(self, tensor: torch.Tensor, sequence: int, timeout: float) -> None:
        wire = tensor.to("cpu").contiguous()
        metadata = ((_CHANNEL_HEADER, self.channel_id), (_MESSAGE_HEADER, str(sequence)))
        await self._stub.Push(_chunks(self.channel_id, sequence, wire), timeout=timeout, metadata=metadata)

    async def _release(self) -> None:
        await self._grpc_channel.close()


class _GrpcReceiver(TensorChannel):
    """Receiving side of a gRPC channel: reads what TensorStreamServicer delivered for its id."""

    backend = "grpc"
    _directions = frozenset({"recv"})

    def __init__(self, endpoint: ChannelEndpoint, channel_id: str, peer: str, inboxes: _Inboxes, inbox: _Inbox) -> None:
        super().__init__(endpoint, channel_id, peer)
        self._inboxes = inboxes
        self._inbox = inbox
        self._received = 1  # message 0 was the hello

    async def _recv_into(self, tensor: torch.Tensor, sequence: int, timeout: float) -> None:
        inbox = self._inbox
        async with asyncio.timeout(timeout), inbox.changed:
            await inbox.changed.wait_for(lambda: sequence in inbox.messages or inbox.failure is not None)
        pushed = inbox.messages.pop(sequence, None)
        if pushed is None:
            raise self._error(inbox.failure or "no message")
        if pushed.total != _nbytes(tensor):
            raise self._error(
                f"message {sequence} has {pushed.total} bytes ({pushed.dtype}{list(pushed.shape)}), "
                f"the receiving tensor {_nbytes(tensor)} ({_dtype_name(tensor.dtype)}{list(tensor.shape)})"
            )
        direct = tensor.is_contiguous() and tensor.device.type == "cpu"
        target = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
        view, offset = _byte_view(target), 0
        for chunk in pushed.chunks:
            view[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        if not direct:
            tensor.copy_(target)

    async def _release(self) -> None:
        await self._inboxes.fail(self.channel_id, "the channel was closed")
        self._inboxes.drop(self.channel_id, self._inbox)


def _chunks(channel_id: str, message: int, tensor: torch.Tensor) -> Iterator[channel_pb2.PushRequest]:
    view = _byte_view(tensor)
    total = len(view)
    yield channel_pb2.PushRequest(
        channel_id=channel_id,
        message=message,
        shape=list(tensor.shape),
        dtype=_dtype_name(tensor.dtype),
        total_bytes=total,
        data=bytes(view[:CHUNK_BYTES]),
    )
    for offset in range(CHUNK_BYTES, total, CHUNK_BYTES):
        yield channel_pb2.PushRequest(data=bytes(view[offset : offset + CHUNK_BYTES]))


class TensorStreamServicer(channel_pb2_grpc.TensorStreamServicer):
    """Receives Push streams into the endpoint's per-channel inboxes (the gRPC fallback receiver)."""

    def __init__(self, endpoint: ChannelEndpoint) -> None:
        self._endpoint = endpoint

    async def Push(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> channel_pb2.PushResponse:  # gRPC method name
        # The sender names channel and message in the call's metadata too: they arrive with the headers, so a sender
        # that dies before its first chunk gets here still fails the receiver at once.
        headers = dict(context.invocation_metadata() or ())
        channel_id, message = headers.get(_CHANNEL_HEADER, ""), int(headers.get(_MESSAGE_HEADER, _HELLO) or _HELLO)
        first: channel_pb2.PushRequest | None = None
        pushed: _Pushed | None = None
        received = 0
        try:
            async for chunk in request_iterator:
                if first is None or pushed is None:  # set together, by the first chunk
                    first = chunk
                    channel_id, message = chunk.channel_id, chunk.message
                    pushed = _Pushed(chunk.total_bytes, chunk.dtype, tuple(chunk.shape))
                received += len(chunk.data)
                if received > first.total_bytes:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than total_bytes={first.total_bytes}")
                pushed.chunks.append(chunk.data)
        except asyncio.CancelledError:
            # The sender died or gave up mid-tensor: fail the receiver now rather than at its timeout.
            await self._broke_off(channel_id, message, received, first)
            raise
        if first is None or pushed is None:
            await self._broke_off(channel_id, message, received, first)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty push")
            raise AssertionError("context.abort raises")  # grpc is untyped here, so mypy cannot see that
        if received != first.total_bytes:
            # A sender cancelled mid-tensor can end the request stream like a half-close, with no CancelledError here.
            why = await self._broke_off(channel_id, message, received, first)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        refusal = await self._endpoint._deliver(first.channel_id, first.message, pushed)
        if refusal is not None:
            await context.abort(*refusal)
        return channel_pb2.PushResponse(bytes=received)

    async def _broke_off(self, channel_id: str, message: int, received: int, first: channel_pb2.PushRequest | None) -> str:
        """Fails the channel's receiver over a push that ended short; returns why."""
        total = f"{first.total_bytes}" if first is not None else "?"
        why = f"the push of message {message} broke off after {received} of {total} bytes"
        if channel_id and message != _HELLO:
            # Shielded: a second cancellation must not skip waking the receiver.
            await asyncio.shield(self._endpoint._inboxes.fail(channel_id, why))
        return why

