"""How the planner's decisions reach the fleet: connectors behind one interface.

A connector `publish`es a decision (the whole fleet's targets, not a delta: a later decision subsumes the
earlier ones) and reports the orchestrator's `acknowledged` progress; the planner feeds acknowledgements
to the DecisionMachine, whose deadlines time out decisions nobody carries out. Scaling is non-blocking:
publish returns at once.

- `virtual`: the decision (a `DecisionRecord`, stored as the protobuf JSON of `PlannerDecision`) is at
  PLANNER_DECISION_KEY (/phalanx/v1/planner/decision), written fenced by the planner's leadership (a
  deposed planner cannot overwrite its successor). An orchestrator carries it out and writes an `AckRecord`
  (`PlannerAck`) at PLANNER_ACK_KEY (/phalanx/v1/planner/ack) once the fleet matches the targets; an ack of
  id N acknowledges every decision up to N. `phalanx up --planner` is such an orchestrator (the `local`
  connector, phalanx.planner.local_connector).
- `kubernetes`: patches the worker StatefulSet's scale subresource (kubernetes_connector.py), and in a disaggregated
  fleet the prefill StatefulSet's too.

A disaggregated fleet's decision carries a target per pool (`DecisionRecord.prefill_workers`; docs/disagg.md, "Planner").

`phalanx planner set-target N` writes an operator's target (PLANNER_TARGET_KEY, `PlannerTarget`); the
planner turns it into a decision at its next ready tick, clamped to its bounds.

Every value goes through discovery's `encode_json`/`decode_json` like the rest of etcd; the dataclasses stay
the planner's domain objects (the DecisionMachine, the connectors and `phalanx planner show` use them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import aetcd

from phalanx._proto import common_pb2
from phalanx.common.discovery import decode_json, encode_json
from phalanx.common.leadership import LeaderElection
from phalanx.common.roles import DECODE, PREFILL
from phalanx.common.subjects import PLANNER_ACK_KEY, PLANNER_DECISION_KEY, PLANNER_TARGET_KEY
from phalanx.planner.decisions import Decision

__all__ = [
    "AckRecord", "Connector", "DecisionRecord", "VirtualConnector", "clear_target", "read_ack", "read_decision", "read_target", "write_ack",
    "write_target",
]


@dataclass(frozen=True)
class DecisionRecord:
    """What an orchestrator reads: the targets, why, and until when (wall clock) the planner waits for the ack.

    An aggregated fleet's targets are `workers` and `spares`. A disaggregated fleet's (`prefill_workers` not None) are two
    pools: `workers` and `spares` are the decode pool's (the workers routed to, so an orchestrator that knows no pools
    scales those as before), `prefill_workers` and `prefill_spares` the prefill pool's; on the wire both pools are
    `PlannerDecision.pools`."""

    id: int
    workers: int
    spares: int
    reason: str
    issued_at: float
    deadline: float
    # Workers health marked DEAD whose replacement is still being carried out (this decision's and earlier ones').
    replaces: list[str] = field(default_factory=list)
    promote: str = ""
    prefill_workers: int | None = None
    prefill_spares: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers is not None

    @classmethod
    def of(cls, decision: Decision, replacing: list[str]) -> DecisionRecord:
        """A DecisionMachine decision (monotonic clock) as a record (wall clock)."""
        now = time.time()
        targets = decision.targets
        return cls(
            id=decision.id, workers=targets.workers, spares=targets.spares, reason=str(decision.reason), issued_at=now,
            deadline=now + (decision.deadline - decision.issued_at), replaces=replacing, promote=decision.promote or "",
            prefill_workers=targets.prefill, prefill_spares=targets.prefill_spares if targets.prefill is not None else 0,
        )

    def to_json(self) -> bytes:
        """The etcd value."""
        pools = [] if self.prefill_workers is None else [
            common_pb2.PlannerPoolTarget(role=PREFILL, workers=self.prefill_workers, spares=self.prefill_spares),
            common_pb2.PlannerPoolTarget(role=DECODE, workers=self.workers, spares=self.spares),
        ]
        return encode_json(common_pb2.PlannerDecision(
            id=self.id, workers=self.workers, spares=self.spares, reason=self.reason, issued_at=self.issued_at, deadline=self.deadline,
            replaces=self.replaces, promote=self.promote, pools=pools,
        ))

    @classmethod
    def from_json(cls, data: bytes) -> DecisionRecord:
        m = decode_json(data, common_pb2.PlannerDecision)
        pools = {pool.role: pool for pool in m.pools}
        workers, spares = (pools[DECODE].workers, pools[DECODE].spares) if DECODE in pools else (m.workers, m.spares)
        prefill = pools.get(PREFILL)
        return cls(
            id=m.id, workers=workers, spares=spares, reason=m.reason, issued_at=m.issued_at, deadline=m.deadline,
            replaces=list(m.replaces), promote=m.promote, prefill_workers=prefill.workers if prefill is not None else None,
            prefill_spares=prefill.spares if prefill is not None else 0,
        )


@dataclass(frozen=True)
class AckRecord:
    """An orchestrator's word that the fleet matches decision `id`'s targets (`workers` is what it counts: in a
    disaggregated fleet the decode workers, and `prefill_workers` the prefill ones)."""

    id: int
    workers: int
    at: float
    orchestrator: str = ""
    prefill_workers: int = 0

    def to_json(self) -> bytes:
        """The etcd value."""
        return encode_json(common_pb2.PlannerAck(id=self.id, workers=self.workers, at=self.at, orchestrator=self.orchestrator,
                                                 prefill_workers=self.prefill_workers))

    @classmethod
    def from_json(cls, data: bytes) -> AckRecord:
        m = decode_json(data, common_pb2.PlannerAck)
        return cls(id=m.id, workers=m.workers, at=m.at, orchestrator=m.orchestrator, prefill_workers=m.prefill_workers)


class Connector(Protocol):
    name: str

    async def publish(self, record: DecisionRecord) -> bool:
        """Hand the decision over (non-blocking); False when it was not (this planner no longer leads)."""
        ...

    async def acknowledged(self) -> AckRecord | None:
        """The newest acknowledgement, if any."""
        ...

    async def close(self) -> None: ...


class VirtualConnector:
    """Decision and acknowledgement through etcd (the module docstring)."""

    name = "virtual"

    def __init__(self, client: aetcd.Client, election: LeaderElection) -> None:
        self._client = client
        self._election = election

    async def publish(self, record: DecisionRecord) -> bool:
        return await self._election.fenced_put(PLANNER_DECISION_KEY, record.to_json())

    async def acknowledged(self) -> AckRecord | None:
        return await read_ack(self._client)

    async def close(self) -> None:
        return None


async def _read(client: aetcd.Client, key: str) -> bytes | None:
    found = await client.get(key.encode())
    return None if found is None else found.value


async def read_decision(client: aetcd.Client) -> DecisionRecord | None:
    value = await _read(client, PLANNER_DECISION_KEY)
    return None if value is None else DecisionRecord.from_json(value)


async def read_ack(client: aetcd.Client) -> AckRecord | None:
    value = await _read(client, PLANNER_ACK_KEY)
    return None if value is None else AckRecord.from_json(value)


async def write_ack(client: aetcd.Client, ack: AckRecord) -> None:
    await client.put(PLANNER_ACK_KEY.encode(), ack.to_json())


async def read_target(client: aetcd.Client) -> int | None:
    value = await _read(client, PLANNER_TARGET_KEY)
    return None if value is None else decode_json(value, common_pb2.PlannerTarget).workers


async def write_target(client: aetcd.Client, workers: int) -> None:
    if workers < 0:
        raise ValueError(f"a target of {workers} workers: need >= 0")
    await client.put(PLANNER_TARGET_KEY.encode(), encode_json(common_pb2.PlannerTarget(workers=workers, at=time.time())))


async def clear_target(client: aetcd.Client) -> None:
    await client.delete(PLANNER_TARGET_KEY.encode())
