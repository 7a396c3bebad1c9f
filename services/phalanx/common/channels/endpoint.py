"""Tensor channels: ordered point-to-point tensor transfer between two processes.

Each process runs one ``ChannelEndpoint``. It hosts a torch ``TCPStore`` as
its rendezvous point and advertises that store in etcd under a lease
(``/phalanx/v1/channels/<endpoint id>``), so a peer that dies disappears
from discovery within the lease TTL. A channel is a standalone 2-rank
process group for one pair and one ``channel_id`` alone (no
``init_process_group``, no global group): the opener (rank 0) joins the
acceptor's (rank 1) store under ``ch/<channel_id>/``. Groups form in a few
ms, so channels are cheap, and a dead pair never poisons the others.

Failure model: every operation has a timeout. A failed or timed-out op
marks its channel broken and raises ``ChannelError``; the caller opens a
new channel (to the same or another peer) and retries. A SIGKILLed peer
fails a pending op within tens of ms (gloo sees the socket close); a hung
peer fails it at the timeout.

The gRPC fallback carries the same tensors over ``TensorStream.Push``
(1 MiB chunks of one client stream per tensor) for pairs where a process
group cannot form; it is also the baseline the channels are measured
against (``phalanx.bench.channel``). A gRPC channel is one-way: the
``open_grpc`` side sends, the ``accept_grpc`` side receives.

Blocking torch calls run on daemon threads, never on the event loop. gloo
work has no completion callback, so a thread waits on each op: that costs
~0.1-0.2 ms per op (a 4-byte round trip takes ~0.5 ms against ~0.1 ms for
bare gloo) and nothing on bulk transfers. Batch small tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

import aetcd
import grpc
import torch
import torch.distributed as dist

from phalanx._proto import channel_pb2, channel_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.errors import NotFoundError, UnavailableError
from phalanx.common.lease import TRANSIENT_ERRORS, LeasedKey, connect_etcd
from phalanx.common.subjects import CHANNELS_PREFIX, validate_worker_id

__all__ = [
    "CHUNK_BYTES",
    "ChannelEndpoint",
    "ChannelError",
    "ChannelNotKeptError",
    "TensorChannel",
    "TensorStreamServicer",
    "channel_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# One gRPC message per MiB: whole large messages crawl (MEASURED: 0.35 GB/s for 64 MiB).
CHUNK_BYTES = 1 << 20
# Channel ids become a store-key segment and a gRPC field: no "/" (it would nest keys).
_CHANNEL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_OPENER_KEY = "opener"
# Set by the opener once its group formed: until then it may still read the
# rendezvous keys, so the acceptor deletes them only after seeing this.
_READY_KEY = "ready"
# gloo tags are C ints.
_TAG_MODULUS = 1 << 31
# Tensors pushed over gRPC but not yet received, per channel: beyond it Push is refused.
_MAX_UNREAD_MESSAGES = 64
# Handshake chunk of a gRPC channel: message 0, data = the opener's name.
_HELLO = 0
# Call metadata of a Push: which channel and message it carries, known before its first chunk.
_CHANNEL_HEADER = "phalanx-channel-id"
_MESSAGE_HEADER = "phalanx-channel-message"
# Rendezvous waits poll the store: fast at first (the peer is usually there), then every 5 ms.
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.005
# How long past its deadline open() waits for a rendezvous thread before giving up on it.
_OPEN_GRACE_S = 0.5


class ChannelError(UnavailableError):
    """A channel cannot carry tensors: its peer died or hung, an op timed out, or it was closed.

    Recoverable: open a new channel (to the same or another peer) and retry.
    """

    reason = "CHANNEL_BROKEN"

    def __init__(self, message: str, *, channel_id: str = "", peer: str = "") -> None:
        super().__init__(message)
        self.channel_id = channel_id
        self.peer = peer


class ChannelNotKeptError(NotFoundError):
    """``reuse`` found no idle channel under that key: never kept, closed idle, or the process restarted."""

    reason = "CHANNEL_NOT_KEPT"


def channel_key(endpoint_id: str) -> str:
    """etcd key of an endpoint's advertisement: ``/phalanx/v1/channels/<endpoint_id>``."""
    return CHANNELS_PREFIX + validate_worker_id(endpoint_id)


def _check_channel_id(channel_id: str) -> str:
    if not isinstance(channel_id, str) or not _CHANNEL_ID.fullmatch(channel_id):
        raise ValueError(f"invalid channel id {channel_id!r}: need 1-128 characters of [A-Za-z0-9_.:-]")
    return channel_id


def _describe(error: BaseException) -> str:
    """First line of a torch/gloo error, without its C++ source location and stack."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    # gloo appends advice ("This is typically caused by ..."): the first sentence says it.
    return text.split(". ")[0][:300]


def _is_timeout(error: BaseException) -> bool:
    if isinstance(error, TimeoutError):
        return True
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without a copy (numpy is no dependency)."""
    size = _nbytes(tensor)
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- blocking calls off the event loop ---------------------------------------------------------------


