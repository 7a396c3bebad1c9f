"""A registered worker as the elected health instance tracks it: its registration, state machine, channel and tasks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from phalanx._proto import common_pb2, worker_pb2_grpc
from phalanx.health.state import WorkerTracker

__all__ = ["TrackedWorker"]


@dataclass
class TrackedWorker:
    registration: common_pb2.WorkerRegistration
    tracker: WorkerTracker
    channel: grpc.aio.Channel
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    probing: bool = False
    stopping: bool = False  # its grpc health said NOT_SERVING: it shuts down by itself
    case_turn: int = 0
    persisted_baseline: float = 0.0
    persisted_steps: dict[int, float] = field(default_factory=dict)  # the usual steps of its last written record

    @property
    def stub(self) -> worker_pb2_grpc.WorkerServiceStub:
        return worker_pb2_grpc.WorkerServiceStub(self.channel)
