"""A key that lives in etcd exactly as long as its owner: lease + one keepalive stream.

aetcd's ``Lease.refresh()`` opens a new LeaseKeepAlive stream for every beat
(~790 µs); here one bidirectional stream stays open and each beat is a
write + read on it (~200 µs). If the lease is lost (expired after a pause,
etcd restarted without its data) the key is re-granted and re-put with
capped backoff, so a worker never stays invisible after an etcd hiccup.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import time
from collections.abc import Callable

import aetcd
import aetcd.client as aetcd_client
import aetcd.exceptions
import aetcd.watcher as aetcd_watcher
import grpc
from aetcd import rpc

from phalanx.common.config import EtcdConfig
from phalanx.common.errors import PhalanxError

__all__ = [
    "EtcdPermissionDeniedError", "EtcdUnavailableError", "LeaseError", "LeasedKey", "connect_etcd", "etcd_target", "permission_denied",
    "tls_hint",
]

log = logging.getLogger(__name__)

# Errors that mean "etcd is away or slow", worth retrying; anything else is a bug.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError,
    grpc.aio.AioRpcError,
    ConnectionError,
    TimeoutError,
    OSError,
)


class LeaseError(PhalanxError):
    """Root of the lease errors."""


class EtcdUnavailableError(LeaseError, ConnectionError):
    """etcd did not answer (down, restarting, or partitioned)."""


class EtcdPermissionDeniedError(LeaseError, PermissionError):
    """etcd's authorization refused this client's identity the key: retrying will not help."""


def permission_denied(error: BaseException) -> bool:
    """Whether ``error`` (an aetcd error or the gRPC error under it) is etcd's PERMISSION_DENIED."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, grpc.aio.AioRpcError) and seen.code() == grpc.StatusCode.PERMISSION_DENIED:
            return True
        seen = seen.__cause__
    return "etcdserver: permission denied" in str(error)


def connect_etcd(config: EtcdConfig) -> aetcd.Client:
    """An aetcd client whose gRPC channel retries a lost etcd quickly and spreads over every member given.

    gRPC's default reconnect backoff grows to 120 s; after a long etcd outage
    that would keep every call failing for minutes after etcd is back.
    With several endpoints (a cluster) the channel balances round robin over
    the members it is connected to: a member that dies drops out of the
    picker as soon as its connection breaks, so new calls go to the others at
    once, and it is dialled again (same backoff) until it is back.
    """
    cap_ms = int(config.max_retry_wait_s * 1000)
    # Not grpc.min_reconnect_backoff_ms: gRPC core takes it as the minimum *connect timeout* (default 20 s), and at
    # 100 ms every connection attempt whose handshake took longer (a busy host, a slow link) was abandoned ("tcp
    # handshaker shutdown"), failing etcd calls with UNAVAILABLE while etcd was fine.
    options: dict[str, object] = {
        "grpc.initial_reconnect_backoff_ms": min(100, cap_ms),
        "grpc.max_reconnect_backoff_ms": cap_ms,
    }
    target = etcd_target(config)
    if len(config.endpoints) > 1:
        options["grpc.lb_policy_name"] = "round_robin"
    # aetcd dials f"{host}:{port}"; splitting the target at its last ':' gives back exactly this target.
    host, port = target.rsplit(":", 1)
    tls = config.tls()
    if tls is None:
        return aetcd.Client(host=host, port=int(port), timeout=config.request_timeout_s, options=options)
    # The certificate is checked against one name: the endpoint's host as given (a cluster's target lists resolved
    # addresses, which a certificate need not name), or the configured one.
    options["grpc.ssl_target_name_override"] = tls.server_name or config.host
    return _TlsEtcdClient(tls.grpc_credentials(), host=host, port=int(port), timeout=config.request_timeout_s, options=options)


class _TlsEtcdClient(aetcd.Client):
    """aetcd's client over a TLS channel: aetcd 1.x's ``connect`` opens only an insecure channel.

    ``connect`` is aetcd's own with the secure channel in its place (no username/password: Phalanx authenticates to
    etcd with the client certificate).
    """

    def __init__(self, credentials: grpc.ChannelCredentials, *, host: str, port: int, timeout: float, options: dict[str, object]) -> None:
        super().__init__(host=host, port=port, timeout=timeout, options=options)
        self._credentials = credentials

    @aetcd_client._handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # aetcd is untyped; another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials, options=list(self._options.items()))
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd_watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def tls_hint(config: EtcdConfig, error: BaseException) -> str:
    """What a failed etcd connection may say about TLS: a hint for the error message, or ""."""
    text = str(error)
    if permission_denied(error):
        return " (etcd's authorization refused the identity of this client's certificate, its CN: tenants' `client` " \
               "certificates get nothing from etcd, and each Phalanx service writes only its own keys; docs/security.md)"
    if config.tls() is None and "Socket closed" in text:
        return " (etcd closed the connection at once: if it serves TLS, set PHALANX_ETCD_TLS_DIR or PHALANX_ETCD_CA_FILE)"
    if config.tls() is not None and "handshake failed" in text.lower():
        return " (the TLS handshake with etcd failed: is PHALANX_ETCD_*'s CA the one that signed etcd's certificate, and the " \
               "client certificate one that etcd's --trusted-ca-file trusts?)"
    return ""


