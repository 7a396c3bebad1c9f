"""The expert routing table (ERT) of a disaggregated MoE deployment, its placement and its updates: pure, no I/O.

An ERT maps each logical expert (layer, expert) to the expert worker (EW)
that computes it, its primary, and the EWs that take over, in order, when
the primary is lost: shadows (preloaded, idle) and replicas. Every change
bumps its version; attention workers (AWs) keep the newest version they saw.

`place` spreads the experts of a model over M EWs with K extra copies, each
copy on a different EW. `ErtManager` is the state machine the ERT manager
leader runs: EW joins and losses in, the new table (or None when nothing
changed) out. The table is stored in etcd as the JSON of the
`phalanx.expert.v1.ExpertRoutingTable` message (`to_proto`/`from_proto`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from phalanx._proto import expert_pb2
from phalanx.common.errors import PhalanxError, UnavailableError

ExpertKey = tuple[int, int]  # (layer, expert)


class ErtError(PhalanxError, ValueError):
    """A placement or table that cannot be built as asked (a setting to fix)."""

    reason = "INVALID_CONFIG"


class NoExpertHostError(UnavailableError):
    """No live EW hosts this expert: every copy was lost. Recoverable once an EW hosting it joins."""

    reason = "NO_EXPERT_HOST"

    def __init__(self, layer: int, expert: int) -> None:
        super().__init__(f"no live expert worker hosts layer {layer} expert {expert}", retry_after_s=1.0)
        self.layer = layer
        self.expert = expert


class ExpertRole(enum.IntEnum):
    PRIMARY = expert_pb2.EXPERT_ROLE_PRIMARY
    SHADOW = expert_pb2.EXPERT_ROLE_SHADOW
    REPLICA = expert_pb2.EXPERT_ROLE_REPLICA


@dataclass(frozen=True, order=True)
class HostedExpert:
    layer: int
    expert: int
    role: ExpertRole

    @property
    def key(self) -> ExpertKey:
        return (self.layer, self.expert)


@dataclass(frozen=True)
class ExpertWorkerRef:
    """Where an AW reaches an EW: its control path (gRPC) and its tensor-channel endpoint."""

    worker_id: str
    address: str
    channel_endpoint: str


@dataclass(frozen=True)
class ExpertLocation:
    primary: str
    shadows: tuple[str, ...] = ()
    # Every copy is an active replica: `resolve` spreads over the live hosts instead of taking the first.
    replicated: bool = False

    @property
    def hosts(self) -> tuple[str, ...]:
        """Every live EW hosting the expert, in takeover order (empty when none)."""
        return (self.primary, *self.shadows) if self.primary else ()


@dataclass(frozen=True)
class ExpertRoutingTable:
    version: int
    model: str
    num_layers: int
    num_experts: int
    workers: Mapping[str, ExpertWorkerRef] = field(default_factory=dict)
    locations: Mapping[ExpertKey, ExpertLocation] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every expert of every layer has a live host."""
        return all(self.locations.get((layer, expert), _NOWHERE).primary for layer in range(self.num_layers) for expert in range(self.num_experts))

    def resolve(self, layer: int, expert: int, exclude: Iterable[str] = ()) -> str:
        """The EW that computes (layer, expert): its first host not in `exclude`, or for replicated experts one of the
        live replicas, spread by expert (every AW picks the same, so the EWs can batch their calls); NoExpertHostError if
        none is left."""
        excluded = set(exclude)
        location = self.locations.get((layer, expert), _NOWHERE)
        live = [host for host in location.hosts if host not in excluded]
        if not live:
            raise NoExpertHostError(layer, expert)
        if location.replicated:
            return live[(layer * self.num_experts + expert) % len(live)]
        return live[0]

    def experts_of(self, worker_id: str) -> list[ExpertKey]:
        """The experts for which `worker_id` is the primary."""
        return sorted(key for key, location in self.locations.items() if location.primary == worker_id)

    def to_proto(self) -> expert_pb2.ExpertRoutingTable:
        return expert_pb2.ExpertRoutingTable(
            version=self.version,
            model=self.model,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            workers=[
                expert_pb2.ExpertWorkerRef(worker_id=w.worker_id, address=w.address, channel_endpoint=w.channel_endpoint)
                for _, w in sorted(self.workers.items())
            ],
            locations=[
                expert_pb2.ExpertLocation(
                    layer=layer, expert=expert, primary=location.primary, shadows=list(location.shadows), replicated=location.replicated
                )
                for (layer, expert), location in sorted(self.locations.items())
            ],
        )

    @classmethod
    def from_proto(cls, message: expert_pb2.ExpertRoutingTable) -> ExpertRoutingTable:
        return cls(
            version=message.version,
            model=message.model,
            num_layers=message.num_layers,
            num_experts=message.num_experts,
            workers={w.worker_id: ExpertWorkerRef(w.worker_id, w.address, w.channel_endpoint) for w in message.workers},
            locations={(loc.layer, loc.expert): ExpertLocation(loc.primary, tuple(loc.shadows), loc.replicated) for loc in message.locations},
        )


