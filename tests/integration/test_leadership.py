"""The one leadership loop (common.leadership) against a real etcd: campaign, lead until deposed, resign, campaign again."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from phalanx.common.config import EtcdConfig
from phalanx.common.leadership import LeaderElection, LeadershipLostError, lead_forever
from phalanx.common.lease import connect_etcd
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration


class _Contender:
    """One instance running `lead_forever` with a term that records itself and waits, or raises what it is told to."""

    def __init__(self, etcd_config: EtcdConfig, key: str, name: str) -> None:
        self.client = connect_etcd(etcd_config)
        self.election = LeaderElection(etcd_config, key, ttl_s=1)
        self.election.attach(self.client)
        self.name = name
        self.terms = 0
        self.leading = False
        self.fail_with: BaseException | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(lead_forever(self.election, self.name, self.name.encode, self._term))

    async def _term(self) -> None:
        self.terms += 1
        self.leading = True
        try:
            while self.fail_with is None:
                await asyncio.sleep(0.02)
            error, self.fail_with = self.fail_with, None
            raise error
        finally:
            self.leading = False

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.election.resign()
        await self.client.close()


@pytest.fixture
def key() -> str:
    return f"/phalanx/test/leader-{uuid.uuid4().hex}"


async def test_a_cancelled_leader_resigns_and_a_standby_takes_over_before_the_lease_ttl(etcd_config: EtcdConfig, key: str) -> None:
    first, second = _Contender(etcd_config, key, "first"), _Contender(etcd_config, key, "second")
    try:
        first.start()
        await assert_eventually(lambda: first.leading)
        second.start()
        await asyncio.sleep(0.3)
        assert not second.leading and await first.election.holder() == b"first"
        loop = asyncio.get_running_loop()
        resigned_at = loop.time()
        assert first.task is not None
        first.task.cancel()
        await asyncio.gather(first.task, return_exceptions=True)
        await assert_eventually(lambda: second.leading, timeout=0.9, message="a resignation hands over at once, not after the TTL")
        assert loop.time() - resigned_at < 1.0
    finally:
        await first.stop()
        await second.stop()


async def test_a_term_that_loses_the_leadership_resigns_and_campaigns_again(etcd_config: EtcdConfig, key: str) -> None:
    solo = _Contender(etcd_config, key, "solo")
    try:
        solo.start()
        await assert_eventually(lambda: solo.leading)
        solo.fail_with = LeadershipLostError("a fenced write was refused")
        await assert_eventually(lambda: solo.terms == 2 and solo.leading, message="elected again after a lost term")
        solo.fail_with = RuntimeError("a bug in the term")
        await assert_eventually(lambda: solo.terms == 3 and solo.leading, message="a failed term steps down and leads again")
    finally:
        await solo.stop()


async def test_a_lapsed_lease_cancels_the_term_and_the_instance_campaigns_again(etcd_config: EtcdConfig, key: str) -> None:
    solo = _Contender(etcd_config, key, "solo")
    try:
        solo.start()
        await assert_eventually(lambda: solo.leading)
        await solo.election.abandon()  # the keepalives stop, as when etcd is out of reach for the TTL
        await assert_eventually(lambda: not solo.leading, timeout=1.0, message="the term ends when the lease is gone")
        await assert_eventually(lambda: solo.terms == 2 and solo.leading, timeout=5.0, message="elected again once the key lapsed")
    finally:
        await solo.stop()


async def test_fenced_writes_succeed_only_for_the_holder(etcd_config: EtcdConfig, key: str) -> None:
    leader, standby = _Contender(etcd_config, key, "leader"), _Contender(etcd_config, key, "standby")
    data = f"{key}-data"
    try:
        leader.start()
        await assert_eventually(lambda: leader.leading)
        standby.election._value = b"standby"  # as if it had been elected once and deposed since
        assert await leader.election.fenced_put(data, b"1")
        assert not await standby.election.fenced_put(data, b"2")
        assert not await standby.election.fenced_delete(data)
        held = await leader.client.get(data.encode())
        assert held is not None and held.value == b"1"
        assert await leader.election.fenced_delete(data)
        assert await leader.client.get(data.encode()) is None
    finally:
        await leader.stop()
        await standby.stop()