class _DaemonPool:
    """Runs blocking calls on reused daemon threads.

    Not a ThreadPoolExecutor: it joins its threads at interpreter exit, and a
    gloo wait on a closed channel only returns at its timeout, which would
    hold up exit by that long. Not ``asyncio.to_thread`` either: the default
    executor has cpu+4 threads, which a few pending receives would exhaust.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._shut = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name} is shut down")
            if self._idle > 0:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        self._queue.put(fn)

    def _work(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()
            fn = None  # drop what the call held before idling
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Idle threads exit now, busy ones after their current call."""
        with self._lock:
            self._shut = True
            count = self._threads
        for _ in range(count):
            self._queue.put(None)


def _settle(waiter: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    if waiter.done():  # already failed by close() or cancelled
        return
    result, error = outcome
    if error is None:
        waiter.set_result(result)
    else:
        waiter.set_exception(error)


async def _in_thread(pool: _DaemonPool, fn: Callable[[], T], waiters: set[asyncio.Future[Any]] | None = None) -> T:
    """Run ``fn`` on ``pool``; ``waiters`` lets a closing channel fail the await without waiting for the thread."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()
    # Only the worker holds ``fn`` (and the process group it may bind): the
    # last reference to a group must go on a worker, since its destructor
    # blocks for tens of ms (and it is what closes the peer's sockets).
    box = [fn]
    del fn

    def run() -> None:
        call = box.pop()
        try:
            outcome: tuple[Any, BaseException | None] = (call(), None)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            # Without the traceback, whose frames would keep the group alive as long as the error.
            outcome = (None, error.with_traceback(None))
        del call
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, waiter, outcome)

    pool.submit(run)
    if waiters is None:
        return await waiter
    waiters.add(waiter)
    try:
        return await waiter
    finally:
        waiters.discard(waiter)


# --- channels ---------------------------------------------------------------------------------------


class TensorChannel:
    """An ordered pipe of tensors between two endpoints (both ways, except over gRPC).

    The receiver passes a preallocated tensor whose size both sides agreed on
    out of band. Sends are serialized, and so are receives; the n-th send on
    one side pairs with the n-th receive on the other.
    """

    backend: str = ""
    _directions: frozenset[str] = frozenset({"send", "recv"})

    def __init__(self, endpoint: ChannelEndpoint, channel_id: str, peer: str) -> None:
        self.channel_id = channel_id
        self.peer = peer
        self._endpoint = endpoint
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self._sent = 0
        self._received = 0
        self._failure: str | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._waiters: set[asyncio.Future[Any]] = set()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._failure else "open"
        return f"<{type(self).__name__} {self.channel_id!r} peer={self.peer!r} backend={self.backend} {state}>"

    @property
    def broken(self) -> bool:
        """True once an op failed or the channel was closed: it carries no more tensors."""
        return self._failure is not None or self._closed

    @property
    def failure(self) -> str | None:
        """Why the channel broke (None while usable, or when merely closed)."""
        return self._failure

    async def send(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> None:
        """Send ``tensor`` (any device, dtype and layout); raises ChannelError on failure or timeout."""
        timeout = self._endpoint._op_timeout(timeout_s)
        self._check_direction("send")
        async with self._send_lock:
            self._check_usable()
            sequence = self._sent
            self._sent += 1
            await self._guard("send", self._send(tensor.detach(), sequence, timeout), timeout)

    async def recv_into(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> None:
        """Receive the next tensor into ``tensor`` (same byte size as the one sent); raises ChannelError."""
        timeout = self._endpoint._op_timeout(timeout_s)
        self._check_direction("recv")
        async with self._recv_lock:
            self._check_usable()
            sequence = self._received
            self._received += 1
            await self._guard("recv", self._recv_into(tensor, sequence, timeout), timeout)

    async def close(self) -> None:
        """Release the channel; the peer's pending and later ops fail with ChannelError. Idempotent."""
        if self._closing is None:
            self._closed = True
            for waiter in list(self._waiters):
                if not waiter.done():
                    waiter.set_exception(self._error("the channel was closed"))
            self._endpoint._forget(self)
            self._closing = asyncio.ensure_future(self._release())
        await asyncio.shield(self._closing)

    async def __aenter__(self) -> TensorChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- for subclasses --------------------------------------------------------------------------
    async def _send(self, tensor: torch.Tensor, sequence: int, timeout: float) -> None:
        raise NotImplementedError

    async def _recv_into(self, tensor: torch.Tensor, sequence: int, timeout: float) -> None:
        raise NotImplementedError

    async def _release(self) -> None:
        """Free the transport (called once, by close)."""

    def _on_broken(self) -> None:
        """Tell the peer at once (called once, when an op fails)."""

    # --- shared ---------------------------------------------------------------------------------
    def _error(self, what: str) -> ChannelError:
        return ChannelError(
            f"channel {self.channel_id!r} ({self.backend}) with {self.peer!r}: {what}", channel_id=self.channel_id, peer=self.peer
        )

    def _check_direction(self, op: str) -> None:
        """A one-way channel used the wrong way round is a bug in the caller: RuntimeError, the channel stays usable."""
        if op not in self._directions:
            raise RuntimeError(f"channel {self.channel_id!r} ({self.backend}) is one-way: it cannot {op} here")

    def _check_usable(self) -> None:
        if self._closed:
            raise self._error("the channel is closed")
        if self._failure is not None:
            raise self._error(f"the channel is broken ({self._failure})")

    def _break(self, why: str) -> None:
        if self._failure is None and not self._closed:
            self._failure = why
            log.warning("channel %r with %r broke: %s", self.channel_id, self.peer, why)
            self._on_broken()

    async def _guard(self, op: str, work: Any, timeout: float) -> None:
        try:
            await work
        except ChannelError as error:
            self._break(str(error))
            raise
        except asyncio.CancelledError:
            # The transfer's state is unknown now; the next op could pair with its remains.
            self._break(f"{op} was cancelled midway")
            raise
        except Exception as error:
            if self._closed:
                raise self._error("the channel was closed") from error
            if "closed by peer" in str(error) or "reset by peer" in str(error):
                why = f"{op} failed: the peer died or closed the channel ({_describe(error)})"
            elif _is_timeout(error):
                why = f"{op} timed out after {timeout:g} s (peer hung or not reading?)"
            else:
                why = f"{op} failed: {_describe(error)}"
            self._break(why)
            raise self._error(why) from error


class _GroupChannel(TensorChannel):
    """A channel over a 2-rank gloo (or NCCL) process group of its own."""

    def __init__(
        self,
        endpoint: ChannelEndpoint,
        channel_id: str,
        peer: str,
        *,
        group: Any,
        rank: int,
        backend: str,
        device: torch.device,
        store: dist.Store,
        accepted: bool,
    ) -> None:
        super().__init__(endpoint, channel_id, peer)
        self.backend = backend
        self._group = group
        self._rank = rank
        self._device = device
        self._store = store  # the groups hold it anyway; kept for clarity
        self.accepted = accepted
        self._dropping: asyncio.Future[None] | None = None

    def _wire_device(self) -> torch.device:
        return self._device if self.backend == "nccl" else torch.device("cpu")

    async def _send(self, tensor: torch.Tensor, sequence: int, timeout: float) -> None:
        wire = tensor.to(self._wire_device()).contiguous()
        if _nbytes(wire) > 0:
            await self._transfer("send", wire, sequence % _TAG_MODULUS, timeout)

    async def _recv_into(self, tensor: torch.Tensor, sequence: int, timeout: float) -> None:
        if _nbytes(tensor) == 0:
            return
        direct = tensor.is_contiguous() and tensor.device == self._wire_device()
        target = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype, device=self._wire_device())
        await self._transfer("recv", target, sequence % _TAG_MODULUS, timeout)
        if not direct:
            tensor.copy_(target)

    async def _transfer(self, op: str, tensor: torch.Tensor, tag: int, timeout: float) -> None:
        if self.backend == "nccl":
            # The first p2p op may create a communicator (blocking): all of it off the loop.
            await _in_thread(
                self._endpoint._pool, partial(_post_and_wait, self._live_group(), op, tensor, 1 - self._rank, tag, timeout), self._waiters
            )
            return
        # gloo only posts here (no blocking), so the transfer starts while the
        # waiting thread wakes up: one thread hop on the critical path, not two.
        work = _post(self._live_group(), op, tensor, 1 - self._rank, tag)
        await _in_thread(self._endpoint._pool, partial(_wait, work, timeout), self._waiters)

    def _live_group(self) -> Any:
        if self._group is None:
            raise self._error("the channel is released")
        return self._group

    async def _drop_group(self) -> None:
        """Let go of the group, on a worker thread (its destructor blocks for tens of ms).

        Destroying it closes its sockets, which fails the peer's pending ops at
        once (abort() does not, in gloo). An op still in flight here keeps it
        alive until that op ends (gloo closes the pair itself at a timeout).
        Awaited, so that a process exiting after close() never tears down
        while a destructor runs (std::terminate).
        """
        box, self._group = [self._group], None
        with contextlib.suppress(RuntimeError):  # the pool is shut down: the endpoint is closing
            await _in_thread(self._endpoint._pool, box.clear)

    def _on_broken(self) -> None:
        self._dropping = asyncio.ensure_future(self._drop_group())

    async def _release(self) -> None:
        if self._dropping is not None:
            await self._dropping
        else:
            await self._drop_group()


