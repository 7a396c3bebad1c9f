"""Per-pool planning for a disaggregated fleet (docs/disagg.md, "Planner"). Pure, no I/O.

An aggregated fleet (every worker prefills and decodes) is one pool, sized by the replica maths' `combined` count. A
disaggregated fleet runs two: prefill workers, which compute prompts (TTFT drives them: `ReplicaPlan.prefill`, from the
prefill throughput and the prefill correction factor), and decode workers, which take the requests and generate (ITL
drives them: `ReplicaPlan.decode`, from the best decode throughput under the ITL target over the decode factor). Each
pool is clamped to its own bounds; the decode pool is the one requests are routed to, so surges, scale-down holds and
operator targets act on it, as on the aggregated pool. Each pool keeps its own hot spares (`hot_spares` for the decode
pool, `prefill_hot_spares` for the prefill pool), and a dead worker is restored from its own pool's spares.

Whether a fleet is disaggregated is the planner's setting (`disaggregated`), or, left unset, what is registered: a
fleet with a registered prefill worker is. A planner that once saw one keeps planning two pools (`FleetShape.of`):
the last prefill worker dying must not turn the fleet aggregated in the planner's eyes, it must be replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from phalanx.common.roles import PREFILL

__all__ = ["FleetPools", "FleetShape", "PoolBounds", "PoolCounts", "count_serving"]


@dataclass(frozen=True)
class PoolBounds:
    """The fewest and most workers a pool may be asked for."""

    min_workers: int
    max_workers: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"pool bounds [{self.min_workers}, {self.max_workers}]: need 0 <= min <= max")

    def clamp(self, workers: int) -> int:
        return min(max(workers, self.min_workers), self.max_workers)


@dataclass(frozen=True)
class PoolCounts:
    """Serving workers (registered, not failing, not spares) of each pool; `routed` counts every worker requests go to
    (decode, aggregated and attention workers)."""

    prefill: int
    routed: int


def count_serving(roles: Mapping[str, str], serving: Iterable[str]) -> PoolCounts:
    """`roles`: each registered worker's role; `serving`: the ids that count as serving capacity."""
    prefill = routed = 0
    for worker_id in serving:
        if roles.get(worker_id, "") == PREFILL:
            prefill += 1
        else:
            routed += 1
    return PoolCounts(prefill=prefill, routed=routed)


@dataclass(frozen=True)
class FleetShape:
    """Whether the planner plans two pools."""

    disaggregated: bool

    @classmethod
    def of(cls, setting: bool | None, roles: Iterable[str], *, before: FleetShape | None = None) -> FleetShape:
        """The setting when given; else disaggregated once a prefill worker is registered, and for good after that."""
        if setting is not None:
            return cls(disaggregated=setting)
        seen = any(role == PREFILL for role in roles)
        return cls(disaggregated=seen or (before is not None and before.disaggregated))


# Roles remembered of workers no longer registered: a DEAD worker's registration is gone when its death is handled.
_REMEMBERED_ROLES = 4096


class FleetPools:
    """The planner's view of its fleet's pools, updated from each poll's registrations (no I/O)."""

    def __init__(self, setting: bool | None, prefill: PoolBounds) -> None:
        self.setting = setting
        self.prefill_bounds = prefill
        self.shape = FleetShape.of(setting, ())
        self.counts = PoolCounts(prefill=0, routed=0)
        self._roles: dict[str, str] = {}

    @property
    def disaggregated(self) -> bool:
        return self.shape.disaggregated

    def update(self, roles: Mapping[str, str], serving: Iterable[str]) -> int:
        """Registered workers' `roles` and the `serving` ones among them; the routed workers that serve (every serving
        worker of an aggregated fleet, its decode workers in a disaggregated one)."""
        serving = list(serving)
        for worker_id, role in roles.items():
            self._roles.pop(worker_id, None)
            self._roles[worker_id] = role
        while len(self._roles) > _REMEMBERED_ROLES:
            del self._roles[next(iter(self._roles))]
        self.shape = FleetShape.of(self.setting, roles.values(), before=self.shape)
        self.counts = count_serving(self._roles, serving)
        return self.counts.routed if self.disaggregated else len(serving)

    def role(self, worker_id: str) -> str:
        """A worker's registered role ("" when never seen)."""
        return self._roles.get(worker_id, "")

    def prefill_target(self, planned: int | None, current: int | None) -> int | None:
        """The prefill pool's count a tick asks for: the plan's within the pool's bounds, else the target in force within
        them (no profile, no plan yet); None for an aggregated fleet."""
        if not self.disaggregated:
            return None
        if planned is not None:
            return self.prefill_bounds.clamp(planned)
        return self.prefill_bounds.clamp(current if current is not None else self.counts.prefill)
