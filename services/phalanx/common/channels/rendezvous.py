"""Rendezvous: each endpoint hosts a TCPStore, advertised in etcd, where the two ends of a channel meet.

The opener (rank 0) joins the acceptor's (rank 1) store under
``ch/<channel_id>/``: it writes who it is, both form the channel's group
through that namespace, and the acceptor deletes the keys once the opener
says its group formed. An NCCL channel needs the two ends on different
GPUs (NCCL refuses two ranks of one communicator on one device: "Duplicate
GPU detected"), so for NCCL the opener also names its GPU, and the acceptor
says which backend both use: NCCL, or gloo staged through host memory when
they share a GPU. The advertisement (a ChannelEndpointAdvertisement,
proto3 JSON) lives under a lease (``/phalanx/v1/channels/<endpoint id>``),
so a peer that dies disappears from discovery within the lease TTL.

With mutual TLS on (``phalanx.common.tls``), the opener signs its claim
(channel id, its endpoint id, the time) with its certificate's key and sends
the certificate along; the acceptor forms the group only with an opener whose
certificate the CA issued to a Phalanx service (or admin). The TCPStore and
gloo/NCCL themselves stay unauthenticated and unencrypted (docs/security.md).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import aetcd
import torch.distributed as dist
from google.protobuf import json_format

from phalanx._proto import channel_pb2
from phalanx.common.channels.channel import ChannelError, _describe
from phalanx.common.discovery import decode_json
from phalanx.common.lease import TRANSIENT_ERRORS
from phalanx.common.subjects import CHANNELS_PREFIX, validate_worker_id
from phalanx.common.tls import SERVICE_IDENTITIES, ServiceTls

log = logging.getLogger(__name__)

_OPENER_KEY = "opener"
# Set by the opener once its group formed: until then it may still read the
# rendezvous keys, so the acceptor deletes them only after seeing this.
_READY_KEY = "ready"
# Set by the acceptor of an NCCL channel: the backend both ends form the group with.
_AGREED_KEY = "agreed"
# How far an opener's signed claim may be from the acceptor's clock (hosts' clocks differ a little).
_CLAIM_SKEW_S = 300.0
# Who may open a channel when TLS is on: the services, and an operator's tools.
_CHANNEL_PEERS = frozenset({*SERVICE_IDENTITIES, "admin"})

# Rendezvous waits poll the store: fast at first (the peer is usually there), then every 5 ms.
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.005

# Forms a channel's group through its rendezvous namespace, as the given rank, with the given backend (blocking).
FormGroup = Callable[[dist.Store, int, str], Any]


def agreed_backend(requested: str, opener_gpu: str | None, acceptor_gpu: str | None) -> str:
    """The backend of a channel both ends asked ``requested`` for: gloo instead of NCCL when they share one GPU."""
    if requested == "nccl" and opener_gpu is not None and opener_gpu == acceptor_gpu:
        return "gloo"
    return requested


def channel_key(endpoint_id: str) -> str:
    """etcd key of an endpoint's advertisement: ``/phalanx/v1/channels/<endpoint_id>``."""
    return CHANNELS_PREFIX + validate_worker_id(endpoint_id)


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



async def _lookup(etcd: aetcd.Client, peer_endpoint_id: str, timeout: float) -> channel_pb2.ChannelEndpointAdvertisement:
    """The advertisement of ``peer_endpoint_id``; ChannelError if it is absent or etcd is away."""
    key = channel_key(peer_endpoint_id)
    try:
        async with asyncio.timeout(timeout):
            stored = await etcd.get(key.encode())
    except TRANSIENT_ERRORS as error:
        raise ChannelError(f"cannot look up {key} in etcd: {error}", peer=peer_endpoint_id) from error
    if stored is None:
        raise ChannelError(f"endpoint {peer_endpoint_id!r} is not advertised (no {key}): dead or not started", peer=peer_endpoint_id)
    try:
        return decode_json(stored.value, channel_pb2.ChannelEndpointAdvertisement)
    except json_format.ParseError as error:
        raise ChannelError(f"the advertisement at {key} is unreadable: {error}", peer=peer_endpoint_id) from error


def _claim_payload(channel_id: str, endpoint: str, at: float) -> bytes:
    return f"phalanx-channel-rendezvous\n{channel_id}\n{endpoint}\n{at!r}".encode()


def sign_claim(tls: ServiceTls, claim: dict[str, Any], channel_id: str) -> dict[str, Any]:
    """``claim`` with the time, this identity's certificate and its signature over (channel id, endpoint, time)."""
    at = time.time()
    signature = tls.sign(_claim_payload(channel_id, claim["endpoint"], at))
    return {**claim, "at": at, "cert": tls.certificate.decode(), "sig": base64.b64encode(signature).decode()}


