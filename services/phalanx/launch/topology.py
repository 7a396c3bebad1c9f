"""One description of a fleet: which processes it runs, by kind and role, and in what order they start.

`phalanx up` (phalanx.launch.local_fleet), the test stack (phalanx.launch.stack) and the chaos harness
(phalanx.chaos.harness) all start from a `Fleet`: each walks `Fleet.phases()` and starts every `ProcessSpec` with its
own launcher for that kind (its own ids, environment and timeouts). A new worker role is a `WorkerRole` member and a
`WorkerGroup` in the fleet; a new kind of process is a `ProcessKind` member placed in `phases()`, and each driver's
table of launchers says how it starts one.

The order is the one every driver needs: the checkpoint store and migration first (workers checkpoint from their first
request on), the ERT manager and expert workers before the attention workers that wait for their table, the workers
before the router (so it starts with every worker's KV blocks indexed), the gateway after the router it fronts, health
after what it checks, the planner last (it must not decide on a fleet still starting).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Fleet", "ProcessKind", "ProcessSpec", "WorkerGroup", "WorkerRole"]


class WorkerRole(enum.StrEnum):
    """What an engine worker does (the worker's ``--role``)."""

    MONOLITHIC = "monolithic"  # the whole model, prefill and decode, in one worker (the worker's default)
    ATTENTION = "attention"  # disaggregated MoE: attention and the KV cache here, the experts on expert workers
    PREFILL = "prefill"  # disaggregated serving: computes prompts, hands each request on with its KV after its first token
    DECODE = "decode"  # disaggregated serving: takes new requests, and the KV of those prefilled on a prefill worker

    @property
    def flags(self) -> tuple[str, ...]:
        """The worker's command-line flags for this role (none for the default)."""
        return () if self is WorkerRole.MONOLITHIC else ("--role", self.value)


class ProcessKind(enum.StrEnum):
    """A kind of process a fleet runs; the value is the stem of its name in `phalanx up`."""

    NATS = "nats"
    ETCD = "etcd"
    FORK_SERVER = "fork-server"
    CHECKPOINT_STORE = "checkpoint"
    MIGRATION = "migration"
    ERT_MANAGER = "ert-manager"
    EXPERT_WORKER = "expert"
    ENCODER = "encoder"
    WORKER = "worker"
    FAILOVER_SLOT = "slot"  # a memory service sharing the weights, a primary engine that serves, a shadow standing by
    ROUTER = "router"
    GATEWAY = "gateway"
    HEALTH = "health"
    PLANNER = "planner"


# Started once, named by their kind alone.
_SINGLETONS = frozenset({ProcessKind.NATS, ProcessKind.ETCD, ProcessKind.FORK_SERVER})


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a fleet (a failover slot: the slot's processes), the ``index``-th of its kind."""

    kind: ProcessKind
    index: int = 0
    role: WorkerRole | None = None  # a worker's

    @property
    def name(self) -> str:
        """Its name in `phalanx up` (``worker-0``, ``router-0``, ``nats``); the test drivers give ids of their own."""
        return self.kind.value if self.kind in _SINGLETONS else f"{self.kind.value}-{self.index}"


@dataclass(frozen=True)
class WorkerGroup:
    """``count`` engine workers of one role."""

    role: WorkerRole
    count: int


@dataclass(frozen=True)
class Fleet:
    """What one deployment runs; ``phases()`` expands it into processes in start order."""

    workers: tuple[WorkerGroup, ...] = (WorkerGroup(WorkerRole.MONOLITHIC, 1),)
    failover_slots: int = 0  # engine-failover slots beside the workers (docs/failover.md)
    expert_workers: int = 0  # disaggregated MoE (docs/moe.md): expert workers, with an ERT manager
    expert_copies: int = 1  # copies of each expert over the expert workers
    encoders: int = 0  # multimodal encoder pools
    checkpoint_stores: int = 1
    migrations: int = 1
    routers: int = 1
    gateways: int = 0
    healths: int = 1
    planner: bool = False
    hot_spares: int = 0  # with the planner: warm workers, not routed to, promoted when a worker dies
    nats: bool = True  # False: an external NATS
    etcd: bool = True  # False: an external etcd
    fork_server: bool = False  # workers forked from a pre-imported server (phalanx.launch.fork_server)

    def __post_init__(self) -> None:
        if self.expert_workers and not 1 <= self.expert_copies <= self.expert_workers:
            raise ValueError(f"{self.expert_copies} copies of each expert need as many expert workers ({self.expert_workers})")
        if self.hot_spares and not self.planner:
            raise ValueError("hot spares are promoted by the planner: a fleet with spares needs one")
        if any(group.count < 0 for group in self.workers):
            raise ValueError("a worker group cannot have fewer than 0 workers")

    @property
    def worker_count(self) -> int:
        """The engine workers of every role (failover slots and hot spares not counted)."""
        return sum(group.count for group in self.workers)

    def worker_specs(self) -> tuple[ProcessSpec, ...]:
        """Every engine worker, numbered across roles in the order of ``workers``."""
        roles = [group.role for group in self.workers for _ in range(group.count)]
        return tuple(ProcessSpec(ProcessKind.WORKER, i, role) for i, role in enumerate(roles))

    def phases(self) -> tuple[tuple[ProcessSpec, ...], ...]:
        """The processes in start order: a phase starts once the one before serves; a driver may start one phase's
        processes in parallel. Hot spares are not here: the planner's connector starts them once the fleet serves."""
        def many(kind: ProcessKind, count: int) -> tuple[ProcessSpec, ...]:
            return tuple(ProcessSpec(kind, i) for i in range(count))

        phases = (
            (*many(ProcessKind.NATS, int(self.nats)), *many(ProcessKind.ETCD, int(self.etcd))),
            many(ProcessKind.FORK_SERVER, int(self.fork_server)),
            (*many(ProcessKind.CHECKPOINT_STORE, self.checkpoint_stores), *many(ProcessKind.MIGRATION, self.migrations)),
            many(ProcessKind.ERT_MANAGER, int(self.expert_workers > 0)),
            many(ProcessKind.EXPERT_WORKER, self.expert_workers),
            many(ProcessKind.ENCODER, self.encoders),
            (*self.worker_specs(), *many(ProcessKind.FAILOVER_SLOT, self.failover_slots)),
            many(ProcessKind.ROUTER, self.routers),
            many(ProcessKind.GATEWAY, self.gateways),
            many(ProcessKind.HEALTH, self.healths),
            many(ProcessKind.PLANNER, int(self.planner)),
        )
        return tuple(phase for phase in phases if phase)

    def processes(self) -> tuple[ProcessSpec, ...]:
        """Every process of ``phases()``, in start order."""
        return tuple(spec for phase in self.phases() for spec in phase)
