"""Which running requests to move onto new capacity: pure, no I/O (the migration service's rebalancer executes it).

A request stays on the worker it started on, however busy that worker gets. When a fleet grows under load (the
planner scaled up, a replacement or a promoted hot spare came), the new workers get only new requests, while the
requests already running on the loaded ones keep their long step times to the end: in `phalanx bench planner` a
burst's requests ran at 0.6-0.67 s per token on 3-4 workers after the new workers were up. The rebalancer moves some
of them through the same path a drain uses (the source parks them with their KV, the router's relay asks the
migration service to move each, the target continues from the next index), so no token is lost or repeated and a
greedy output stays the same.

`RebalancePolicy.plan` takes a snapshot of every worker's load and returns moves, bounded:

- a **source** is loaded: over the ITL target (its step time) or with requests queued, not draining, not a hot
  spare, and has not been a source or target of a move within ``cooldown_s``;
- a **target** is new capacity: it became routable (registered, or promoted from spare: the caller says so with
  `arrived`) while some worker was loaded, or at most ``arrival_window_s`` before one was (`observe`: the load
  reports' step time is an average over steps that lags a burst's onset by a second or more, so capacity that came
  with the burst may arrive before the burst shows), at most ``new_capacity_s`` ago (0: any worker), itself not
  loaded (nothing queued, its step time within ``target_load`` of the ITL target) and not a source or target within
  ``cooldown_s`` (its load report must show what it took before it takes more);
- a move never makes the target busier than the source it relieves (requests counted, running and queued, with
  the moves planned so far), so two workers never trade requests back and forth;
- at most ``max_moves_per_worker`` requests leave a source and reach a target per round;
- a request moved within ``request_memory_s`` is not moved again (the worker is told to skip it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Move", "RebalancePolicy", "RebalanceSettings", "WorkerLoad"]


@dataclass(frozen=True)
class RebalanceSettings:
    itl_target_s: float
    new_capacity_s: float = 15.0
    target_load: float = 0.8
    max_moves_per_worker: int = 4
    cooldown_s: float = 3.0
    request_memory_s: float = 30.0
    arrival_window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.itl_target_s <= 0 or self.max_moves_per_worker < 1 or min(
            self.new_capacity_s, self.cooldown_s, self.request_memory_s, self.arrival_window_s
        ) < 0:
            raise ValueError(f"invalid rebalance settings: {self}")
        if not 0 < self.target_load <= 1:
            raise ValueError("target_load must be in (0, 1]")


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as the rebalancer sees it: its latest load report, and since when it is routable (monotonic s)."""

    worker_id: str
    running: int
    queued: int
    step_time_s: float
    routable_since: float
    draining: bool = False
    spare: bool = False

    @property
    def requests(self) -> int:
        return self.running + self.queued

    def loaded(self, itl_target_s: float) -> bool:
        return self.queued > 0 or self.step_time_s > itl_target_s


@dataclass(frozen=True)
class Move:
    """Park up to `count` requests of `source` and restore them on `target`."""

    source: str
    target: str
    count: int


