"""Responses in etcd, where every gateway replica reads and writes them.

Three keys per response, all put in one transaction when it is created:

- ``responses/<id>``: the ``StoredResponse`` (JSON), under a lease of its
  own with the response's time to live (``response_ttl_s``): every gateway
  writes it under that lease, and etcd deletes it when the TTL runs out;
- ``responses-running/<id>``: present while the response is unfinished
  (same lease), so that a gateway finds unfinished responses without
  reading every stored one;
- ``response-drivers/<id>``: the gateway that runs the response on (relays
  its tokens from a router into etcd), under that gateway's session lease:
  when the gateway dies the key goes within the etcd lease TTL, and another
  gateway claims the response (a put-if-absent) and runs it on.

Every write of a response compares its version (etcd's count of the key's
writes) with the one its writer read: a cancellation, or a second runner
that claimed the response while the first was only slow, makes the other's
write fail, so a response's tokens are never written twice or lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from typing import TypeVar

from phalanx.common.config import EtcdConfig
from phalanx.common.lease import TRANSIENT_ERRORS, LeasedKey, connect_etcd
from phalanx.gateway.openai_responses import StoredResponse

__all__ = ["ResponseStore", "StoreUnavailableError"]

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "/phalanx/v1/gateway/"
RESPONSES = PREFIX + "responses/"
RUNNING = PREFIX + "responses-running/"
DRIVERS = PREFIX + "response-drivers/"
SESSIONS = PREFIX + "sessions/"
_TIMEOUT_S = 2.0
_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, TimeoutError)


class StoreUnavailableError(ConnectionError):
    """etcd did not answer: the Responses API cannot serve now."""


class ResponseStore:
    def __init__(self, config: EtcdConfig, gateway_id: str, *, ttl_s: int) -> None:
        self._client = connect_etcd(config)
        self._session = LeasedKey(config, SESSIONS + gateway_id, str(os.getpid()).encode())
        self.gateway_id = gateway_id
        self.ttl_s = ttl_s

    async def start(self) -> None:
        """The session lease the drivers' keys live under (raises EtcdUnavailableError when etcd stays away)."""
        await self._session.start()

    async def close(self) -> None:
        await self._session.close()  # revoked: this gateway's driver keys go at once, and others take its responses over
        await self._client.close()

    async def grant(self) -> int:
        """A lease for a new response (its time to live)."""
        lease = await self._call(self._client.lease(self.ttl_s))
        return int(lease.id)

    async def create(self, response: StoredResponse) -> int:
        """Stores a new response, claimed by this gateway; its version (1)."""
        key = _key(RESPONSES, response.id)
        tx = self._client.transactions
        stored, _ = await self._call(self._client.transaction(
            compare=[tx.create(key) == 0],
            success=[
                tx.put(key, response.encode(), lease=response.lease_id),
                tx.put(_key(RUNNING, response.id), b"", lease=response.lease_id),
                tx.put(_key(DRIVERS, response.id), self.gateway_id.encode(), lease=self._lease()),
            ],
            failure=[],
        ))
        if not stored:
            raise StoreUnavailableError(f"response id {response.id} is taken")  # ids are random: not expected
        return 1

    async def get(self, response_id: str) -> tuple[StoredResponse, int] | None:
        """The response and its version, or None if there is none (never was, or its time to live ran out)."""
        found = await self._call(self._client.get(_key(RESPONSES, response_id)))
        if found is None:
            return None
        return StoredResponse.decode(found.value), int(found.version)

    async def write(self, response: StoredResponse, version: int) -> int | None:
        """Replaces the response if it is still at ``version``; its new version, or None if someone else wrote it first."""
        key = _key(RESPONSES, response.id)
        tx = self._client.transactions
        success = [tx.put(key, response.encode(), lease=response.lease_id)]
        if response.final:
            success.append(tx.delete(_key(RUNNING, response.id)))
        written, _ = await self._call(self._client.transaction(compare=[tx.version(key) == version], success=success, failure=[]))
        return version + 1 if written else None

    async def claim(self, response_id: str) -> bool:
        """Makes this gateway the response's runner, unless another gateway is."""
        key = _key(DRIVERS, response_id)
        tx = self._client.transactions
        claimed, _ = await self._call(self._client.transaction(
            compare=[tx.create(key) == 0], success=[tx.put(key, self.gateway_id.encode(), lease=self._lease())], failure=[],
        ))
        return bool(claimed)

    async def release(self, response_id: str) -> None:
        """This gateway no longer runs the response (it ended, or this gateway stops)."""
        tx = self._client.transactions
        key = _key(DRIVERS, response_id)
        await self._call(self._client.transaction(
            compare=[tx.value(key) == self.gateway_id.encode()], success=[tx.delete(key)], failure=[],
        ))

    async def orphans(self) -> list[str]:
        """Unfinished responses that no gateway runs."""
        running = await self._call(self._client.get_prefix(RUNNING.encode(), keys_only=True))
        drivers = await self._call(self._client.get_prefix(DRIVERS.encode(), keys_only=True))
        driven = {kv.key.decode().removeprefix(DRIVERS) for kv in drivers}
        return [rid for rid in (kv.key.decode().removeprefix(RUNNING) for kv in running) if rid not in driven]

    def _lease(self) -> int:
        lease = self._session.lease_id
        if lease is None:
            raise StoreUnavailableError("this gateway's etcd session is not established")
        return lease

    async def _call(self, awaitable: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(_TIMEOUT_S):
                return await awaitable
        except _ERRORS as error:
            raise StoreUnavailableError(f"etcd did not answer: {error}") from error


def _key(prefix: str, response_id: str) -> bytes:
    return (prefix + response_id).encode()