_NOWHERE = ExpertLocation(primary="")


def place(num_layers: int, num_experts: int, num_workers: int, copies: int = 1, *, replicas: bool = False) -> list[list[HostedExpert]]:
    """What EW i of `num_workers` hosts: every expert `copies` times (1 primary + copies-1 shadows, or with `replicas`
    `copies` equal active replicas), each copy on another EW.

    Primaries go round-robin over the flattened (layer, expert) list, so every
    EW holds the same number (±1) and consecutive experts of a layer land on
    different EWs; copy j of an expert sits j EWs further on.
    """
    if num_layers < 1 or num_experts < 1:
        raise ErtError("a placement needs at least one layer and one expert")
    if num_workers < 1:
        raise ErtError(f"need at least one expert worker, got {num_workers}")
    if not 1 <= copies <= num_workers:
        raise ErtError(f"{copies} copies of each expert need as many expert workers, have {num_workers}")
    hosted: list[list[HostedExpert]] = [[] for _ in range(num_workers)]
    for layer in range(num_layers):
        for expert in range(num_experts):
            first = (layer * num_experts + expert) % num_workers
            for copy in range(copies):
                role = ExpertRole.REPLICA if replicas else ExpertRole.PRIMARY if copy == 0 else ExpertRole.SHADOW
                hosted[(first + copy) % num_workers].append(HostedExpert(layer, expert, role))
    return [sorted(h) for h in hosted]


# -- the manager's state machine ---------------------------------------------------------------
@dataclass(frozen=True)
class ExpertWorkerJoined:
    """An EW registered (or re-registered) with the experts it holds."""

    worker: ExpertWorkerRef
    hosted: tuple[HostedExpert, ...]


@dataclass(frozen=True)
class ExpertWorkerLost:
    """An EW is gone: its lease lapsed, or an AW found it dead."""

    worker_id: str


ErtEvent = ExpertWorkerJoined | ExpertWorkerLost


class ErtManager:
    """Keeps the ERT in step with the live EWs: `apply(event)` returns the new table, or None when it did not change.

    The copy placed as primary leads while it lives, so the load spreads as
    `place` spread it; when it goes, its first shadow takes over. A joining
    EW takes the place its copies have in the placement: a shadow behind
    the live primaries, a primary for the experts it was placed to lead (a
    replacement in a lost EW's slot takes its load back), the only host of
    experts nobody else holds.
    """

    def __init__(self, model: str, num_layers: int, num_experts: int, *, version: int = 0) -> None:
        self._members: dict[str, tuple[ExpertWorkerRef, dict[ExpertKey, ExpertRole]]] = {}
        self.table = ExpertRoutingTable(version=version, model=model, num_layers=num_layers, num_experts=num_experts)

    def apply(self, event: ErtEvent) -> ExpertRoutingTable | None:
        if isinstance(event, ExpertWorkerJoined):
            bad = [h for h in event.hosted if not (0 <= h.layer < self.table.num_layers and 0 <= h.expert < self.table.num_experts)]
            if bad:
                raise ErtError(f"{event.worker.worker_id} hosts experts outside the model: {bad[:3]}")
            self._members[event.worker.worker_id] = (event.worker, {h.key: h.role for h in event.hosted})
        elif self._members.pop(event.worker_id, None) is None:
            return None
        return self._rebuild()

    def _rebuild(self) -> ExpertRoutingTable | None:
        old = self.table
        hosts_of: dict[ExpertKey, list[tuple[ExpertRole, str]]] = {}
        for worker_id, (_, hosted) in self._members.items():
            for key, role in hosted.items():
                hosts_of.setdefault(key, []).append((role, worker_id))
        locations: dict[ExpertKey, ExpertLocation] = {}
        for key, hosts in hosts_of.items():
            previous = old.locations.get(key, _NOWHERE).hosts
            # Copies placed as primaries before shadows (the placement spreads the load that way); within a role,
            # the order AWs already know (a live primary stays primary), then newcomers by id.
            rank = {worker_id: i for i, worker_id in enumerate(previous)}
            order = [w for _, _, w in sorted((role, rank.get(w, len(previous)), w) for role, w in hosts)]
            replicated = all(role == ExpertRole.REPLICA for role, _ in hosts)
            locations[key] = ExpertLocation(order[0], tuple(order[1:]), replicated)
        workers = {worker_id: ref for worker_id, (ref, _) in self._members.items()}
        if locations == dict(old.locations) and workers == dict(old.workers):
            return None
        self.table = replace(old, version=old.version + 1, workers=workers, locations=locations)
        return self.table
