"""Leadership: election through one etcd key under a lease, writes fenced by it, and the one loop that leads.

The key is created only if absent (a transaction), under a lease this
instance keeps alive on one stream. A standby polls until the key is gone
(its holder died: the lease lapsed) and creates it. Every write of the
leader compares the key's value with its own in the same transaction, so a
deposed leader that has not noticed yet cannot overwrite its successor.

`lead_forever` is the life of every elected service (health, the planner,
the ERT manager): campaign -> lead until deposed -> resign -> campaign again.
A term ends with `LeadershipLostError` when a fenced write is refused or the
lease lapses; any other error steps down after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aetcd

from phalanx.common.config import EtcdConfig
from phalanx.common.errors import PhalanxError
from phalanx.common.lease import TRANSIENT_ERRORS, Backoff, LeasedKey, LeaseError

__all__ = ["LeaderElection", "LeadershipLostError", "NotElectedError", "lead_forever"]

log = logging.getLogger(__name__)


class NotElectedError(LeaseError):
    """Another instance holds the leadership key."""


class LeadershipLostError(PhalanxError):
    """A fenced write was refused or the lease lapsed: another instance leads now."""

    reason = "LEADERSHIP_LOST"


class _LeadershipKey(LeasedKey):
    """A LeasedKey that is put only if nobody holds it (also when its lease is re-granted)."""

    async def _register(self) -> None:
        async with self._lock:
            lease = await self._client.lease(self._config.lease_ttl_s)
            tx = self._client.transactions
            try:
                created, _ = await self._client.transaction(
                    compare=[tx.create(self._key) == 0], success=[tx.put(self._key, self._value, lease=lease.id)], failure=[]
                )
            except BaseException:
                await asyncio.shield(self._revoke_quietly(lease.id))
                raise
            if not created:
                await self._revoke_quietly(lease.id)
                raise NotElectedError(f"{self.key} is held by another instance")
            self._lease_id = lease.id
            self._registrations += 1


class LeaderElection:
    """Campaign for ``key``; while elected, `fenced_*` writes succeed only if we still hold it."""

    def __init__(self, config: EtcdConfig, key: str, *, ttl_s: int, poll_s: float = 0.1) -> None:
        self._config = config.model_copy(update={"lease_ttl_s": ttl_s})
        self._key = key
        self._value = b""
        self._poll_s = poll_s
        self._client: aetcd.Client | None = None
        self._held: _LeadershipKey | None = None

    @property
    def value(self) -> bytes:
        return self._value

    def attach(self, client: aetcd.Client) -> None:
        """The client used for polling and fenced writes (shared with the caller)."""
        self._client = client

    async def campaign(self, value: bytes) -> None:
        """Return once elected with ``value`` in the key (poll for a vacancy while another instance leads)."""
        self._value = value
        while True:
            if await self._vacant():
                key = _LeadershipKey(self._config, self._key, self._value)
                try:
                    await key.start()
                except NotElectedError:
                    await key.close(revoke=False)
                except LeaseError as error:
                    await key.close(revoke=False)
                    log.warning("campaign failed: %s", error)
                else:
                    self._held = key
                    return
            await asyncio.sleep(self._poll_s)

    @property
    def _etcd(self) -> aetcd.Client:
        assert self._client is not None, "used before attach()"
        return self._client

    async def _vacant(self) -> bool:
        try:
            held = await self._etcd.get(self._key.encode())
        except TRANSIENT_ERRORS as error:
            log.debug("leader key read failed: %s", error)
            return False
        return held is None

    @property
    def elected(self) -> bool:
        """Whether we hold the key as far as we know (the lease may have lapsed a moment ago)."""
        return self._held is not None and self._held.lease_id is not None

    async def holder(self) -> bytes | None:
        """The leader's value, or None while nobody leads."""
        held = await self._etcd.get(self._key.encode())
        return None if held is None else held.value

    async def fenced_put(self, key: str, value: bytes) -> bool:
        """Put ``key`` if we still lead; False (and nothing written) if we do not."""
        tx = self._etcd.transactions
        ok, _ = await self._etcd.transaction(
            compare=[tx.value(self._key.encode()) == self._value], success=[tx.put(key.encode(), value)], failure=[]
        )
        return ok

    async def fenced_delete(self, key: str) -> bool:
        """Delete ``key`` if we still lead; False (and nothing deleted) if we do not."""
        tx = self._etcd.transactions
        ok, _ = await self._etcd.transaction(
            compare=[tx.value(self._key.encode()) == self._value], success=[tx.delete(key.encode())], failure=[]
        )
        return ok

    async def resign(self) -> None:
        """Give the key up (at once, so a standby takes over without waiting for the TTL); idempotent."""
        held, self._held = self._held, None
        if held is not None:
            await held.close(revoke=True)

    async def abandon(self) -> None:
        """Stop keeping the key alive without revoking it (we lost it, or we are being killed)."""
        held, self._held = self._held, None
        if held is not None:
            await held.close(revoke=False)

    async def deposed(self, poll_s: float = 0.1) -> None:
        """Return once the lease lapsed (our keepalives stopped reaching etcd for its TTL)."""
        while self.elected:
            await asyncio.sleep(poll_s)


async def lead_forever(election: LeaderElection, who: str, value: Callable[[], bytes], lead: Callable[[], Awaitable[None]]) -> None:
    """Campaign with ``value()``, run ``lead()`` while elected, resign, and campaign again; until cancelled.

    ``lead`` is one leadership term: it runs until it raises (LeadershipLostError when a fenced write is
    refused) or the lease lapses, which cancels it. Another error steps down after a backoff, still
    holding the key meanwhile (a term that fails at once would otherwise spin through elections).
    """
    backoff = Backoff(initial=0.2, cap=5.0)
    while True:
        await election.campaign(value())
        log.info("%s leads", who)
        try:
            await _term(election, lead)
        except* LeadershipLostError as lost:
            log.warning("%s lost the leadership: %s", who, lost.exceptions[0])
        except* Exception:
            log.exception("%s failed while leading; stepping down", who)
            await asyncio.sleep(backoff.next())
        else:
            backoff.reset()
        finally:
            with contextlib.suppress(Exception):
                await election.resign()


async def _term(election: LeaderElection, lead: Callable[[], Awaitable[None]]) -> None:
    async def watch() -> None:
        await election.deposed()
        raise LeadershipLostError("the leadership lease lapsed")

    async with asyncio.TaskGroup() as tasks:
        watching = tasks.create_task(watch())
        await lead()
        watching.cancel()
