"""Busy or broken: how much slower than its idle self a worker's canary may be because of its load. Pure logic, no I/O.

A canary goes through the worker's normal scheduler: it is one more sequence of the running batch, so it takes about
(its tokens + 1) x the batch's step time. A worker with a big batch, or on a host whose CPUs other processes hold,
steps slower and answers its canary slower, and that is load, not a fault. So the latency limit of a canary
(health/state.py) is judged against the worker's own step time, taken from its NATS load reports (``LoadReport``:
``step_time_ms``, ``running_seqs``, ``queue_depth``, every ~100 ms), not against an idle baseline alone.

Not every slow step is load. A worker keeps, per load level (held requests 1, 2-3, 4-7, ...: powers of two), the step
time it usually takes (``StepModel``, learned from its own reports). A step is *explained* when it is no slower than
what the worker's load level and the host (``fleet_excess``: the median of how much slower than their own usual steps
its peers step right now) account for. The canary's allowance (``stretch``) is the explained part only:

    stretch = min(step_now, usual_step(level) x max(1, fleet_excess)) / usual_step(idle level)

So a worker that steps slowly for its load while its peers do not (a throttled GPU, a ``slow`` fault) gets no
allowance and fails its canaries as before; a worker with a big batch gets the slowdown its batch brings; when every
worker is equally slow (a busy host) each one gets it from its peers. A worker that makes no progress at all (a hang)
is told apart by its engine counters (health/schedule.py, ``stuck_with_work``) and by its reports: the step-time
average moves with every step, so one that holds work and stays put for ``stall_s`` (or 3 of its own recent steps, if
longer) took no step. Such a worker is not ``progressing`` and gets no allowance; one whose steps visibly move is, and
a missed canary on it is confirmed instead of counted (a starved host can hold a whole step for a second). Wrong
tokens are the canary judge's, a crash the lease's and stream's, and no allowance touches them.

The usual step of a level is learned from samples no slower than ``learn_factor`` x the usual one: a step that
suddenly takes twice as long (a fault, or a busy host: the peers explain that one) is not learned as the new usual,
a faster one always is, and a slow drift is followed. An unseen level is bounded by a
lower seen one scaled with the batch (a step of 2n sequences costs at most twice one of n), or by a higher one; a
worker whose last step at a level it knows was unexplained gets no credit for the growth (a slowed worker piles up
requests: the batch it piled up must not excuse it).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.health.config import HealthConfig

__all__ = ["FleetLoad", "LoadPolicy", "LoadVerdict", "StepModel", "load_level"]

_STALL_STEPS = 3.0
# The workers' step-time average weighs a new step 0.1 (worker/engine_frontend.py): 20 steps after a change of load it
# shows 88% of the change. Until a load level has held that long (and at least _SETTLE_S), its reports are neither
# learned nor taken for slowness.
_SETTLE_STEPS = 20
_SETTLE_S = 2.0


def load_level(held: int) -> int:
    """The load level of a worker holding ``held`` requests (running and queued): 0 for at most 1, then log2."""
    return max(0, held.bit_length() - 1)


@dataclass(frozen=True)
class LoadPolicy:
    enabled: bool = True
    learn_factor: float = 1.5
    max_stretch: float = 20.0
    stale_s: float = 2.0
    stall_s: float = 0.5
    alpha: float = 0.1

    @classmethod
    def from_config(cls, config: HealthConfig) -> LoadPolicy:
        return cls(
            enabled=config.load_aware, learn_factor=config.load_learn_factor, max_stretch=config.load_max_stretch,
            stale_s=config.load_report_stale_s, stall_s=config.load_stall_s,
        )


@dataclass
class StepModel:
    """One worker's usual step time (seconds) per load level."""

    usual_s: dict[int, float] = field(default_factory=dict)

    def expected_s(self, level: int, *, grow: bool = True) -> float | None:
        """The usual step at ``level``: learned, or bounded from the nearest learned level (with the batch's growth
        only if ``grow``); None before any."""
        if level in self.usual_s:
            return self.usual_s[level]
        lower = [seen for seen in self.usual_s if seen < level]
        if lower:
            seen = max(lower)
            return self.usual_s[seen] * (2 ** (level - seen) if grow else 1)
        higher = [seen for seen in self.usual_s if seen > level]
        return self.usual_s[min(higher)] if higher else None

    def learn(self, level: int, step_s: float, alpha: float) -> None:
        usual = self.usual_s.get(level)
        self.usual_s[level] = step_s if usual is None else (1 - alpha) * usual + alpha * step_s