def check_claim(tls: ServiceTls, claim: dict[str, Any], channel_id: str) -> str:
    """The identity of the opener that signed ``claim`` for ``channel_id``; ChannelError if it cannot be trusted."""
    endpoint = claim.get("endpoint", "?")
    try:
        if "sig" not in claim or "cert" not in claim:
            raise ValueError("it presented no certificate (TLS is off on its side?)")
        at = float(claim["at"])
        if abs(time.time() - at) > _CLAIM_SKEW_S:
            raise ValueError(f"its claim is {time.time() - at:+.0f} s old")
        identity = tls.verify_signed(_claim_payload(channel_id, endpoint, at), base64.b64decode(claim["sig"]), claim["cert"].encode())
    except (ValueError, TypeError, KeyError) as error:
        raise ChannelError(f"refused the opener {endpoint!r} of channel {channel_id!r}: {error}", peer=str(endpoint)) from error
    if identity not in _CHANNEL_PEERS:
        raise ChannelError(f"refused the opener {endpoint!r} of channel {channel_id!r}: identity {identity!r} is not a Phalanx service",
                           peer=str(endpoint))
    return identity


class _Rendezvous:
    """One endpoint's joins: as opener on a peer's store, as acceptor on its own (blocking: call them on a thread).

    With ``tls`` the opener signs its claim and the acceptor checks the claim it reads.
    """

    def __init__(self, endpoint_id: str, timeout_s: float, tls: ServiceTls | None = None) -> None:
        self._endpoint_id = endpoint_id
        self._timeout_s = timeout_s
        self._tls = tls
        # One TCPStore client per peer store, shared by every channel opened to it.
        self._clients: dict[tuple[str, int], dist.TCPStore] = {}
        self._clients_lock = threading.Lock()

    def join_as_opener(
        self, address: tuple[str, int], channel_id: str, backend: str, deadline: float, form: FormGroup, gpu: str | None = None
    ) -> tuple[Any, dist.Store, str]:
        """Joins as rank 0; returns the group, its store and the backend the acceptor agreed to."""
        claim: dict[str, Any] = {"endpoint": self._endpoint_id, "backend": backend, "gpu": gpu}
        opener = json.dumps(sign_claim(self._tls, claim, channel_id) if self._tls is not None else claim)
        client = self._client_for(address, deadline)
        try:
            client.set(f"{_store_prefix(channel_id)}/{_OPENER_KEY}", opener)
        except Exception:  # noqa: BLE001 - any error means the same: reconnect once, and a second failure raises
            # The cached connection is dead (the store restarted on the same address?): one fresh try.
            self._forget_client(address, client)
            client = self._client_for(address, deadline)
            client.set(f"{_store_prefix(channel_id)}/{_OPENER_KEY}", opener)
        store = _PollingStore(client, channel_id, deadline)
        try:
            if backend == "nccl":
                backend = store.get(_AGREED_KEY).decode()
            group = form(store, 0, backend)
            store.set(_READY_KEY, "1")
        except BaseException:
            # Stale keys would make the next accept of this id join a group that is gone.
            _delete_keys(client, _store_prefix(channel_id))
            raise
        return group, store, backend

    def join_as_acceptor(
        self, master: dist.TCPStore, channel_id: str, backend: str, deadline: float, form: FormGroup, gpu: str | None = None
    ) -> tuple[Any, dist.Store, str, str]:
        """Joins as rank 1; returns the group, its store, the opener's endpoint id and the backend both use."""
        store = _PollingStore(master, channel_id, deadline)
        try:
            store.wait([_OPENER_KEY])
            opener = json.loads(store.get(_OPENER_KEY))
            if self._tls is not None:
                check_claim(self._tls, opener, channel_id)
            if opener["backend"] != backend:
                raise ChannelError(f"the peer {opener['endpoint']!r} opened it with {opener['backend']}, accepted with {backend}")
            if backend == "nccl":
                backend = agreed_backend(backend, opener.get("gpu"), gpu)
                store.set(_AGREED_KEY, backend)
            group = form(store, 1, backend)
            store.wait([_READY_KEY])
        finally:
            # Joined (both sides are past the rendezvous) or failed: the keys are
            # no use any more, and stale ones would derail a reuse of the id.
            _delete_keys(master, _store_prefix(channel_id))
        return group, store, opener["endpoint"], backend

    def forget_clients(self) -> None:
        """Drop the clients of peer stores (the endpoint closes)."""
        with self._clients_lock:
            self._clients.clear()

    def forget_client_at(self, address: tuple[str, int]) -> None:
        """Drop the client of the peer store at ``address`` (no channel opened there is left)."""
        with self._clients_lock:
            self._clients.pop(address, None)

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
