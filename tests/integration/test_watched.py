"""The one follower of watched state (common.watched) against a real etcd: read, watch, survive etcd's restart."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import encode_json
from phalanx.common.lease import TRANSIENT_ERRORS, connect_etcd
from phalanx.common.subjects import DEGRADATION_KEY, PLANNER_CAPACITY_KEY, PLANNER_TARGET_KEY
from phalanx.common.watched import DEGRADATION, PLANNER_CAPACITY, PLANNER_TARGET, StateFollower, WatchedState
from phalanx.launch.infra import EtcdServer
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration


def _state() -> WatchedState[common_pb2.DegradationState]:
    # A key of its own per test: the session's etcd is shared.
    return WatchedState(f"/phalanx/test/degradation-{uuid.uuid4().hex}", common_pb2.DegradationState)


def _level(level: int) -> bytes:
    return encode_json(common_pb2.DegradationState(level=level, reason=f"level {level}"))


def test_the_followed_keys_are_the_ones_subjects_builds() -> None:
    assert (DEGRADATION.key, PLANNER_CAPACITY.key, PLANNER_TARGET.key) == (DEGRADATION_KEY, PLANNER_CAPACITY_KEY, PLANNER_TARGET_KEY)


async def test_follow_delivers_the_value_then_every_put_and_delete(etcd_config: EtcdConfig) -> None:
    state = _state()
    client = connect_etcd(etcd_config)
    follower = StateFollower(etcd_config, state)
    seen: list[int | None] = []
    following = asyncio.get_running_loop().create_task(follower.follow(lambda s: seen.append(None if s is None else s.level)))
    try:
        await assert_eventually(lambda: seen == [None], message="an absent key is delivered as None")
        await client.put(state.key.encode(), _level(2))
        await client.put(f"{state.key}-other".encode(), _level(4))  # a key that merely starts with it is another key
        await client.put(state.key.encode(), _level(3))
        await client.delete(state.key.encode())
        await assert_eventually(lambda: seen == [None, 2, 3, None])
        assert follower.value is None
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await client.delete(f"{state.key}-other".encode())
        await follower.close()
        await client.close()


async def test_a_change_between_read_and_follow_is_delivered(etcd_config: EtcdConfig) -> None:
    state = _state()
    client = connect_etcd(etcd_config)
    await client.put(state.key.encode(), _level(1))
    follower = StateFollower(etcd_config, state)
    seen: list[int | None] = []
    following = None
    try:
        read = await follower.read()
        assert read is not None and read.level == 1 and follower.value == read
        await client.put(state.key.encode(), _level(2))
        following = asyncio.get_running_loop().create_task(follower.follow(lambda s: seen.append(None if s is None else s.level)))
        await assert_eventually(lambda: seen == [2], message="the read value is the caller's; the change after it comes once")
    finally:
        if following is not None:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        await client.delete(state.key.encode())
        await follower.close()
        await client.close()


async def test_an_unreadable_value_keeps_the_last_good_one(etcd_config: EtcdConfig) -> None:
    state = _state()
    client = connect_etcd(etcd_config)
    follower = StateFollower(etcd_config, state)
    following = asyncio.get_running_loop().create_task(follower.follow())
    try:
        await client.put(state.key.encode(), _level(2))
        await assert_eventually(lambda: follower.value is not None and follower.value.level == 2)
        await client.put(state.key.encode(), b"{not json")
        await client.put(f"{state.key}-marker".encode(), b"")
        await asyncio.sleep(0.2)
        assert follower.value is not None and follower.value.level == 2
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await client.delete(state.key.encode())
        await client.delete(f"{state.key}-marker".encode())
        await follower.close()
        await client.close()


async def test_the_follower_reads_again_after_etcd_comes_back(etcd_server: EtcdServer, etcd_config: EtcdConfig) -> None:
    state = _state()
    client = connect_etcd(etcd_config)
    follower = StateFollower(etcd_config, state)
    seen: list[int | None] = []
    following = asyncio.get_running_loop().create_task(follower.follow(lambda s: seen.append(None if s is None else s.level)))
    try:
        await assert_eventually(lambda: seen == [None])
        await client.put(state.key.encode(), _level(1))
        await assert_eventually(lambda: seen == [None, 1])
        etcd_server.restart()

        async def put_level_3() -> bool:
            try:
                await client.put(state.key.encode(), _level(3))
            except TRANSIENT_ERRORS:
                return False
            return True

        await assert_eventually(put_level_3, timeout=10.0)
        await assert_eventually(lambda: seen[-1] == 3, timeout=10.0, message="followed again once etcd was back")
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        etcd_server.start()
        await client.delete(state.key.encode())
        await follower.close()
        await client.close()
