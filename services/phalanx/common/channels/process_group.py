"""Process-group channels: each one a standalone 2-rank gloo (CPU) or NCCL (GPU) group of its own.

No ``init_process_group``, no global group: a group forms for one pair and
one channel id in a few ms (rendezvous.py), so channels are cheap, and a
dead pair never poisons the others. A SIGKILLed peer fails a pending op
within tens of ms (gloo sees the socket close); a hung peer fails it at the
timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.common.channels.channel import TensorChannel, _describe, _is_timeout, _nbytes
from phalanx.common.channels.threads import _in_thread

if TYPE_CHECKING:
    from phalanx.common.channels.endpoint import ChannelEndpoint

# gloo tags are C ints.
_TAG_MODULUS = 1 << 31


def _backend_for(device: str) -> str:
    if torch.device(device).type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _gpu_identity(device: str) -> str | None:
    """The UUID of ``device``'s GPU (None off CUDA): two ends on one GPU cannot form an NCCL group."""
    if torch.device(device).type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def _make_group(store: dist.Store, rank: int, backend: str, *, device: torch.device, deadline: float, gloo_device: Any) -> Any:
    """The 2-rank group of one channel, formed through its rendezvous ``store`` (blocking: call it on a thread)."""
    timeout = timedelta(seconds=max(0.001, deadline - time.monotonic()))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = [0, 1]
        # torch's stubs type it as GroupName, a NewType of str that torch.distributed does not export.
        options.group_name = f"phalanx-channel-{os.getpid()}-{id(store):x}"  # type: ignore[assignment]
        group = dist.ProcessGroupNCCL(store, rank, 2, options)
        # NCCL connects lazily; connect now so that open/accept mean "joined".
        group.eager_connect_single_device(device)
        return group
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, so torch's stubs omit it
    options._timeout = timeout
    options._devices = [gloo_device]
    options._threads = 1  # send/recv do not use the group's worker threads
    return dist.ProcessGroupGloo(store, rank, 2, options)


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
        store_address: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(endpoint, channel_id, peer)
        self.store_address = store_address  # the endpoint drops its client there with the last such channel
        self.backend = backend
        self._group = group
        self._rank = rank
        self._device = device
        self._store: dist.Store | None = store  # the group holds it too; both let go of it in _drop_group
        self.accepted = accepted
        self._dropping: asyncio.Future[None] | None = None

    def _wire_device(self) -> torch.device:
        # gloo moves host memory: CUDA tensors are staged through it (two ends on one GPU, see rendezvous.py).
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

    def post_exchange(self, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor]) -> PendingExchange:
        """Post sends, then receives, without the event loop; `wait` on the result from the calling thread.

        For a thread that must not hop through the event loop per tensor (an
        engine thread calling expert workers once per layer): each op is one
        gloo post and the waits cost no thread switch. The caller owns the
        channel meanwhile: no async op may be pending on it. CPU (gloo) only.
        """
        if self.backend != "gloo":
            raise RuntimeError(f"channel {self.channel_id!r}: blocking exchanges need gloo, not {self.backend}")
        self._check_usable()
        if not all(tensor.is_contiguous() for tensor in receives):
            raise ValueError("receive into contiguous tensors")
        group = self._live_group()
        works = []
        op = "send"
        try:
            for tensor in sends:
                wire = tensor.contiguous()
                works.append(("send", wire, _post(group, "send", wire, 1 - self._rank, self._sent % _TAG_MODULUS)))
                self._sent += 1
            op = "recv"
            for tensor in receives:
                works.append(("recv", tensor, _post(group, "recv", tensor, 1 - self._rank, self._received % _TAG_MODULUS)))
                self._received += 1
        except Exception as error:
            # gloo fails a post at once when the pair already saw the peer go (it died between two exchanges): the same
            # loss as a failed wait, so the same ChannelError, not a RuntimeError that would kill the caller's thread.
            why = _failure_reason(op, error, None)
            self._fail_from_thread(why)
            raise self._error(why) from error
        return PendingExchange(self, works)

    def _fail_from_thread(self, why: str) -> None:
        """Mark the channel broken off the event loop; its owner closes it from the loop (which drops the group)."""
        if self._failure is None and not self._closed:
            self._failure = why

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
        box, self._group, self._store = [self._group, self._store], None, None
        with contextlib.suppress(RuntimeError):  # the pool is shut down: the endpoint is closing
            await _in_thread(self._endpoint._pool, box.clear)

    def _on_broken(self) -> None:
        self._dropping = asyncio.ensure_future(self._drop_group())

    async def _release(self) -> None:
        if self._dropping is not None:
            await self._dropping
        else:
            await self._drop_group()


def _failure_reason(op: str, error: Exception, timeout_s: float | None) -> str:
    """Why a blocking op failed, in the words the async path (`TensorChannel._guard`) uses."""
    if "closed by peer" in str(error) or "reset by peer" in str(error):
        return f"{op} failed: the peer died or closed the channel ({_describe(error)})"
    if timeout_s is not None and _is_timeout(error):
        return f"{op} timed out after {timeout_s:g} s (peer hung or not reading?)"
    return f"{op} failed: {_describe(error)}"


def _post(group: Any, op: str, tensor: torch.Tensor, peer_rank: int, tag: int) -> Any:
    return group.send([tensor], peer_rank, tag) if op == "send" else group.recv([tensor], peer_rank, tag)


def _wait(work: Any, timeout: float) -> None:
    work.wait(timedelta(seconds=timeout))


def _post_and_wait(group: Any, op: str, tensor: torch.Tensor, peer_rank: int, tag: int, timeout: float) -> None:
    _wait(_post(group, op, tensor, peer_rank, tag), timeout)
    torch.cuda.current_stream(tensor.device).synchronize()


class PendingExchange:
    """The posted ops of one `post_exchange`; `wait` blocks the calling thread until all are done."""

    def __init__(self, channel: _GroupChannel, works: list[tuple[str, torch.Tensor, Any]]) -> None:
        self._channel = channel
        self._works = works  # each holds its tensor until it is done

    def wait(self, timeout_s: float) -> None:
        """Raises ChannelError (and the channel is broken) if an op fails or the whole exchange outlasts `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for op, _, work in self._works:
            try:
                _wait(work, max(0.001, deadline - time.monotonic()))
            except Exception as error:
                why = _failure_reason(op, error, timeout_s)
                self._channel._fail_from_thread(why)
                raise self._channel._error(why) from error
        self._works = []
