"""The degradation level: healthy capacity against the SLOs, with hysteresis. Pure logic, no I/O.

Every DegradationConfig.interval_s the health service hands `DegradationPolicy`
what it knows of each registered worker (`WorkerCapacity`) and publishes the
`DegradationDecision` as common.v1.DegradationState.

Levels (routers shed, workers scale their batch, whatever judges latency relaxes it):

    0  normal
    1  workers run batches x0.75
    2  ... and routers shed best_effort
    3  ... batches x0.5, and the latency SLOs are relaxed x2: the health service's
          canary latency limit and the routers' TTFT/ITL SLO count (see
          latency_slo_factor)
    4  routers reject every new request (premium too, unless a router is told
       to serve premium at level 4) while the streams in flight finish

Pressure is demand over healthy capacity by the worst of four criteria (1.0:
exactly at the SLO), over workers that are routable and whose last load
report is fresh, a suspicious worker counting with its routing weight:

- throughput (when slo_tokens_per_s > 0): slo_tokens_per_s / sum of weight x
  capacity, capacity being worker_tokens_per_s when configured, else the
  worker's learned capacity (below);
- TPOT: mean step time per running sequence (sequences on a slow worker
  count for that worker) / slo_tpot_s;
- TTFT: estimated wait of a new request, (queue_depth + 1) x step_time (the
  requests queued ahead each need a step; the `+ 1` is its own prefill step,
  as in the router's cost model), on the best worker since the router sends
  new work there, / slo_ttft_s;
- KV: used share of the summed blocks / (1 - min_free_kv_fraction). Its
  ceiling is 1 / (1 - min_free_kv_fraction), so a full cache alone calls for
  level 1 (smaller batches need less KV); the queues a full cache builds show
  in TTFT.

Level 4 is for lost capacity, never for load alone. TPOT, TTFT and KV say the
fleet is busy: their pressure is capped just below level 4's threshold, so
ordinary overload (or a busy host whose steps slowed) reaches level 3 at most:
smaller batches, best_effort shed, relaxed latency SLOs, and standard and
premium requests admitted by each router's SLO-aware admission (phalanx.router.overload:
what can start within its SLOs is served, the rest refused fast), not refused wholesale. Refusing every
new request is for the fleet that cannot serve: no routable worker, or the
throughput SLO (a configured demand) beyond what the healthy workers can do.

Latency criteria always use the configured SLOs: the x2 from level 3 on is
what the deployment promises, reported in the decision; feeding it back in
would halve the pressure at level 3 and make the level flap.

Learned capacity (worker_tokens_per_s = 0). A worker reports decode_tokens_per_s,
an EMA of decode tokens per busy second, which grows with its batch: at
light load it says what the worker did, not what it can do. So each worker
keeps a peak:

- a report with requests waiting (queue_depth > 0) is a capacity
  measurement: the worker runs as much as it can. It marks the peak as
  proven, and the peak follows it down slowly: max(rate, peak x decay) with a
  PEAK_HALF_LIFE_S half-life, so a worker that got slower (throttled, a
  heavier prompt mix) loses credit over minutes, not at one noisy report;
- a report with no queue is a lower bound: the peak only rises, and idling
  never erodes it.

A worker with no proven peak counts as the median proven peak of the fleet
(or its own lower bound if higher); if no worker has been seen saturated, the
throughput criterion is left out ("not learned yet") rather than reading an
unmeasured fleet as no capacity, which at cold start would shed the very
traffic that would measure it. Peaks of workers no longer registered are
forgotten. For a firm model, configure worker_tokens_per_s.

The planner's view (when `planner_view` is on and the planner published one that is still fresh: written less than
its `valid_for_s` ago): its predicted demand over the serving fleet's capacity, from its performance profile
(planner.capacity). It is one more criterion, so the pressure is the larger of health's own and the planner's: health
sees what workers report now, the planner what its forecast says is coming. A stale view (a planner that stopped)
counts for nothing. A forecast alone reaches level 3 at most (its pressure is capped just below level 4's threshold):
shedding best_effort, smaller batches and relaxed SLOs while the planner adds workers are the right answer to a
predicted shortfall, refusing every request is not; level 4 takes health's own measurements.

Hysteresis: the level rises when the target level has stayed above it for
raise_after_s, to the lowest target seen during that hold (one spike at the
end of a hold does not take the fleet to level 4); it drops one step when
pressure has stayed below the current level's lower threshold x (1 -
lower_margin) for lower_after_s; each step restarts the timers. With no
routable, fresh worker at all, pressure is infinite and level 4 applies at
once. When routable workers come back after such an outage, the level goes
straight to what their measured pressure calls for: the forced level 4 was no
reading of load, so there is no noisy reading to guard against, and holding
it would refuse every request for minutes after the fleet recovered (a
one-worker stack whose worker was replaced, say).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from phalanx.health.config import DegradationConfig

# Pressure up to LEVEL_THRESHOLDS[k] calls for level k; above the last one, MAX_LEVEL.
LEVEL_THRESHOLDS = (1.0, 1.15, 1.4, 2.0)
MAX_LEVEL = len(LEVEL_THRESHOLDS)
# Load (the latency and KV criteria) and the planner's forecast stop short of level 4: it is for lost capacity (module
# docstring).
_BELOW_LEVEL_FOUR = LEVEL_THRESHOLDS[-1] * 0.999
BATCH_SCALE_LEVEL = 1
DEGRADED_BATCH_SCALE = 0.75
SHED_BEST_EFFORT_LEVEL = 2
RELAXED_SLO_LEVEL = 3
SLO_RELAX_FACTOR = 2.0
RELAXED_BATCH_SCALE = 0.5
SHED_STANDARD_LEVEL = 4
# What each level does, for metric help texts and logs (the router's own gauge says the same).
LEVELS_HELP = "0 normal, 1 batches x0.75, 2 also sheds best_effort, 3 batches x0.5 and latency SLOs x2, 4 rejects new requests"
PEAK_HALF_LIFE_S = 600.0


@dataclass(frozen=True)
class WorkerCapacity:
    """One registered worker as the health service sees it."""

    worker_id: str
    routable: bool  # health weight > 0 and not draining / dead
    weight: float  # 1.0 healthy, 0.5 suspicious
    decode_tokens_per_s: float  # from its last LoadReport (EMA measured by the worker)
    prefill_tokens_per_s: float
    step_time_s: float
    queue_depth: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    report_age_s: float  # seconds since its last LoadReport (inf if none)


@dataclass(frozen=True)
class DegradationDecision:
    level: int
    pressure: float
    reason: str  # which criterion dominated, with its numbers
    healthy_workers: int
    ttft_slo_s: float  # effective: the configured SLO, x2 from level 3 on
    tpot_slo_s: float
    batch_scale: float  # batch_scale(level)


def batch_scale(level: int) -> float:
    """Share of max_num_seqs workers admit at a level."""
    if level >= RELAXED_SLO_LEVEL:
        return RELAXED_BATCH_SCALE
    return DEGRADED_BATCH_SCALE if level >= BATCH_SCALE_LEVEL else 1.0


def latency_slo_factor(level: int) -> float:
    """How much the latency limits that judge the fleet stretch at a level (x2 from level 3 on)."""
    return SLO_RELAX_FACTOR if level >= RELAXED_SLO_LEVEL else 1.0


def target_level(pressure: float) -> int:
    """The level a pressure calls for, without hysteresis."""
    return sum(1 for threshold in LEVEL_THRESHOLDS if pressure > threshold)


@dataclass(frozen=True)
class PlannerView:
    """The planner's capacity-vs-demand view (common.v1.PlannerCapacityView) and how old it is."""

    pressure: float
    needed_workers: float
    serving_workers: int
    age_s: float  # since the planner wrote it (wall clocks of two hosts: a little skew either way is tolerated)
    valid_for_s: float

    @property
    def fresh(self) -> bool:
        return -self.valid_for_s <= self.age_s <= self.valid_for_s and math.isfinite(self.pressure) and self.pressure >= 0


