"""Which worker serves which request, in etcd, so that any router replica can resume a stream.

Records live under one lease per router (its "session", TTL = resume
window) that the router keeps alive: while the router lives its records
live; when it dies they outlive it by the resume window, long enough for a
client to resume at another replica. A finished request's record is
deleted after a short linger (a client that lost the last token may still
resume). Creating a record is a put-if-absent transaction, which also makes
Generate idempotent: a retry with the same request id finds the record.

etcd being away must not stop serving: records are then skipped (the
request is served but not resumable elsewhere), with a short cool-down so
that each request does not wait for a dead etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import decode_json, encode_json
from phalanx.common.lease import TRANSIENT_ERRORS, LeasedKey, connect_etcd
from phalanx.common.subjects import request_key

log = logging.getLogger(__name__)

SESSIONS_PREFIX = "/phalanx/v1/router-sessions/"
# Longest a request waits on etcd for its record before it is served without one.
_RECORD_TIMEOUT_S = 0.5
_COOLDOWN_S = 2.0
_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, TimeoutError)


class RequestRecords:
    def __init__(self, config: EtcdConfig, router_id: str, *, resume_window_s: int, linger_s: float = 10.0) -> None:
        self._client = connect_etcd(config)
        self._session = LeasedKey(
            config.model_copy(update={"lease_ttl_s": resume_window_s, "keepalive_interval_s": None}),
            SESSIONS_PREFIX + router_id,
            str(os.getpid()).encode(),
        )
        self._linger_s = linger_s
        self._unavailable_until = 0.0
        self._deletions: set[asyncio.Task[None]] = set()
        self._updates: dict[str, asyncio.Task[None]] = {}  # the latest background update of each request
        self.skipped = 0

    async def start(self) -> None:
        await self._session.start()

    async def claim(self, record: common_pb2.RequestRecord) -> common_pb2.RequestRecord | None:
        """Store ``record`` unless its request id is taken; return the existing record if it is.

        None means stored, or etcd is away (then the request is served without a record).
        """
        lease = self._session.lease_id
        if lease is None or time.monotonic() < self._unavailable_until:
            self.skipped += 1
            return None
        key = request_key(record.request_id).encode()
        tx = self._client.transactions
        try:
            async with asyncio.timeout(_RECORD_TIMEOUT_S):
                stored, responses = await self._client.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, encode_json(record), lease=lease)],
                    failure=[tx.get(key)],
                )
        except _ERRORS as error:
            self._cool_down(error)
            return None
        if stored or not responses or not responses[0]:
            return None
        return decode_json(responses[0][0][0], common_pb2.RequestRecord)

    async def update(self, record: common_pb2.RequestRecord) -> None:
        """Replace a record (the request moved to another worker)."""
        lease = self._session.lease_id
        if lease is None or time.monotonic() < self._unavailable_until:
            return
        try:
            async with asyncio.timeout(_RECORD_TIMEOUT_S):
                await self._client.put(request_key(record.request_id).encode(), encode_json(record), lease=lease)
        except _ERRORS as error:
            self._cool_down(error)

    def update_soon(self, record: common_pb2.RequestRecord) -> None:
        """`update` in the background, after the request's earlier updates.

        A stream that continues on another worker must not wait on etcd (a
        stalled put costs up to its timeout): the record serves only a resume
        at another router, and until it lands that resume finds the old
        worker, whose request a migration brings back anyway.
        """
        previous = self._updates.get(record.request_id)
        task = asyncio.create_task(self._update_after(previous, record))
        self._updates[record.request_id] = task
        task.add_done_callback(lambda done: self._updates.pop(record.request_id, None) if self._updates.get(record.request_id) is done else None)

    async def _update_after(self, previous: asyncio.Task[None] | None, record: common_pb2.RequestRecord) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # its outcome is its own; only the order matters here
        await self.update(record)

    async def get(self, request_id: str) -> common_pb2.RequestRecord | None:
        """The record of a request, or None if there is none (or etcd is away)."""
        try:
            async with asyncio.timeout(_RECORD_TIMEOUT_S * 2):
                value = await self._client.get(request_key(request_id).encode())
        except _ERRORS as error:
            log.warning("cannot read the record of %s: %s", request_id, error)
            return None
        return None if value is None else decode_json(value.value, common_pb2.RequestRecord)

    def release(self, request_id: str) -> None:
        """Delete a finished request's record after the linger."""
        task = asyncio.create_task(self._delete_later(request_id))
        self._deletions.add(task)
        task.add_done_callback(self._deletions.discard)

    async def delete(self, request_id: str) -> None:
        with contextlib.suppress(*_ERRORS):
            async with asyncio.timeout(_RECORD_TIMEOUT_S):
                await self._client.delete(request_key(request_id).encode())

    async def _delete_later(self, request_id: str) -> None:
        await asyncio.sleep(self._linger_s)
        await self.delete(request_id)

    def _cool_down(self, error: BaseException) -> None:
        self.skipped += 1
        if time.monotonic() >= self._unavailable_until:
            log.warning("etcd did not take a request record (%s); serving without records for %.0f s", error, _COOLDOWN_S)
        self._unavailable_until = time.monotonic() + _COOLDOWN_S

    async def close(self) -> None:
        """Stop the session's keepalives without revoking it: records outlive us by the resume window."""
        pending = [*self._deletions, *self._updates.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._session.close(revoke=False)
        await self._client.close()