class RebalancePolicy:
    """Plans moves from loaded workers onto new capacity and remembers what moved (cool-downs, moved requests) and
    which workers are new capacity since when."""

    def __init__(self, settings: RebalanceSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._busy_until: dict[str, float] = {}  # worker -> end of its cool-down
        self._moved: dict[str, float] = {}  # request id -> when it may move again
        self._arrivals: dict[str, float] = {}  # worker -> when it became routable, while no load was seen since
        self._new_since: dict[str, float] = {}  # worker that is new capacity -> when it became routable

    def plan(self, workers: Iterable[WorkerLoad]) -> list[Move]:
        s, now = self.settings, self._clock()
        self._forget(now)
        serving = [w for w in workers if not w.draining and not w.spare and self._busy_until.get(w.worker_id, 0.0) <= now]
        sources = sorted((w for w in serving if w.loaded(s.itl_target_s) and w.requests >= 2), key=lambda w: -w.requests)
        targets = [
            w for w in serving
            if (s.new_capacity_s <= 0 or now - w.routable_since <= s.new_capacity_s)
            and w.queued == 0 and w.step_time_s <= s.target_load * s.itl_target_s
        ]
        load = {w.worker_id: w.requests for w in [*sources, *targets]}
        received = dict.fromkeys(load, 0)
        moves: list[Move] = []
        for source in sources:
            left = s.max_moves_per_worker
            while left > 0:
                options = [t for t in targets if t.worker_id != source.worker_id and received[t.worker_id] < s.max_moves_per_worker
                           and load[t.worker_id] + 1 <= load[source.worker_id] - 1]
                if not options:
                    break
                target = min(options, key=lambda t: (load[t.worker_id], t.worker_id))
                # Even them out: after the move the target holds no more than the source.
                count = min(left, (load[source.worker_id] - load[target.worker_id]) // 2,
                            s.max_moves_per_worker - received[target.worker_id])
                moves.append(Move(source.worker_id, target.worker_id, count))
                load[source.worker_id] -= count
                load[target.worker_id] += count
                received[target.worker_id] += count
                left -= count
        return _merged(moves)

    def under_load(self, workers: Iterable[WorkerLoad]) -> bool:
        """Whether some serving worker is loaded: capacity that comes now (or came within arrival_window_s) is new."""
        return any(w.loaded(self.settings.itl_target_s) for w in workers if not w.draining and not w.spare)

    def arrived(self, worker_id: str, workers: Iterable[WorkerLoad]) -> None:
        """`worker_id` became routable now (registered, or promoted from spare); `workers`: the fleet's load now."""
        self._new_since.pop(worker_id, None)
        self._arrivals[worker_id] = self._clock()
        self.observe(workers)

    def left(self, worker_id: str) -> None:
        """`worker_id` is gone (unregistered)."""
        self._arrivals.pop(worker_id, None)
        self._new_since.pop(worker_id, None)

    def observe(self, workers: Iterable[WorkerLoad]) -> None:
        """The fleet's latest load: if some worker is loaded, the workers that became routable at most
        arrival_window_s ago are new capacity, since they became routable. Capacity that came longer before any load
        showed (a fleet starting, a scale-up well ahead of its load) is left to routing."""
        now = self._clock()
        window = self.settings.arrival_window_s
        loaded = self.under_load(workers)
        for worker_id, at in list(self._arrivals.items()):
            if loaded and now - at <= window:
                self._new_since[worker_id] = at
            if loaded or now - at > window:
                del self._arrivals[worker_id]

    def new_since(self, worker_id: str) -> float:
        """When `worker_id`, if it is new capacity, became routable; -inf if it is not (yet)."""
        return self._new_since.get(worker_id, float("-inf"))

    def started(self, moves: Sequence[Move]) -> None:
        """The moves are being carried out: their workers cool down from now."""
        until = self._clock() + self.settings.cooldown_s
        for move in moves:
            self._busy_until[move.source] = self._busy_until[move.target] = until

    def moved(self, request_ids: Iterable[str]) -> None:
        """These requests left their worker: none of them moves again within request_memory_s."""
        until = self._clock() + self.settings.request_memory_s
        for request_id in request_ids:
            self._moved[request_id] = until

    def recently_moved(self) -> frozenset[str]:
        self._forget(self._clock())
        return frozenset(self._moved)

    def _forget(self, now: float) -> None:
        self._moved = {r: t for r, t in self._moved.items() if t > now}
        self._busy_until = {w: t for w, t in self._busy_until.items() if t > now}


def _merged(moves: list[Move]) -> list[Move]:
    """One move per (source, target), in planning order."""
    counts: dict[tuple[str, str], int] = {}
    for move in moves:
        counts[move.source, move.target] = counts.get((move.source, move.target), 0) + move.count
    return [Move(source, target, count) for (source, target), count in counts.items()]