@dataclass(frozen=True)
class LoadVerdict:
    """How a worker's latest load report explains its pace."""

    stretch: float  # the canary's latency allowance for load, x its idle baseline (1: none)
    excess: float  # its step time over its usual one at its load level (1: as usual)
    fleet_excess: float  # the median excess of its peers (1: as usual, or no fresh peers)
    level: int = 0

    @property
    def busy(self) -> bool:
        return self.stretch > 1.0

    def describe(self) -> str:
        return f"load level {self.level}, steps {self.excess:.1f}x usual, peers {self.fleet_excess:.1f}x, allowance x{self.stretch:.1f}"


NO_LOAD = LoadVerdict(1.0, 1.0, 1.0)


@dataclass
class _Worker:
    group: str  # peers are the workers of one group (a model version)
    model: StepModel = field(default_factory=StepModel)
    step_s: float = 0.0
    level: int = 0
    excess: float = 1.0
    at: float = float("-inf")
    # Last report whose step time moved, or that held nothing: the engine's step-time average changes with every step,
    # so one that holds work and reports the same figure for long took no step (hung, or one step longer than that).
    moved_at: float = float("-inf")
    # Its last report at a load level it knows was slower than that level and its peers explain: until one is not,
    # a level it does not know gets no credit for the batch's growth (a slowed worker piles up requests, and the
    # bigger batch must not excuse the slowness that piled them up).
    suspect: bool = False
    level_since: float = float("-inf")  # when the current load level began


