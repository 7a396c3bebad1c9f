"""One worker's health classification and circuit breaker. Pure logic, no I/O.

Classification: HEALTHY (weight 1.0) -> 1 failure -> SUSPICIOUS (0.5) ->
``unhealthy_after`` consecutive failures -> UNHEALTHY (0, drain it) ->
DRAINING (its requests finish or move; it takes none) until a half-open
canary passes (-> HEALTHY) or it dies (-> DEAD). A passing check brings
SUSPICIOUS back to HEALTHY.

Circuit: CLOSED -> ``failure_threshold`` consecutive failures -> OPEN (no
checks) -> after ``recovery_s`` HALF_OPEN (one canary) -> CLOSED if it
passes (weight 1.0 again), OPEN for another period if not.

Only evidence about the worker counts: a check whose outcome is
INCONCLUSIVE (the checker's own mistake, deliberate backpressure) changes
nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, IntEnum, StrEnum
from typing import TYPE_CHECKING, cast

from phalanx._proto import common_pb2

if TYPE_CHECKING:
    from phalanx.health.config import HealthConfig

__all__ = ["CheckOutcome", "CheckResult", "Circuit", "FailureReason", "Health", "TrackerPolicy", "Transition", "WorkerTracker"]


class Health(IntEnum):
    """Values of phalanx.common.v1.WorkerHealth."""

    HEALTHY = common_pb2.WORKER_HEALTH_HEALTHY
    SUSPICIOUS = common_pb2.WORKER_HEALTH_SUSPICIOUS
    UNHEALTHY = common_pb2.WORKER_HEALTH_UNHEALTHY
    DRAINING = common_pb2.WORKER_HEALTH_DRAINING
    DEAD = common_pb2.WORKER_HEALTH_DEAD

    @property
    def label(self) -> str:
        return self.name.lower()


class Circuit(IntEnum):
    """Values of phalanx.common.v1.CircuitState."""

    CLOSED = common_pb2.CIRCUIT_STATE_CLOSED
    OPEN = common_pb2.CIRCUIT_STATE_OPEN
    HALF_OPEN = common_pb2.CIRCUIT_STATE_HALF_OPEN

    @property
    def label(self) -> str:
        return self.name.lower()


WEIGHTS = {Health.HEALTHY: 1.0, Health.SUSPICIOUS: 0.5}


class CheckResult(Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


class FailureReason(StrEnum):
    """Why a check failed. The values are what etcd records (``last_failure`` starts with one), metrics label and alert
    rules match: keep them."""

    TIMEOUT = "timeout"  # no answer within the deadline
    TOKEN_MISMATCH = "token_mismatch"  # tokens other than the calibrated ones: silent corruption
    LOGIT_OUT_OF_RANGE = "logit_out_of_range"  # the right tokens, but a top logit outside its calibrated range
    LATENCY = "latency"  # a correct answer, slower than the latency limit
    UNREACHABLE = "unreachable"  # the connection failed (after the retries)
    ERROR = "error"  # any other error status
    PROBE_TIMEOUT = "probe_timeout"  # after a broken stream, no liveness answer within the probe timeout
    INCONCLUSIVE = "inconclusive"  # not a failure: the checker's own mistake or backpressure, which counts for nothing


@dataclass(frozen=True)
class CheckOutcome:
    result: CheckResult
    reason: FailureReason | None = None  # None when it passed
    detail: str = ""
    latency_s: float | None = None
    # The allowance the canary's own answer earned for the load it met (health/load.py, ``canary_verdict``): its
    # latency is judged against the larger of it and the allowance of the worker's load reports, which lag.
    load_factor: float = 1.0

    @classmethod
    def passed(cls, latency_s: float) -> CheckOutcome:
        return cls(CheckResult.PASS, latency_s=latency_s)

    @classmethod
    def failed(cls, reason: FailureReason | str, detail: str = "", latency_s: float | None = None, load_factor: float = 1.0) -> CheckOutcome:
        return cls(CheckResult.FAIL, FailureReason(reason), detail, latency_s, load_factor)

    @classmethod
    def inconclusive(cls, detail: str) -> CheckOutcome:
        return cls(CheckResult.INCONCLUSIVE, FailureReason.INCONCLUSIVE, detail)

    @property
    def timed_out(self) -> bool:
        return self.reason is FailureReason.TIMEOUT


@dataclass(frozen=True)
class TrackerPolicy:
    unhealthy_after: int = 3
    failure_threshold: int = 3
    recovery_s: float = 60.0
    latency_factor: float = 3.0
    latency_slack_s: float = 0.05
    ema_alpha: float = 0.1
    peer_factor: float = 2.0

    @classmethod
    def from_config(cls, config: HealthConfig) -> TrackerPolicy:
        return cls(
            unhealthy_after=config.unhealthy_after, failure_threshold=config.circuit_failure_threshold,
            recovery_s=config.circuit_recovery_s, latency_factor=config.latency_factor,
            latency_slack_s=config.latency_slack_s, ema_alpha=config.latency_ema_alpha,
        )


@dataclass(frozen=True)
class Transition:
    """A change worth writing: the record changed; maybe the worker must be drained or re-admitted."""

    old: Health
    new: Health
    reason: str
    drain: bool = False  # quarantine it (Drain keep_running)
    undrain: bool = False  # re-admit it (Undrain)


class WorkerTracker:
    def __init__(self, worker_id: str, policy: TrackerPolicy, *, worker_started_at: float = 0.0) -> None:
        self.worker_id = worker_id
        self.policy = policy
        self.worker_started_at = worker_started_at
        self.health = Health.HEALTHY
        self.circuit = Circuit.CLOSED
        self.consecutive_failures = 0
        self.reason = "registered"
        self.last_failure = ""
        self.last_failure_at = 0.0
        self.circuit_opened_at = 0.0
        self.baseline_s = 0.0
        self.last_check_at = 0.0
        self.version = 0
        self.updated_at = 0.0
        self.half_open_in_flight = False
        self.last_ratio = 1.0
        self.last_ratio_at = float("-inf")

    # -- restore / persist ----------------------------------------------------------
    @classmethod
    def from_record(cls, record: common_pb2.WorkerHealthRecord, policy: TrackerPolicy) -> WorkerTracker:
        """A tracker that continues where a previous health instance left off."""
        t = cls(record.worker_id, policy, worker_started_at=record.worker_started_at)
        if record.health:
            t.health = Health(record.health)
        if record.circuit:
            t.circuit = Circuit(record.circuit)
        if t.circuit is Circuit.HALF_OPEN:
            t.circuit = Circuit.OPEN  # its one call died with the previous instance: due again at once
        t.consecutive_failures = record.consecutive_failures
        t.reason = record.reason
        t.last_failure, t.last_failure_at = record.last_failure, record.last_failure_at
        t.circuit_opened_at = record.circuit_opened_at
        t.baseline_s = record.latency_baseline_s
        t.last_check_at = record.last_check_at
        t.version = record.version
        t.updated_at = record.updated_at
        return t

    def to_record(self) -> common_pb2.WorkerHealthRecord:
        return common_pb2.WorkerHealthRecord(
            worker_id=self.worker_id, health=cast(common_pb2.WorkerHealth, int(self.health)), routing_weight=self.weight, reason=self.reason,
            updated_at=self.updated_at, circuit=cast(common_pb2.CircuitState, int(self.circuit)), consecutive_failures=self.consecutive_failures,
            last_failure=self.last_failure, last_failure_at=self.last_failure_at, circuit_opened_at=self.circuit_opened_at,
            latency_baseline_s=self.baseline_s, version=self.version, worker_started_at=self.worker_started_at,
            last_check_at=self.last_check_at,
        )

    # -- what the checker asks ------------------------------------------------------
    @property
    def weight(self) -> float:
        return WEIGHTS.get(self.health, 0.0)

    def latency_limit_s(self, fleet_slowdown: float = 1.0, slo_factor: float = 1.0, load_factor: float = 1.0) -> float | None:
        """Slowest passing canary; None until a baseline exists.

        ``latency_factor`` x the baseline, and ``peer_factor`` x what the
        worker's healthy peers take right now relative to their own baselines
        (``fleet_slowdown``, 1.0: as usual). When the whole fleet slows down
        together (a load spike, a busy host) no single worker is at fault and
        taking them all out would turn a spike into an outage; a worker that is
        slow while its peers are not still fails at 3x its baseline. All of it
        x ``slo_factor``: the latency SLOs relaxed by the degradation level.

        The baseline is the worker's idle pace; ``load_factor`` (health/load.py) is how much slower its own load and
        the host's make its steps right now, so a canary queued in a big batch is judged against that batch's pace.
        """
        if self.baseline_s <= 0:
            return None
        b, p = self.baseline_s * max(1.0, load_factor), self.policy
        return max(1.0, slo_factor) * max(b * p.latency_factor, b * p.peer_factor * max(1.0, fleet_slowdown), b + p.latency_slack_s)

    def next_half_open_at(self) -> float | None:
        """When the open circuit allows its half-open call (None when not open)."""
        return self.circuit_opened_at + self.policy.recovery_s if self.circuit is Circuit.OPEN else None

    def may_check(self, now: float) -> bool:
        """Whether a canary may go out now; moves an open circuit whose time came to HALF_OPEN."""
        if self.health is Health.DEAD:
            return False
        if self.circuit is Circuit.CLOSED:
            return True
        if self.circuit is Circuit.OPEN and now >= self.circuit_opened_at + self.policy.recovery_s:
            self.circuit = Circuit.HALF_OPEN
            self.half_open_in_flight = False
        if self.circuit is Circuit.HALF_OPEN and not self.half_open_in_flight:
            self.half_open_in_flight = True
            return True
        return False

    # -- evidence -------------------------------------------------------------------
    def judge_latency(
        self, outcome: CheckOutcome, fleet_slowdown: float = 1.0, slo_factor: float = 1.0, load_factor: float = 1.0
    ) -> CheckOutcome:
        """A passing canary slower than the latency limit is a failure (``latency``)."""
        load_factor = max(load_factor, outcome.load_factor)
        limit = self.latency_limit_s(fleet_slowdown, slo_factor, load_factor)
        if outcome.result is not CheckResult.PASS or outcome.latency_s is None or limit is None or outcome.latency_s <= limit:
            return outcome
        fleet = f", peers {fleet_slowdown:.1f}x slower than usual" if fleet_slowdown > 1.0 else ""
        relaxed = f", SLOs relaxed x{slo_factor:g}" if slo_factor > 1.0 else ""
        loaded = f", x{load_factor:.1f} for its load" if load_factor > 1.0 else ""
        return CheckOutcome.failed(
            FailureReason.LATENCY,
            f"canary took {outcome.latency_s * 1e3:.0f} ms, over {limit * 1e3:.0f} ms "
            f"({self.policy.latency_factor:g}x the {self.baseline_s * 1e3:.0f} ms baseline{loaded}{fleet}{relaxed})",
            outcome.latency_s, outcome.load_factor,
        )

    def note_latency(self, latency_s: float | None, now: float, load_factor: float = 1.0) -> None:
        """Remember how this canary compared with the baseline at its load, for peers' fleet_slowdown (a peer slowed by
        its own batch says nothing about the host)."""
        if latency_s is not None and self.baseline_s > 0:
            self.last_ratio, self.last_ratio_at = latency_s / (self.baseline_s * max(1.0, load_factor)), now

    def observe(
        self, outcome: CheckOutcome, now: float | None = None, *, fleet_slowdown: float = 1.0, slo_factor: float = 1.0,
        load_factor: float = 1.0,
    ) -> Transition | None:
        """Apply one check; returns the transition if the record changed in a way routing cares about."""
        now = time.time() if now is None else now
        if self.health is Health.DEAD:
            return None
        load_factor = max(load_factor, outcome.load_factor)
        self.note_latency(outcome.latency_s, now, load_factor)
        half_open = self.circuit is Circuit.HALF_OPEN
        self.half_open_in_flight = False
        if outcome.result is CheckResult.INCONCLUSIVE:
            return None
        self.last_check_at = now
        outcome = self.judge_latency(outcome, fleet_slowdown, slo_factor, load_factor)
        if outcome.result is CheckResult.PASS:
            return self._passed(outcome, now, half_open, load_factor)
        return self._failed(outcome, now, half_open)

    def _passed(self, outcome: CheckOutcome, now: float, half_open: bool, load_factor: float = 1.0) -> Transition | None:
        if outcome.latency_s is not None:
            # The baseline stays the idle pace: a canary slowed by its batch counts as what it would take idle.
            latency = outcome.latency_s / max(1.0, load_factor)
            a = self.policy.ema_alpha
            self.baseline_s = latency if self.baseline_s <= 0 else (1 - a) * self.baseline_s + a * latency
        self.consecutive_failures = 0
        old = self.health
        if half_open:
            self.circuit = Circuit.CLOSED
            return self._move(Health.HEALTHY, "half-open canary passed: circuit closed", now, undrain=old is not Health.HEALTHY)
        if old is Health.SUSPICIOUS:
            return self._move(Health.HEALTHY, "canary passed", now)
        return None

    def _failed(self, outcome: CheckOutcome, now: float, half_open: bool) -> Transition | None:
        self.consecutive_failures += 1
        self.last_failure = f"{outcome.reason}: {outcome.detail}" if outcome.detail else str(outcome.reason)
        self.last_failure_at = now
        old = self.health
        if half_open:
            self.circuit, self.circuit_opened_at = Circuit.OPEN, now
            return self._touch(now, f"half-open canary failed ({outcome.reason}): circuit open again")
        if self.circuit is Circuit.CLOSED and self.consecutive_failures >= self.policy.failure_threshold:
            self.circuit, self.circuit_opened_at = Circuit.OPEN, now
        if self.consecutive_failures >= self.policy.unhealthy_after and old in (Health.HEALTHY, Health.SUSPICIOUS):
            return self._move(
                Health.UNHEALTHY, f"{self.consecutive_failures} consecutive failed checks (last: {outcome.reason})", now, drain=True
            )
        if old is Health.HEALTHY:
            return self._move(Health.SUSPICIOUS, f"failed check: {outcome.reason}", now)
        return self._touch(now, self.reason)

    def draining(self, now: float | None = None) -> Transition | None:
        """The quarantine began (an UNHEALTHY worker was asked to drain)."""
        if self.health is not Health.UNHEALTHY:
            return None
        return self._move(Health.DRAINING, "unhealthy: drained, admitting nothing until a half-open canary passes", now)

    def worker_stopping(self, now: float | None = None) -> Transition | None:
        """The worker itself stopped serving (SIGTERM drain): no traffic, but no fault either."""
        if self.health not in (Health.HEALTHY, Health.SUSPICIOUS):
            return None
        return self._move(Health.DRAINING, "the worker is shutting down", now)

    def worker_serving(self, now: float | None = None) -> Transition | None:
        """The worker serves again after it said it was stopping (and no fault holds it out)."""
        if self.health is not Health.DRAINING or self.circuit is not Circuit.CLOSED:
            return None
        return self._move(Health.HEALTHY, "the worker serves again", now)

    def mark_dead(self, reason: str, now: float | None = None) -> Transition | None:
        if self.health is Health.DEAD:
            return None
        now = time.time() if now is None else now
        self.last_failure, self.last_failure_at = reason, now
        return self._move(Health.DEAD, reason, now)

    def _move(self, new: Health, reason: str, now: float | None, *, drain: bool = False, undrain: bool = False) -> Transition:
        old = self.health
        self.health = new
        self._touch(time.time() if now is None else now, reason)
        return Transition(old, new, reason, drain=drain, undrain=undrain)

    def _touch(self, now: float, reason: str) -> Transition:
        self.reason = reason
        self.updated_at = now
        self.version += 1
        return Transition(self.health, self.health, reason)