@dataclass(frozen=True)
class _Criterion:
    name: str
    measured: float  # demand over capacity by this criterion
    detail: str
    ceiling: float = math.inf  # load criteria and the forecast stop short of level 4 (module docstring)

    @property
    def pressure(self) -> float:
        return min(self.measured, self.ceiling)


@dataclass
class _Peak:
    rate: float = 0.0
    proven: bool = False  # measured while requests waited: a capacity, not a lower bound


class DegradationPolicy:
    """Turns worker capacity into a degradation level; call evaluate() every interval."""

    def __init__(self, config: DegradationConfig, *, level: int = 0) -> None:
        self.config = config
        self.level = min(MAX_LEVEL, max(0, level))  # resumes from the level stored in etcd
        self._raise_since: float | None = None
        self._raise_to = MAX_LEVEL  # lowest target seen during the current raise hold
        self._lower_since: float | None = None
        self._peaks: dict[str, _Peak] = {}
        self._last_now: float | None = None
        self._outage = False  # the level was forced to MAX_LEVEL by no routable worker at all

    def evaluate(self, now: float, workers: Iterable[WorkerCapacity], planner: PlannerView | None = None) -> DegradationDecision:
        workers = list(workers)
        self._learn(now, workers)
        fresh = [w for w in workers if w.routable and w.weight > 0 and w.report_age_s <= self.config.report_stale_s]
        if not fresh:
            self.level = MAX_LEVEL
            self._outage = True
            self._raise_since = self._lower_since = None
            reason = f"no routable worker with a load report under {self.config.report_stale_s:g} s old ({len(workers)} registered)"
            return self._decision(math.inf, reason, 0)
        notes: list[str] = []
        criteria = [
            c for c in (self._throughput(fresh, len(workers), notes), self._tpot(fresh), self._ttft(fresh), self._kv(fresh), self._planner(planner))
            if c
        ]
        worst = max(criteria, key=lambda c: (c.pressure, c.measured), default=None)  # the most overloaded names the reason
        pressure = worst.pressure if worst else 0.0
        reason = f"{worst.name}: {worst.detail}" if worst else "no load"
        if self._outage:
            self._outage = False
            self.level = target_level(pressure)
            notes.append(f"{len(fresh)} routable worker(s) back after an outage: level set by their pressure")
        else:
            notes += self._step(now, pressure)
        return self._decision(pressure, "; ".join([reason, *notes]), len(fresh))

    # -- hysteresis ------------------------------------------------------------------
    def _step(self, now: float, pressure: float) -> list[str]:
        """Moves self.level by the hysteresis rules; returns a note on a pending move."""
        target = target_level(pressure)
        if target > self.level:
            self._lower_since = None
            if self._raise_since is None:
                self._raise_since, self._raise_to = now, target
            self._raise_to = min(self._raise_to, target)
            held = now - self._raise_since
            if held >= self.config.raise_after_s:
                self.level, self._raise_since = self._raise_to, None
                return []
            return [f"level {target} called for {held:.1f} of {self.config.raise_after_s:g} s"]
        self._raise_since = None
        if not self._may_lower(pressure):
            self._lower_since = None
            return []
        if self._lower_since is None:
            self._lower_since = now
        held = now - self._lower_since
        if held >= self.config.lower_after_s:
            self.level -= 1
            self._lower_since = now if self._may_lower(pressure) else None
            return []
        return [f"level {self.level - 1} allowed for {held:.1f} of {self.config.lower_after_s:g} s"]

    def _may_lower(self, pressure: float) -> bool:
        return self.level > 0 and pressure < LEVEL_THRESHOLDS[self.level - 1] * (1 - self.config.lower_margin)

    def _decision(self, pressure: float, reason: str, healthy: int) -> DegradationDecision:
        relax = latency_slo_factor(self.level)
        return DegradationDecision(
            level=self.level,
            pressure=pressure,
            reason=reason,
            healthy_workers=healthy,
            ttft_slo_s=self.config.slo_ttft_s * relax,
            tpot_slo_s=self.config.slo_tpot_s * relax,
            batch_scale=batch_scale(self.level),
        )

    # -- learned capacity ------------------------------------------------------------
    def _learn(self, now: float, workers: list[WorkerCapacity]) -> None:
        dt = 0.0 if self._last_now is None else max(0.0, now - self._last_now)
        self._last_now = now
        decay = 0.5 ** (dt / PEAK_HALF_LIFE_S)
        seen = {w.worker_id for w in workers}
        for worker_id in [k for k in self._peaks if k not in seen]:
            del self._peaks[worker_id]
        for w in workers:
            if not math.isfinite(w.report_age_s):
                continue
            peak = self._peaks.setdefault(w.worker_id, _Peak())
            rate = max(0.0, w.decode_tokens_per_s)
            if w.queue_depth > 0 and rate > 0:
                peak.rate = max(rate, peak.rate * decay) if peak.proven else max(rate, peak.rate)
                peak.proven = True
            else:
                peak.rate = max(rate, peak.rate)

    def learned_capacity(self, worker_id: str) -> float | None:
        """The decode tokens/s the throughput criterion credits a worker with; None while unknown."""
        peak = self._peaks.get(worker_id, _Peak())
        if peak.proven:
            return peak.rate
        proven = [p.rate for p in self._peaks.values() if p.proven]
        return max(peak.rate, statistics.median(proven)) if proven else None

    # -- criteria --------------------------------------------------------------------
    def _throughput(self, fresh: list[WorkerCapacity], registered: int, notes: list[str]) -> _Criterion | None:
        need = self.config.slo_tokens_per_s
        if need <= 0:
            return None
        capacity = 0.0
        for w in fresh:
            nominal = self.config.worker_tokens_per_s or self.learned_capacity(w.worker_id)
            if nominal is None:
                notes.append("throughput capacity not learned yet (no worker seen with requests waiting)")
                return None
            capacity += w.weight * nominal
        workers = f"{len(fresh)} of {registered} workers"
        if capacity <= 0:
            return _Criterion("throughput", math.inf, f"need {need:g} tok/s, healthy capacity 0 tok/s ({workers})")
        return _Criterion("throughput", need / capacity, f"need {need:g} tok/s, healthy capacity {capacity:.0f} tok/s ({workers})")

    def _planner(self, view: PlannerView | None) -> _Criterion | None:
        if view is None or not self.config.planner_view or not view.fresh:
            return None
        detail = f"predicted demand needs {view.needed_workers:.1f} workers, {view.serving_workers} serving"
        return _Criterion("planner", view.pressure, detail, _BELOW_LEVEL_FOUR)

    def _tpot(self, fresh: list[WorkerCapacity]) -> _Criterion | None:
        busy = [w for w in fresh if w.running_seqs > 0 and w.step_time_s > 0]
        seqs = sum(w.running_seqs for w in busy)
        if not seqs:
            return None
        mean = sum(w.running_seqs * w.step_time_s for w in busy) / seqs
        detail = f"mean step {mean * 1e3:.0f} ms over {seqs} running sequences, SLO {self.config.slo_tpot_s * 1e3:.0f} ms"
        return _Criterion("tpot", mean / self.config.slo_tpot_s, detail, _BELOW_LEVEL_FOUR)

    def _ttft(self, fresh: list[WorkerCapacity]) -> _Criterion | None:
        best = min(fresh, key=lambda w: (w.queue_depth + 1) * w.step_time_s)
        wait = (best.queue_depth + 1) * best.step_time_s
        if wait <= 0:
            return None
        detail = f"best estimated wait {wait:.2f} s ({best.worker_id}: {best.queue_depth} queued), SLO {self.config.slo_ttft_s:g} s"
        return _Criterion("ttft", wait / self.config.slo_ttft_s, detail, _BELOW_LEVEL_FOUR)

    def _kv(self, fresh: list[WorkerCapacity]) -> _Criterion | None:
        total = sum(w.total_blocks for w in fresh if w.total_blocks > 0)
        if not total:
            return None
        free = sum(min(max(w.free_blocks, 0), w.total_blocks) for w in fresh if w.total_blocks > 0)
        used = 1 - free / total
        limit = 1 - self.config.min_free_kv_fraction
        return _Criterion("kv", used / limit, f"{used:.0%} of {total} blocks used, limit {limit:.0%}", _BELOW_LEVEL_FOUR)
