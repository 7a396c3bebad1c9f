"""The tensor channel every transport implements: ordered sends and receives, timeouts, breaking on failure."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch

from phalanx.common.errors import NotFoundError, UnavailableError

if TYPE_CHECKING:
    from phalanx.common.channels.endpoint import ChannelEndpoint

log = logging.getLogger(__name__)

# Channel ids become a store-key segment and a gRPC field: no "/" (it would nest keys).
_CHANNEL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


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



class TensorChannel:
    """An ordered pipe of tensors between two endpoints (both ways, except over gRPC).

    The receiver passes a preallocated tensor whose size both sides agreed on
    out of band. Sends are serialized, and so are receives; the n-th send on
    one side pairs with the n-th receive on the other.
    """

    backend: str = ""
    # The peer store an opened process-group channel met its acceptor at; None for accepted and gRPC channels.
    store_address: tuple[str, int] | None = None
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

    def post_exchange(self, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor]) -> Any:
        """Blocking exchange for a thread other than the event loop's (see process_group._GroupChannel); gloo channels only."""
        raise RuntimeError(f"channel {self.channel_id!r} ({self.backend}) has no blocking exchange")

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

