"""The endpoint: one per process, hosting its rendezvous store and forming channels through it.

Failure model: every operation has a timeout. A failed or timed-out op
marks its channel broken and raises ``ChannelError``; the caller opens a
new channel (to the same or another peer) and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aetcd
import grpc
import torch
import torch.distributed as dist

from phalanx._proto import channel_pb2, channel_pb2_grpc
from phalanx.common.channels.channel import ChannelError, ChannelNotKeptError, TensorChannel, _check_channel_id, _describe, _is_timeout
from phalanx.common.channels.grpc_stream import (
    TensorStreamServicer,
    _await_hello,
    _GrpcReceiver,
    _GrpcSender,
    _Inboxes,
    _Pushed,
    _say_hello,
)
from phalanx.common.channels.process_group import _backend_for, _gpu_identity, _GroupChannel, _make_group
from phalanx.common.channels.rendezvous import _host_store, _lookup, _Rendezvous, channel_key
from phalanx.common.channels.threads import _DaemonPool, _in_thread
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import encode_json
from phalanx.common.lease import TRANSIENT_ERRORS, LeasedKey, connect_etcd
from phalanx.common.subjects import CHANNELS_PREFIX, validate_worker_id
from phalanx.common.tls import ServiceTls, process_tls

log = logging.getLogger(__name__)

# How long past its deadline open() waits for a rendezvous thread before giving up on it.
_OPEN_GRACE_S = 0.5
# How often an endpoint with etcd closes its idle kept channels whose peer is gone or that idled too long (see sweep):
# a dead peer's within two sweeps of its lease lapsing.
_SWEEP_S = 5.0
_SWEEP_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, TimeoutError)


class ChannelEndpoint:
    """One per process: the rendezvous store, its etcd advertisement, and the channels formed through it.

    Hosts a torch TCPStore on ``host`` (free port) and, given an EtcdConfig,
    advertises it (a ChannelEndpointAdvertisement, as JSON) at
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
        tls: ServiceTls | None | bool = True,
        sweep_s: float = _SWEEP_S,
    ) -> None:
        """``tls``: True for the process's mutual-TLS identity (``phalanx.common.tls.process_tls()``), a ServiceTls for
        that one, None or False for none; with one, openers sign their rendezvous claims and accepts check them."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if idle_channel_s <= 0 or max_idle_channels < 0 or sweep_s <= 0:
            raise ValueError("idle_channel_s and sweep_s must be positive and max_idle_channels at least 0")
        self.endpoint_id = validate_worker_id(endpoint_id)
        self._etcd_config = etcd_config
        self._host = host
        self._timeout_s = timeout_s
        self._grpc_address = grpc_address
        self._pool = _DaemonPool(f"channels-{endpoint_id}")
        self._store: dist.TCPStore | None = None
        self._rendezvous = _Rendezvous(self.endpoint_id, timeout_s, tls=process_tls() if tls is True else (tls or None))
        self._gloo_device: Any = None
        self._lease: LeasedKey | None = None
        self._etcd: aetcd.Client | None = None
        self._channels: set[TensorChannel] = set()
        self._accepting: set[str] = set()
        self._inboxes = _Inboxes(self.endpoint_id)
        self._closing: asyncio.Future[None] | None = None
        # Formed channels parked between transfers (keep/reuse): key -> (parked at, channel), oldest first.
        self._idle: dict[str, tuple[float, TensorChannel]] = {}
        self._idle_channel_s = idle_channel_s
        self._max_idle_channels = max_idle_channels
        self._closing_idle: set[asyncio.Future[None]] = set()
        self._sweep_s = sweep_s
        self._sweeper: asyncio.Task[None] | None = None
        self._unadvertised: set[str] = set()  # kept channels' peers missing from etcd at the last sweep

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
            self._lease = LeasedKey(self._etcd_config, channel_key(self.endpoint_id), encode_json(self.advertisement))
            try:
                await self._lease.start()
            except BaseException:
                await self.close()
                raise
            self._sweeper = asyncio.create_task(self._sweep_forever(), name=f"channels-{self.endpoint_id}-sweep")
        log.info("channel endpoint %s serves its store at %s:%d", self.endpoint_id, *self.store_address)

    async def close(self) -> None:
        """Close every channel and the store, and remove the advertisement. Idempotent."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self._idle.clear()  # each is in _channels too
        channels, self._channels = list(self._channels), set()
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
        await self._inboxes.fail_all("the endpoint closed")
        if self._lease is not None:
            await self._lease.close()
        if self._etcd is not None:
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self._etcd.close()
        # Dropping the master TCPStore stops its server.
        self._store = None
        self._rendezvous.forget_clients()
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
    def advertisement(self) -> channel_pb2.ChannelEndpointAdvertisement:
        """What this endpoint puts in etcd."""
        nccl = torch.cuda.is_available() and dist.is_nccl_available()
        return channel_pb2.ChannelEndpointAdvertisement(
            host=self._host,
            port=self.store_address[1],
            pid=os.getpid(),
            backend=channel_pb2.CHANNEL_BACKEND_NCCL if nccl else channel_pb2.CHANNEL_BACKEND_GLOO,
            grpc_address=self._grpc_address,
        )

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
        address = channel.store_address
        if address is not None and not any(c.store_address == address for c in self._channels):
            # The client's socket would outlive a dead peer (CLOSE-WAIT, one per worker a store ever restored into); the
            # next open to that store connects again, a millisecond.
            self._rendezvous.forget_client_at(address)

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

    async def sweep(self) -> int:
        """Close the kept channels idle past ``idle_channel_s`` and those whose peer was not advertised in etcd at
        this sweep and the last (it died: its lease lapsed); the number closed.

        Without it a kept channel to a dead peer lived until the next keep or reuse here, which a quiet endpoint may
        never make: each held its sockets (gloo's pair, the rendezvous client) in CLOSE-WAIT, one set per peer that
        died (a checkpoint store after each worker it had restored into was killed).
        """
        before = len(self._idle)
        self._close_stale()
        kept_peers = {channel.peer for _, channel in self._idle.values() if isinstance(channel, _GroupChannel)}
        if kept_peers and self._etcd_config is not None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    listed = await self._etcd_client(self._etcd_config).get_prefix(CHANNELS_PREFIX.encode())
            except _SWEEP_ERRORS as error:
                log.debug("endpoint %s: cannot list the channel endpoints to sweep: %s", self.endpoint_id, error)
            else:
                advertised = {kv.key.decode().removeprefix(CHANNELS_PREFIX) for kv in listed.kvs}
                # Gone at two sweeps in a row: a peer re-registering after an etcd restart is missing only briefly.
                gone = (kept_peers - advertised) & self._unadvertised
                self._unadvertised = kept_peers - advertised
                for key in [k for k, (_, c) in self._idle.items() if isinstance(c, _GroupChannel) and c.peer in gone]:
                    self._close_idle(self._idle.pop(key)[1])
        closed = before - len(self._idle)
        if closed:
            log.debug("endpoint %s closed %d idle channels (stale, or their peer is gone)", self.endpoint_id, closed)
        return closed

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            try:
                await self.sweep()
            except Exception:  # one failed sweep must not end the sweeping: the next tries again
                log.warning("endpoint %s: sweeping its idle channels failed", self.endpoint_id, exc_info=True)

    def _close_stale(self) -> None:
        oldest = time.monotonic() - self._idle_channel_s
        for key in [k for k, (parked, _) in self._idle.items() if parked < oldest]:
            self._close_idle(self._idle.pop(key)[1])

    def _close_idle(self, channel: TensorChannel) -> None:
        closing = asyncio.ensure_future(channel.close())
        self._closing_idle.add(closing)
        closing.add_done_callback(self._closing_idle.discard)

    # --- discovery --------------------------------------------------------------------------------
    async def lookup(self, peer_endpoint_id: str, *, timeout_s: float | None = None) -> channel_pb2.ChannelEndpointAdvertisement:
        """The advertisement of ``peer_endpoint_id`` from etcd; ChannelError if it is absent or etcd is away."""
        if self._etcd_config is None:
            raise ChannelError(f"cannot look up {peer_endpoint_id!r}: this endpoint has no etcd config", peer=peer_endpoint_id)
        return await _lookup(self._etcd_client(self._etcd_config), peer_endpoint_id, self._op_timeout(timeout_s))

    def _etcd_client(self, config: EtcdConfig) -> aetcd.Client:
        """The endpoint's etcd client, made on first use (lookups and sweeps share it)."""
        if self._etcd is None:
            self._etcd = connect_etcd(config)
        return self._etcd

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
            address = (advert.host, advert.port)
        backend = _backend_for(device)
        form = partial(_make_group, device=torch.device(device), deadline=deadline, gloo_device=self._gloo_device)
        join = partial(self._rendezvous.join_as_opener, address, channel_id, backend, deadline, form, _gpu_identity(device))
        # A hung peer store can hold one of its ops past the deadline: do not wait for it.
        limit = asyncio.timeout(max(0.001, deadline - time.monotonic()) + _OPEN_GRACE_S)
        try:
            async with limit:
                group, store, backend = await _in_thread(self._pool, join)
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
                store_address=address,
            )
        )

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
        deadline = time.monotonic() + timeout
        form = partial(_make_group, device=torch.device(device), deadline=deadline, gloo_device=self._gloo_device)
        join = partial(self._rendezvous.join_as_acceptor, self._store, channel_id, backend, deadline, form, _gpu_identity(device))
        self._accepting.add(channel_id)
        try:
            group, store, peer, backend = await _in_thread(self._pool, join)
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
        )

    def _adopt(self, channel: TensorChannel) -> TensorChannel:
        if self._closing is not None:  # closed while the channel formed
            asyncio.ensure_future(channel.close())
            raise channel._error("the endpoint closed")
        self._channels.add(channel)
        log.debug("channel %r with %r formed (%s)", channel.channel_id, channel.peer, channel.backend)
        return channel

    # --- gRPC fallback ----------------------------------------------------------------------------
    def add_grpc_service(self, server: grpc.aio.Server) -> None:
        """Register the TensorStream servicer (the fallback receiver) on ``server``."""
        channel_pb2_grpc.add_TensorStreamServicer_to_server(TensorStreamServicer(self), server)

    async def open_grpc(self, peer_grpc_address: str, channel_id: str, *, timeout_s: float | None = None) -> TensorChannel:
        """Sending side of a gRPC channel to the endpoint serving TensorStream at ``peer_grpc_address``."""
        self._check_started()
        _check_channel_id(channel_id)
        timeout = self._op_timeout(timeout_s)
        grpc_channel = await _say_hello(self.endpoint_id, peer_grpc_address, channel_id, timeout)
        return self._adopt(_GrpcSender(self, channel_id, peer_grpc_address, grpc_channel))

    async def accept_grpc(self, channel_id: str, *, timeout_s: float | None = None) -> TensorChannel:
        """Receiving side of a gRPC channel: waits for the peer's ``open_grpc`` hello; ChannelError at the timeout."""
        self._check_started()
        _check_channel_id(channel_id)
        timeout = self._op_timeout(timeout_s)
        inbox, opener = await _await_hello(self._inboxes, self.endpoint_id, channel_id, timeout)
        return self._adopt(_GrpcReceiver(self, channel_id, opener, self._inboxes, inbox))

    async def _deliver(self, channel_id: str, message: int, pushed: _Pushed) -> tuple[grpc.StatusCode, str] | None:
        """Hand a received Push to its channel; the status to answer with if it is refused."""
        if self._closing is not None:
            return grpc.StatusCode.UNAVAILABLE, f"endpoint {self.endpoint_id!r} is closed"
        return await self._inboxes.deliver(channel_id, message, pushed)