class FleetLoad:
    """Every worker's latest load and usual steps; ``on_report`` feeds it, ``verdict`` judges one worker now."""

    def __init__(self, policy: LoadPolicy) -> None:
        self.policy = policy
        self._workers: dict[str, _Worker] = {}

    def on_report(self, worker_id: str, group: str, *, step_s: float, held: int, now: float) -> None:
        """One LoadReport of a worker (``held``: running plus queued), received at ``now``."""
        w = self._workers.get(worker_id)
        if w is None or w.group != group:
            w = self._workers[worker_id] = _Worker(group)
        if step_s <= 0:
            return  # no step taken yet: nothing to learn or judge
        level = load_level(held)
        expected = w.model.expected_s(level, grow=not w.suspect)
        # The report's step time is an average over the last steps: it lags a change of load. A level met for the
        # first time therefore starts at its bound, and only a load that held a while is learned or says whether the
        # worker is slow for it (just after a busy spell ends, the average still says busy; just after it began, idle).
        if level != w.level or w.at == float("-inf"):
            w.level_since = now
        stable = now - w.level_since >= max(_SETTLE_S, _SETTLE_STEPS * step_s)
        if expected is not None and level not in w.model.usual_s:
            w.model.usual_s[level] = expected
        if expected is not None and stable:
            w.suspect = step_s > self.policy.learn_factor * expected * self.fleet_excess(worker_id, now)
        if held == 0 or step_s != w.step_s:
            w.moved_at = now
        w.step_s, w.level, w.at = step_s, level, now
        w.excess = step_s / expected if expected else 1.0
        # Not stretched by the peers' slowdown: learned, a busy host's pace would become the usual one, and the
        # allowance (relative to the idle pace the canary baseline was learned at) would vanish while the host stays busy.
        if expected is None or (stable and step_s <= self.policy.learn_factor * expected):
            w.model.learn(level, step_s, self.policy.alpha)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def usual_steps(self, worker_id: str) -> dict[int, float]:
        """The worker's learned usual step per load level (persisted with its health record)."""
        w = self._workers.get(worker_id)
        return dict(w.model.usual_s) if w is not None else {}

    def seed(self, worker_id: str, group: str, usual_steps: Mapping[int, float]) -> None:
        """Start from what a previous health instance learned of the worker: without it, a successor's first report of
        a busy worker would be learned as its usual pace and its idle pace bounded from it, so the busy worker's
        canaries would get no allowance against the idle-pace baseline the successor also resumes from."""
        w = self._workers.get(worker_id)
        if (w is None or w.group != group or not w.model.usual_s) and usual_steps:
            self._workers[worker_id] = _Worker(group, StepModel({int(level): s for level, s in usual_steps.items() if s > 0}))

    def fleet_excess(self, worker_id: str, now: float) -> float:
        """How much slower than usual the worker's peers step right now (1.0 without fresh peers).

        The lower median: with two peers, one of them slow is that peer's business, not the host's.
        """
        w = self._workers.get(worker_id)
        if w is None:
            return 1.0
        peers = [p.excess for pid, p in self._workers.items() if pid != worker_id and p.group == w.group and self._fresh(p, now)]
        return max(1.0, statistics.median_low(peers)) if peers else 1.0

    def verdict(self, worker_id: str, now: float) -> LoadVerdict:
        """The allowance the worker's canary gets for its load and the host's, from its latest fresh report."""
        w = self._workers.get(worker_id)
        if not self.policy.enabled or w is None or not self._fresh(w, now):
            return NO_LOAD
        if self._stalled(w, now):
            return LoadVerdict(1.0, w.excess, 1.0, w.level)  # no step for a while: no progress, so no allowance
        return self._explained(worker_id, w, w.step_s, w.level, now)

    def canary_verdict(self, worker_id: str, *, step_s: float, held: int, now: float) -> LoadVerdict:
        """The allowance a canary's own answer earns: the load it met, as the worker reported with the answer (``held``:
        the most requests it ran beside; ``step_s``: the mean time of the steps it ran in), explained as a report's is.

        The reports' step time is an average that lags a batch that just began by some 20 steps; a canary sent at
        once runs at the new batch's pace and would be judged against the old one. Its answer says what it met.
        """
        w = self._workers.get(worker_id)
        if not self.policy.enabled or w is None or step_s <= 0 or held <= 0:
            return NO_LOAD
        return self._explained(worker_id, w, step_s, load_level(held), now)

    def _explained(self, worker_id: str, w: _Worker, step_s: float, level: int, now: float) -> LoadVerdict:
        """The part of ``step_s`` at ``level`` that the worker's usual steps and its peers' slowdown explain."""
        idle = w.model.expected_s(0)
        usual = w.model.expected_s(level, grow=not w.suspect)
        fleet = min(self.fleet_excess(worker_id, now), self.policy.max_stretch)
        excess = step_s / usual if usual else 1.0
        if not idle or not usual:
            return LoadVerdict(1.0, excess, fleet, level)
        explained = min(step_s, usual * fleet)
        stretch = min(self.policy.max_stretch, max(1.0, explained / idle))
        return LoadVerdict(stretch, excess, fleet, level)

    def progressing(self, worker_id: str, now: float) -> bool:
        """Its reports are fresh and its steps move (or it holds nothing): the process and its engine are alive.

        A liveness probe or a canary that times out on such a worker says it is busy, not that it is stuck.
        """
        w = self._workers.get(worker_id)
        return self.policy.enabled and w is not None and self._fresh(w, now) and not self._stalled(w, now)

    def host_stalled(self, worker_id: str, now: float) -> bool:
        """None of the worker's peers makes progress either (each stalled, or silent): the host stalled, not the worker.

        A hang is one engine's; a host whose CPUs other processes hold can stop every worker on it for a second, and a
        worker's missed canary then looks like a hang without being one. False without peers (a lone worker cannot
        tell the two apart).
        """
        w = self._workers.get(worker_id)
        if not self.policy.enabled or w is None:
            return False
        peers = [pid for pid, p in self._workers.items() if pid != worker_id and p.group == w.group]
        return bool(peers) and not any(self.progressing(pid, now) for pid in peers)

    def _stalled(self, w: _Worker, now: float) -> bool:
        """It holds work and its step-time average has not moved for ``stall_s``, or for ``_STALL_STEPS`` of its own
        recent steps if those are longer (a starved host's steps can take a second; a hang takes no step at all)."""
        return now - w.moved_at > max(self.policy.stall_s, _STALL_STEPS * w.step_s)

    def _fresh(self, w: _Worker, now: float) -> bool:
        return now - w.at <= self.policy.stale_s