def etcd_target(config: EtcdConfig) -> str:
    """The gRPC target for ``config``'s endpoints: ``host:port`` for one, ``ipv4:a:p,b:p`` (or ipv6) for a cluster.

    gRPC's static multi-address schemes take IP literals only, so a cluster's
    host names are resolved here, once, when the client is made (IPv4
    addresses preferred where a name has both).
    """
    endpoints = config.endpoints
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    v4: list[str] = []
    v6: list[str] = []
    for host, port in endpoints:
        for address in _addresses(host, port):
            if address.version == 4:
                v4.append(f"{address}:{port}")
            else:
                v6.append(f"[{address}]:{port}")
    if v4:
        return "ipv4:" + ",".join(dict.fromkeys(v4))
    return "ipv6:" + ",".join(dict.fromkeys(v6))


def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    with contextlib.suppress(ValueError):
        return [ipaddress.ip_address(host)]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise EtcdUnavailableError(f"cannot resolve etcd member {host}: {error}") from error
    return [ipaddress.ip_address(info[4][0]) for info in infos]


class Backoff:
    """Capped exponential backoff with jitter (half to full of the current step)."""

    def __init__(self, initial: float, cap: float) -> None:
        self._initial = min(initial, cap)
        self._cap = cap
        self._step = self._initial

    def next(self) -> float:
        """The next delay; each call doubles the step up to the cap."""
        delay = random.uniform(self._step / 2, self._step)
        self._step = min(self._cap, self._step * 2)
        return delay

    def reset(self) -> None:
        """Start again from the initial delay (after a success)."""
        self._step = self._initial


