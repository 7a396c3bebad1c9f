"""Following one piece of shared state in etcd: read it, then watch it change, delivering typed values.

Routers, workers, health and the planner follow a few single keys that one
owner writes (the degradation level, the planner's capacity view, an
operator's target). `StateFollower` reads the key, remembers the revision it
read at, and watches from the revision after it, so no change falls between
the two. When etcd is out of reach it retries with capped exponential backoff
and jitter, and after each interruption it reads the key again (a single
value needs no replay of what it missed: its current value is the answer,
also after a compaction). The keys come from `phalanx.common.subjects`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
from aetcd import rpc
from google.protobuf import json_format
from google.protobuf.message import Message

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import decode_json
from phalanx.common.lease import TRANSIENT_ERRORS, Backoff, connect_etcd
from phalanx.common.subjects import DEGRADATION_KEY, PLANNER_CAPACITY_KEY, PLANNER_TARGET_KEY

__all__ = ["DEGRADATION", "PLANNER_CAPACITY", "PLANNER_TARGET", "StateFollower", "WatchedState"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

_DELETE = rpc.Event.EventType.DELETE


@dataclass(frozen=True)
class WatchedState(Generic[M]):
    """One etcd key that holds a JSON-encoded ``message_type`` written by its one owner."""

    key: str
    message_type: type[M]


# Written by the health leader, followed by routers (admission, SLOs), workers (batch scale) and the planner (relaxed SLOs).
DEGRADATION: WatchedState[common_pb2.DegradationState] = WatchedState(DEGRADATION_KEY, common_pb2.DegradationState)
# Written by the planner leader, followed by the health leader (one input of the level).
PLANNER_CAPACITY: WatchedState[common_pb2.PlannerCapacityView] = WatchedState(PLANNER_CAPACITY_KEY, common_pb2.PlannerCapacityView)
# Written by an operator (`phalanx planner set-target`), followed by the planner leader.
PLANNER_TARGET: WatchedState[common_pb2.PlannerTarget] = WatchedState(PLANNER_TARGET_KEY, common_pb2.PlannerTarget)


class StateFollower(Generic[M]):
    """The current value of one `WatchedState` (None while the key is absent), kept by ``follow()``.

    ``read()`` once to know the value before serving (it raises when etcd is out of reach), then run
    ``follow(apply)`` as a task: it calls ``apply(value)`` for every change from that read on (with the
    value it reads itself if ``read()`` was not called) until cancelled.
    """

    def __init__(self, config: EtcdConfig, state: WatchedState[M]) -> None:
        self._config = config
        self._state = state
        self._key = state.key.encode()
        self._client = connect_etcd(config)
        self._revision: int | None = None  # of the last read; the watch starts after it
        self.value: M | None = None

    @property
    def key(self) -> str:
        return self._state.key

    async def read(self) -> M | None:
        """The value now (also kept in ``value``); the next ``follow()`` watches from here."""
        # A range of this one key: unlike a get, its header carries the revision also when the key is absent.
        result = await self._client.get_range(self._key, self._key + b"\0")
        self._revision = result.header.revision
        self.value = self._parse(result.kvs[0].value, self.value) if result.kvs else None
        return self.value

    async def follow(self, apply: Callable[[M | None], object] = lambda value: None) -> None:
        """Deliver every change to ``apply`` until cancelled; survives etcd restarts (read again, then watch again)."""
        backoff = Backoff(initial=0.05, cap=self._config.max_retry_wait_s)
        read = applied = self._revision is not None  # read() ran: the caller applied its value
        while True:
            try:
                if not read:
                    before = self.value
                    await self.read()
                    if not applied or self.value != before:
                        apply(self.value)
                        applied = True
                read = False  # after an interruption: read again (the value may have changed meanwhile)
                await self._watch(apply, backoff)
            except TRANSIENT_ERRORS as error:
                delay = backoff.next()
                log.warning("following %s interrupted (%s); reading it again in %.2f s", self.key, error, delay)
                await asyncio.sleep(delay)

    async def _watch(self, apply: Callable[[M | None], object], backoff: Backoff) -> None:
        """One Watch stream from the revision after the last read; raises (a transient error) when it ends."""
        assert self._revision is not None
        await self._client.connect()
        call = rpc.WatchStub(self._client.channel).Watch(metadata=self._client.metadata)
        try:
            create = rpc.WatchCreateRequest(key=self._key, start_revision=self._revision + 1)
            await call.write(rpc.WatchRequest(create_request=create))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("etcd closed the watch stream")
                if response.compact_revision:
                    raise ConnectionError(f"the watch fell behind compaction at {response.compact_revision}")
                if response.canceled:
                    raise ConnectionError(f"etcd cancelled the watch: {response.cancel_reason}")
                backoff.reset()
                for event in response.events:
                    self._revision = event.kv.mod_revision
                    if event.type == _DELETE:
                        self.value = None
                    else:
                        self.value = self._parse(event.kv.value, self.value)
                    apply(self.value)
        finally:
            call.cancel()

    def _parse(self, data: bytes, previous: M | None) -> M | None:
        try:
            return decode_json(data, self._state.message_type)
        except json_format.ParseError as error:
            # A corrupt value must not stop the follower: the last good one stands.
            log.warning("ignoring an unreadable value of %s: %s", self.key, error)
            return previous

    async def close(self) -> None:
        """Close the etcd connection; idempotent."""
        await self._client.close()