def _post(group: Any, op: str, tensor: torch.Tensor, peer_rank: int, tag: int) -> Any:
    return group.send([tensor], peer_rank, tag) if op == "send" else group.recv([tensor], peer_rank, tag)


def _wait(work: Any, timeout: float) -> None:
    work.wait(timedelta(seconds=timeout))


def _post_and_wait(group: Any, op: str, tensor: torch.Tensor, peer_rank: int, tag: int, timeout: float) -> None:
    _wait(_post(group, op, tensor, peer_rank, tag), timeout)
    torch.cuda.current_stream(tensor.device).synchronize()


def _store_prefix(channel_id: str) -> str:
    return f"ch/{channel_id}"


def _delete_keys(store: dist.Store, prefix: str) -> None:
    """Delete every key under ``prefix/`` of a TCPStore (best effort)."""
    try:
        for key in store.list_keys():
            if key.startswith(prefix + "/"):
                store.delete_key(key)
    except Exception as error:  # noqa: BLE001 - stale keys only slow a reuse of the id
        log.debug("could not delete the keys under %s: %s", prefix, _describe(error))


class _PollingStore(dist.Store):
    """One channel's rendezvous namespace (``ch/<channel_id>/``) on a shared TCPStore client; waits poll.

    Why not a TCPStore client (under a PrefixStore) per channel: c10d resolves
    the peer's name on every new connection (a reverse DNS query, where a
    resolver that drops queries stalls it 5 s), and a TCPStore client
    serializes its ops, so a blocking wait on a shared one would hold up every
    other rendezvous. Polling ``check()`` needs no blocking op: one client per
    peer store serves every channel, and ``deadline`` bounds every wait.
    """

    def __init__(self, client: dist.Store, channel_id: str, deadline: float) -> None:
        super().__init__()
        self._client = client
        self._prefix = _store_prefix(channel_id)
        self._deadline = deadline

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def set(self, key: str, value: Any) -> None:
        self._client.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._client.get(self._key(key))

    def check(self, keys: list[str]) -> bool:
        return self._client.check([self._key(key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout.total_seconds())
        delay = _POLL_FIRST_S
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out waiting for {keys} under {self._prefix}")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._client.add(self._key(key), amount)


def _listening_socket(host: str) -> socket.socket:
    """A socket bound to ``host`` on a free port, for the TCPStore server to take over.

    Its own listener would bind every interface, dual-stack: peers would then
    reach it on v4-mapped IPv6 addresses, whose names c10d looks up in DNS
    (/etc/hosts lists only the plain ones) on every connection.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except BaseException:
        listener.close()
        raise
    return listener


def _host_store(host: str, timeout: float) -> dist.TCPStore:
    listener = _listening_socket(host)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach()
    )


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

    def __init__(self, endpoint: ChannelEndpoint, channel_id: str, peer: str, inbox: _Inbox) -> None:
        super().__init__(endpoint, channel_id, peer)
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
        await self._endpoint._fail_inbox(self.channel_id, "the channel was closed")
        self._endpoint._drop_inbox(self.channel_id, self._inbox)


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

    async def Push(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> channel_pb2.PushResponse:  # noqa: N802
        # The sender names channel and message in the call's metadata too: they arrive with the headers, so a sender
        # that dies before its first chunk gets here still fails the receiver at once.
        headers = dict(context.invocation_metadata() or ())
        channel_id, message = headers.get(_CHANNEL_HEADER, ""), int(headers.get(_MESSAGE_HEADER, _HELLO) or _HELLO)
        first: channel_pb2.PushRequest | None = None
        pushed: _Pushed | None = None
        received = 0
        try:
            async for chunk in request_iterator:
                if first is None:
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
            await asyncio.shield(self._endpoint._fail_inbox(channel_id, why))
        return why


# --- the endpoint -----------------------------------------------------------------------------------


def _backend_for(device: str) -> str:
    if torch.device(device).type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


class ChannelEndpoint:
    """One per process: the rendezvous store, its etcd advertisement, and the channels formed through it.

    Hosts a torch TCPStore on ``host`` (free port) and, given an EtcdConfig,
    advertises ``{"host", "port", "grpc_address", "pid", "backend"}`` as JSON at
    ``/phalanx/v1/channels/<endpoint_id>`` under a lease. ``open`` (rank 0)
    joins a peer's store; ``accept`` (rank 1) waits on its own. A channel id
    names one channel per acceptor at a time; reuse it once both sides closed.
    """

    def __init__(
        self,
        endpoint_id: str,
        etcd_config: EtcdConfig | None = None,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 10.0,
        grpc_address: str = "",
        idle_channel_s: float = 60.0,
        max_idle_channels: int = 16,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if idle_channel_s <= 0 or max_idle_channels < 0:
            raise ValueError("idle_channel_s must be positive and max_idle_channels at least 0")
        self.endpoint_id = validate_worker_id(endpoint_id)
        self._etcd_config = etcd_config
        self._host = host
        self._timeout_s = timeout_s
        self._grpc_address = grpc_address
        self._pool = _DaemonPool(f"channels-{endpoint_id}")
        self._store: dist.TCPStore | None = None
        # One TCPStore client per peer store, shared by every channel opened to it.
        self._clients: dict[tuple[str, int], dist.TCPStore] = {}
        self._clients_lock = threading.Lock()
        self._gloo_device: Any = None
        self._lease: LeasedKey | None = None
        self._etcd: aetcd.Client | None = None
        self._channels: set[TensorChannel] = set()
        self._accepting: set[str] = set()
        self._inboxes: dict[str, _Inbox] = {}
        self._closing: asyncio.Future[None] | None = None
        # Formed channels parked between transfers (keep/reuse): key -> (parked at, channel), oldest first.
        self._idle: dict[str, tuple[float, TensorChannel]] = {}
        self._idle_channel_s = idle_channel_s
        self._max_idle_channels = max_idle_channels
        self._closing_idle: set[asyncio.Future[None]] = set()

    def __repr__(self) -> str:
        return f"<ChannelEndpoint {self.endpoint_id!r} store={self._store_address_or_none()}>"

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Host the store and advertise it; raises EtcdUnavailableError if etcd does not answer. Idempotent."""
        if self._closing is not None:
            raise ChannelError(f"endpoint {self.endpoint_id!r} is closed")
        if self._store is not None:
            return
        self._store = await _in_thread(self._pool, partial(_host_store, self._host, self._timeout_s))
        self._gloo_device = await _in_thread(self._pool, partial(dist.ProcessGroupGloo.create_device, hostname=self._host))
        if self._etcd_config is not None:
            self._lease = LeasedKey(self._etcd_config, channel_key(self.endpoint_id), json.dumps(self.advertisement).encode())
            try:
                await self._lease.start()
            except BaseException:
                await self.close()
                raise
        log.info("channel endpoint %s serves its store at %s:%d", self.endpoint_id, *self.store_address)

    async def close(self) -> None:
        """Close every channel and the store, and remove the advertisement. Idempotent."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._idle.clear()  # each is in _channels too
        channels, self._channels = list(self._channels), set()
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
        for channel_id in list(self._inboxes):
            await self._fail_inbox(channel_id, "the endpoint closed")
        self._inboxes.clear()
        if self._lease is not None:
            await self._lease.close()
        if self._etcd is not None:
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self._etcd.close()
        # Dropping the master TCPStore stops its server.
        self._store = None
        with self._clients_lock:
            self._clients.clear()
        self._gloo_device = None
        self._pool.shutdown()

    async def __aenter__(self) -> ChannelEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def store_address(self) -> tuple[str, int]:
        """(host, port) of this endpoint's rendezvous store; only after ``start()``."""
        address = self._store_address_or_none()
        if address is None:
            raise RuntimeError(f"endpoint {self.endpoint_id!r} is not started")
        return address

    def _store_address_or_none(self) -> tuple[str, int] | None:
        return None if self._store is None else (self._host, self._store.port)

    @property
    def advertisement(self) -> dict[str, Any]:
        """What this endpoint puts in etcd."""
        value: dict[str, Any] = {
            "host": self._host,
            "port": self.store_address[1],
            "pid": os.getpid(),
            "backend": "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo",
        }
        if self._grpc_address:
            value["grpc_address"] = self._grpc_address
        return value

    @property
    def channels(self) -> frozenset[TensorChannel]:
        """The channels open now (not yet closed)."""
        return frozenset(self._channels)

    def _op_timeout(self, timeout_s: float | None) -> float:
        timeout = self._timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError("timeout_s must be positive")
        return timeout

    def _check_started(self) -> None:
        if self._closing is not None:
            raise ChannelError(f"endpoint {self.endpoint_id!r} is closed")
        if self._store is None:
            raise RuntimeError(f"endpoint {self.endpoint_id!r} is not started")

    def _forget(self, channel: TensorChannel) -> None:
        self._channels.discard(channel)

    # --- reuse between transfers ------------------------------------------------------------------
    def keep(self, key: str, channel: TensorChannel) -> None:
        """Park ``channel`` idle under ``key`` for one later ``reuse``, instead of closing it.

        Forming a channel and tearing its group down cost milliseconds each, and
        a fresh TCP pair starts slow: peers that transfer again (a store and the
        workers it restores into) should keep theirs. Both ends must keep it, and
        stay in step: every send of one end matched by a receive of the other.
        A broken channel is closed instead; so is one idle past
        ``idle_channel_s``, and the longest idle beyond ``max_idle_channels``.
        """
        self._close_stale()
        previous = self._idle.pop(key, None)
        if previous is not None and previous[1] is not channel:
            self._close_idle(previous[1])
        if channel.broken or self._closing is not None:
            self._close_idle(channel)
            return
        self._idle[key] = (time.monotonic(), channel)
        while len(self._idle) > self._max_idle_channels:
            self._close_idle(self._idle.pop(next(iter(self._idle)))[1])

    def reuse(self, key: str) -> TensorChannel:
        """The channel kept under ``key``, now the caller's (keep it again, or close it); ChannelNotKeptError if none."""
        self._close_stale()
        kept = self._idle.pop(key, None)
        if kept is None or kept[1].broken:
            raise ChannelNotKeptError(f"endpoint {self.endpoint_id!r} keeps no channel {key!r} (closed idle, or never kept)")
        return kept[1]

    @contextlib.asynccontextmanager
    async def opened(
        self, peer_endpoint_id: str, channel_id: str, *, reuse: bool = False, timeout_s: float | None = None, device: str = "cpu"
    ) -> AsyncIterator[TensorChannel]:
        """Channel ``channel_id`` to the peer for one transfer, kept afterwards for the next (see ``keep``).

        ``reuse``: the one kept by an earlier block with the same peer and id
        (ChannelNotKeptError if there is none); else a new one (``open``). The
        block ending well keeps it again; raising closes it, since the two ends
        may be out of step.
        """
        key = f"opened/{peer_endpoint_id}/{channel_id}"
        channel = self.reuse(key) if reuse else await self.open(peer_endpoint_id, channel_id, timeout_s=timeout_s, device=device)
        try:
            yield channel
        except BaseException:
            await channel.close()
            raise
        self.keep(key, channel)

    def _close_stale(self) -> None:
        oldest = time.monotonic() - self._idle_channel_s
        for key in [k for k, (parked, _) in self._idle.items() if parked < oldest]:
            self._close_idle(self._idle.pop(key)[1])

    def _close_idle(self, channel: TensorChannel) -> None:
        closing = asyncio.ensure_future(channel.close())
        self._closing_idle.add(closing)
        closing.add_done_callback(self._closing_idle.discard)

    # --- discovery --------------------------------------------------------------------------------
    async def lookup(self, peer_endpoint_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The advertisement of ``peer_endpoint_id`` from etcd; ChannelError if it is absent or etcd is away."""
        key = channel_key(peer_endpoint_id)
        if self._etcd_config is None:
            raise ChannelError(f"cannot look up {peer_endpoint_id!r}: this endpoint has no etcd config", peer=peer_endpoint_id)
        if self._etcd is None:
            self._etcd = connect_etcd(self._etcd_config)
        try:
            async with asyncio.timeout(self._op_timeout(timeout_s)):
                stored = await self._etcd.get(key.encode())
        except TRANSIENT_ERRORS as error:
            raise ChannelError(f"cannot look up {key} in etcd: {error}", peer=peer_endpoint_id) from error
        if stored is None:
            raise ChannelError(f"endpoint {peer_endpoint_id!r} is not advertised (no {key}): dead or not started", peer=peer_endpoint_id)
        return json.loads(stored.value)

    # --- process-group channels -------------------------------------------------------------------
    async def open(
        self,
        peer_endpoint_id: str,
        channel_id: str,
        *,
        timeout_s: float | None = None,
        device: str = "cpu",
        address: tuple[str, int] | None = None,
    ) -> TensorChannel:
        """Form channel ``channel_id`` with the peer (rank 0): its store from etcd, or ``address``.

        Returns once the peer's ``accept`` joined; ChannelError if it did not
        within the timeout or the peer is not reachable.
        """
        self._check_started()
        _check_channel_id(channel_id)
        timeout = self._op_timeout(timeout_s)
        deadline = time.monotonic() + timeout
        if address is None:
            advert = await self.lookup(peer_endpoint_id, timeout_s=timeout)
            address = (advert["host"], int(advert["port"]))
        backend = _backend_for(device)
        join = partial(self._join_as_opener, address, channel_id, backend, torch.device(device), deadline)
        # A hung peer store can hold one of its ops past the deadline: do not wait for it.
        limit = asyncio.timeout(max(0.001, deadline - time.monotonic()) + _OPEN_GRACE_S)
        try:
            async with limit:
                group, store = await _in_thread(self._pool, join)
        except Exception as error:
            if limit.expired():
                why = f"its store did not answer within {timeout:g} s (hung?)"
            elif "trying to connect" in str(error):
                why = f"its store did not take a connection within {timeout:g} s (dead?)"
            elif _is_timeout(error):
                why = f"the peer did not accept it within {timeout:g} s"
            else:
                why = _describe(error)
            raise ChannelError(
                f"cannot open channel {channel_id!r} to {peer_endpoint_id!r} at {address[0]}:{address[1]}: {why}",
                channel_id=channel_id,
                peer=peer_endpoint_id,
            ) from error
        return self._adopt(
            _GroupChannel(
                self, channel_id, peer_endpoint_id,
                group=group, rank=0, backend=backend, device=torch.device(device), store=store, accepted=False,
            )
        )  # fmt: skip

    async def accept(self, channel_id: str, *, timeout_s: float | None = None, device: str = "cpu") -> TensorChannel:
        """Wait (rank 1) until a peer opens ``channel_id`` on this endpoint; ChannelError at the timeout."""
        self._check_started()
        _check_channel_id(channel_id)
        if channel_id in self._accepting or any(
            isinstance(c, _GroupChannel) and c.accepted and c.channel_id == channel_id for c in self._channels
        ):
            raise ValueError(f"channel {channel_id!r} is already accepted on {self.endpoint_id!r}")
        timeout = self._op_timeout(timeout_s)
        backend = _backend_for(device)
        assert self._store is not None
        join = partial(self._join_as_acceptor, self._store, channel_id, backend, torch.device(device), time.monotonic() + timeout)
        self._accepting.add(channel_id)
        try:
            group, store, peer = await _in_thread(self._pool, join)
        except Exception as error:
            why = f"no peer opened it within {timeout:g} s" if _is_timeout(error) else _describe(error)
            raise ChannelError(f"cannot accept channel {channel_id!r} on {self.endpoint_id!r}: {why}", channel_id=channel_id) from error
        finally:
            self._accepting.discard(channel_id)
        return self._adopt(
            _GroupChannel(
                self, channel_id, peer,
                group=group, rank=1, backend=backend, device=torch.device(device), store=store, accepted=True,
            )
        )  # fmt: skip

    def _adopt(self, channel: TensorChannel) -> TensorChannel:
        if self._closing is not None:  # closed while the channel formed
            asyncio.ensure_future(channel.close())
            raise channel._error("the endpoint closed")
        self._channels.add(channel)
        log.debug("channel %r with %r formed (%s)", channel.channel_id, channel.peer, channel.backend)
        return channel

    def _join_as_opener(
        self, address: tuple[str, int], channel_id: str, backend: str, device: torch.device, deadline: float
    ) -> tuple[Any, dist.Store]:
        opener = json.dumps({"endpoint": self.endpoint_id, "backend": backend})
        client = self._client_for(address, deadline)
        try:
            client.set(f"{_store_prefix(channel_id)}/{_OPENER_KEY}", opener)
        except Exception:
            # The cached connection is dead (the store restarted on the same address?): one fresh try.
            self._forget_client(address, client)
            client = self._client_for(address, deadline)
            client.set(f"{_store_prefix(channel_id)}/{_OPENER_KEY}", opener)
        store = _PollingStore(client, channel_id, deadline)
        try:
            group = self._make_group(store, 0, backend, device, deadline)
            store.set(_READY_KEY, "1")
        except BaseException:
            # Stale keys would make the next accept of this id join a group that is gone.
            _delete_keys(client, _store_prefix(channel_id))
            raise
        return group, store

    def _client_for(self, address: tuple[str, int], deadline: float) -> dist.TCPStore:
        with self._clients_lock:
            client = self._clients.get(address)
        if client is not None:
            return client
        timeout = timedelta(seconds=max(0.001, deadline - time.monotonic()))
        client = dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
        client.set_timeout(timedelta(seconds=self._timeout_s))
        with self._clients_lock:
            return self._clients.setdefault(address, client)

    def _forget_client(self, address: tuple[str, int], client: dist.TCPStore) -> None:
        with self._clients_lock:
            if self._clients.get(address) is client:
                del self._clients[address]

    def _join_as_acceptor(
        self, master: dist.TCPStore, channel_id: str, backend: str, device: torch.device, deadline: float
    ) -> tuple[Any, dist.Store, str]:
        store = _PollingStore(master, channel_id, deadline)
        try:
            store.wait([_OPENER_KEY])
            opener = json.loads(store.get(_OPENER_KEY))
            if opener["backend"] != backend:
                raise ChannelError(f"the peer {opener['endpoint']!r} opened it with {opener['backend']}, accepted with {backend}")
            group = self._make_group(store, 1, backend, device, deadline)
            store.wait([_READY_KEY])
        finally:
            # Joined (both sides are past the rendezvous) or failed: the keys are
            # no use any more, and stale ones would derail a reuse of the id.
            _delete_keys(master, _store_prefix(channel_id))
        return group, store, opener["endpoint"]

    def _make_group(self, store: dist.Store, rank: int, backend: str, device: torch.device, deadline: float) -> Any:
        timeout = timedelta(seconds=max(0.001, deadline - time.monotonic()))
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            options.global_ranks_in_group = [0, 1]
            options.group_name = f"phalanx-channel-{os.getpid()}-{id(store):x}"
            group = dist.ProcessGroupNCCL(store, rank, 2, options)
            # NCCL connects lazily; connect now so that open/accept mean "joined".
            group.eager_connect_single_device(device)
            return group
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [self._gloo_device]
        options._threads = 1  # send/recv do not use the group's worker threads
        return dist.ProcessGroupGloo(store, rank, 2, options)

    # --- gRPC fallback ----------------------------------------------------------------------------
    def add_grpc_service(self, server: grpc.aio.Server) -> None:
        """Register the TensorStream servicer (the fallback receiver) on ``server``."""
        channel_pb2_grpc.add_TensorStreamServicer_to_server(TensorStreamServicer(self), server)

    async def open_grpc(self, peer_grpc_address: str, channel_id: str, *, timeout_s: float | None = None) -> TensorChannel:
        """Sending side of a gRPC channel to the endpoint serving TensorStream at ``peer_grpc_address``."""
        self._check_started()
        _check_channel_id(channel_id)
        timeout = self._op_timeout(timeout_s)
        grpc_channel = grpc.aio.insecure_channel(peer_grpc_address)
        hello = channel_pb2.PushRequest(
            channel_id=channel_id, message=_HELLO, total_bytes=len(self.endpoint_id.encode()), data=self.endpoint_id.encode()
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
        return self._adopt(_GrpcSender(self, channel_id, peer_grpc_address, grpc_channel))

    async def accept_grpc(self, channel_id: str, *, timeout_s: float | None = None) -> TensorChannel:
        """Receiving side of a gRPC channel: waits for the peer's ``open_grpc`` hello; ChannelError at the timeout."""
        self._check_started()
        _check_channel_id(channel_id)
        timeout = self._op_timeout(timeout_s)
        inbox = self._inboxes.setdefault(channel_id, _Inbox())
        if inbox.accepted:
            raise ValueError(f"gRPC channel {channel_id!r} is already accepted on {self.endpoint_id!r}")
        inbox.accepted = True
        try:
            async with asyncio.timeout(timeout), inbox.changed:
                await inbox.changed.wait_for(lambda: inbox.opener is not None or inbox.failure is not None)
        except TimeoutError as error:
            self._drop_inbox(channel_id, inbox)
            raise ChannelError(
                f"cannot accept gRPC channel {channel_id!r} on {self.endpoint_id!r}: no peer opened it within {timeout:g} s",
                channel_id=channel_id,
            ) from error
        except BaseException:
            self._drop_inbox(channel_id, inbox)
            raise
        if inbox.failure is not None or inbox.opener is None:
            self._drop_inbox(channel_id, inbox)
            raise ChannelError(f"cannot accept gRPC channel {channel_id!r}: {inbox.failure}", channel_id=channel_id)
        return self._adopt(_GrpcReceiver(self, channel_id, inbox.opener, inbox))

    def _drop_inbox(self, channel_id: str, inbox: _Inbox) -> None:
        if self._inboxes.get(channel_id) is inbox:
            del self._inboxes[channel_id]

    async def _fail_inbox(self, channel_id: str, why: str) -> None:
        inbox = self._inboxes.get(channel_id)
        if inbox is not None and inbox.failure is None:
            inbox.failure = why
            await inbox.notify()

    async def _deliver(self, channel_id: str, message: int, pushed: _Pushed) -> tuple[grpc.StatusCode, str] | None:
        """Hand a received Push to its channel; the status to answer with if it is refused."""
        if self._closing is not None:
            return grpc.StatusCode.UNAVAILABLE, f"endpoint {self.endpoint_id!r} is closed"
        if message == _HELLO:
            inbox = self._inboxes.get(channel_id)
            if inbox is not None and inbox.opener is not None:
                return grpc.StatusCode.ALREADY_EXISTS, f"channel {channel_id!r} is open already"
            inbox = self._inboxes.setdefault(channel_id, _Inbox())
            inbox.opener = b"".join(pushed.chunks).decode(errors="replace")
        else:
            inbox = self._inboxes.get(channel_id)
            if inbox is None or inbox.opener is None or inbox.failure is not None:
                return grpc.StatusCode.FAILED_PRECONDITION, f"channel {channel_id!r} is not open here"
            if len(inbox.messages) >= _MAX_UNREAD_MESSAGES:
                return grpc.StatusCode.RESOURCE_EXHAUSTED, f"channel {channel_id!r} has {_MAX_UNREAD_MESSAGES} unread tensors"
            if message in inbox.messages:
                return grpc.StatusCode.ALREADY_EXISTS, f"message {message} of {channel_id!r} was delivered already"
            inbox.messages[message] = pushed
        await inbox.notify()
        return None