async def await_cancelled(task: asyncio.Task[object]) -> None:
    """Cancel ``task`` and wait for it, re-raising only if *we* were cancelled meanwhile."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


class LeasedKey:
    """An etcd key bound to a lease that this object keeps alive until ``close()``.

    If the process dies, the keepalives stop and etcd deletes the key within
    ``lease_ttl_s`` (plus up to ~0.5 s of etcd's expiry sweep).
    """

    def __init__(self, config: EtcdConfig, key: str, value: bytes) -> None:
        self._config = config
        self._key = key.encode()
        self._value = value
        self._client = connect_etcd(config)
        self._lease_id: int | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._registrations = 0
        self._paused = False

    @property
    def key(self) -> str:
        """The etcd key."""
        return self._key.decode()

    @property
    def value(self) -> bytes:
        """The value last given (put now, or at the next re-registration)."""
        return self._value

    @property
    def lease_id(self) -> int | None:
        """ID of the current lease; None before start, after close, or while re-registering."""
        return self._lease_id

    @property
    def registrations(self) -> int:
        """How many times the key was put under a fresh lease (1 + re-registrations)."""
        return self._registrations

    async def start(self) -> None:
        """Grant a lease, put the key under it, and start the keepalive stream.

        Transient failures are retried for ``startup_timeout_s`` (an etcd that is
        still starting, or too busy to answer within a request's deadline);
        then EtcdUnavailableError: an etcd that never answers is usually a
        wrong endpoint, and the caller decides what that means.
        """
        if self._task is not None:
            return
        if self._closing is not None:
            raise LeaseError("LeasedKey was closed")
        deadline = time.monotonic() + self._config.startup_timeout_s
        backoff = Backoff(initial=0.1, cap=self._config.max_retry_wait_s)
        while True:
            try:
                await self._register()
                break
            except TRANSIENT_ERRORS as error:
                if permission_denied(error):
                    raise EtcdPermissionDeniedError(
                        f"cannot register {self.key} at {self._config.endpoint}: {error}{tls_hint(self._config, error)}"
                    ) from error
                delay = backoff.next()
                if time.monotonic() + delay > deadline:
                    raise EtcdUnavailableError(
                        f"cannot register {self.key} at {self._config.endpoint}: {error}{tls_hint(self._config, error)}"
                    ) from error
                log.warning("cannot register %s at %s yet (%s%s); retrying", self.key, self._config.endpoint, error, tls_hint(self._config, error))
                await asyncio.sleep(delay)
        self._task = asyncio.create_task(self._keepalive_forever(), name=f"lease-keepalive {self.key}")

    async def update(self, value: bytes) -> None:
        """Replace the value, keeping the lease.

        If etcd is away this raises EtcdUnavailableError, but the value is kept
        and written whenever the key is re-registered.
        """
        async with self._lock:
            self._value = value
            if self._lease_id is None:
                return
            try:
                await self._client.put(self._key, value, lease=self._lease_id)
            except TRANSIENT_ERRORS as error:
                raise EtcdUnavailableError(f"cannot update {self.key}: {error}") from error

    @property
    def paused(self) -> bool:
        """True between ``pause()`` and ``resume()``."""
        return self._paused

    async def pause(self) -> None:
        """Stop the keepalives without revoking: the key lapses after the TTL, as if this process hung.

        For fault injection. A no-op before ``start()``, after ``close()`` or when paused already.
        """
        if self._task is None or self._closing is not None or self._paused:
            return
        self._paused = True
        await await_cancelled(self._task)
        self._lease_id = None  # abandoned, not revoked

    def resume(self) -> None:
        """After ``pause()``: put the key again under a fresh lease (in the background) and keep it alive."""
        if not self._paused or self._closing is not None:
            return
        self._paused = False
        self._task = asyncio.create_task(self._keepalive_forever(), name=f"lease-keepalive {self.key}")

    async def close(self, revoke: bool = True) -> None:
        """Stop the keepalives; with ``revoke`` the key vanishes at once, else after the TTL.

        Idempotent; never raises for an unreachable etcd (the lease then just expires).
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(revoke))
        await asyncio.shield(self._closing)

    async def _close(self, revoke: bool) -> None:
        if self._task is not None:
            await await_cancelled(self._task)
        lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                await self._client.revoke_lease(lease_id)
            except TRANSIENT_ERRORS as error:
                log.warning(
                    "could not revoke the lease of %s (it expires in %s s): %s",
                    self.key,
                    self._config.lease_ttl_s,
                    error,
                )
        await self._client.close()

    async def __aenter__(self) -> LeasedKey:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _register(self) -> None:
        async with self._lock:
            lease = await self._client.lease(self._config.lease_ttl_s)
            try:
                await self._client.put(self._key, self._value, lease=lease.id)
            except BaseException:
                # Do not leave an orphan lease behind (it would expire anyway).
                await asyncio.shield(self._revoke_quietly(lease.id))
                raise
            self._lease_id = lease.id
            self._registrations += 1

    async def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await self._client.revoke_lease(lease_id)

    async def _keepalive_forever(self) -> None:
        backoff = Backoff(initial=0.05, cap=self._config.max_retry_wait_s)
        while True:
            try:
                if self._lease_id is None:
                    await self._register()
                    log.info("re-registered %s under lease %x", self.key, self._lease_id)
                await self._keepalive_stream(self._lease_id, backoff)
                log.warning("lease of %s was lost; re-registering", self.key)
                self._lease_id = None
            except TRANSIENT_ERRORS as error:
                delay = backoff.next()
                log.warning("etcd keepalive for %s failed (%s); retrying in %.2f s", self.key, error, delay)
                await asyncio.sleep(delay)
            except Exception:
                # A dead keepalive task makes the worker silently vanish from
                # routing; keep beating and make the bug loud instead.
                delay = backoff.next()
                log.exception("unexpected keepalive failure for %s; retrying in %.2f s", self.key, delay)
                await asyncio.sleep(delay)

    async def _keepalive_stream(self, lease_id: int | None, backoff: Backoff) -> None:
        """Beat on one LeaseKeepAlive stream; return when etcd says the lease is gone."""
        assert lease_id is not None
        await keepalive_stream(self._client, self._config, lease_id, on_confirmed=backoff.reset)


async def keepalive_stream(client: aetcd.Client, config: EtcdConfig, lease_id: int, *, on_confirmed: Callable[[], None]) -> None:
    """Beat on one LeaseKeepAlive stream, calling ``on_confirmed`` per live reply; return when etcd says the lease is gone.

    Raises a TRANSIENT_ERRORS error when the stream breaks or stalls; the caller decides whether to reopen it.
    """
    await client.connect()
    call = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
    interval = config.effective_keepalive_interval_s
    # A reply slower than half the TTL means the stream is stuck, not slow.
    reply_timeout = min(config.request_timeout_s, config.lease_ttl_s / 2)
    try:
        while True:
            async with asyncio.timeout(reply_timeout):
                try:
                    await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                except asyncio.InvalidStateError as error:
                    # grpc.aio reports a stream that etcd already ended this way.
                    raise ConnectionError("the keepalive stream ended") from error
                reply = await call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("etcd closed the keepalive stream")
            if reply.TTL <= 0:
                return
            on_confirmed()
            await asyncio.sleep(interval)
    finally:
        call.cancel()
