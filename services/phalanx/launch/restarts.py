"""When `phalanx up`'s supervisor restarts a process that died, and when it gives up: a pure policy, like a Kubernetes
restart policy.

A process that exits is started again after a backoff that doubles with
each failure in a row (capped). One that then runs for ``stable_after_s``
has recovered: its next failure starts the count afresh. A process that
keeps dying at start-up, or soon after it (``crash_loop_limit`` times in a
row), is in a crash loop: restarting it again would only hide the cause, so
the supervisor stops and says which one and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0
    crash_loop_limit: int = 5

    @classmethod
    def from_env(cls) -> RestartPolicy:
        """Defaults, overridden by PHALANX_UP_RESTART_BACKOFF_S, _MAX_BACKOFF_S, _STABLE_AFTER_S and PHALANX_UP_CRASH_LOOP_LIMIT."""
        default = cls()
        try:
            return cls(
                initial_backoff_s=float(os.environ.get("PHALANX_UP_RESTART_BACKOFF_S", default.initial_backoff_s)),
                max_backoff_s=float(os.environ.get("PHALANX_UP_RESTART_MAX_BACKOFF_S", default.max_backoff_s)),
                stable_after_s=float(os.environ.get("PHALANX_UP_RESTART_STABLE_AFTER_S", default.stable_after_s)),
                crash_loop_limit=int(os.environ.get("PHALANX_UP_CRASH_LOOP_LIMIT", default.crash_loop_limit)),
            )
        except ValueError as error:
            raise ValueError(f"PHALANX_UP_RESTART_* / PHALANX_UP_CRASH_LOOP_LIMIT: {error}") from None

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.crash_loop_limit < 1:
            raise ValueError("crash_loop_limit must be >= 1")


@dataclass(frozen=True)
class RestartDecision:
    """Restart after ``delay_s`` seconds, or (``give_up``) stop: a crash loop."""

    delay_s: float
    give_up: bool
    failures_in_a_row: int


class RestartTracker:
    """One supervised process's failures, across its replacements."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0
        self._failures_in_a_row = 0
        self._ready_at: float | None = None

    def ready(self, now: float) -> None:
        """It (or its replacement) started and serves."""
        self._ready_at = now

    def exited(self, now: float) -> RestartDecision:
        """It exited after it was ready."""
        assert self._ready_at is not None, "exited() before ready()"
        early = now - self._ready_at < self.policy.stable_after_s
        self._ready_at = None
        return self._failed(early=early)

    def failed_to_start(self) -> RestartDecision:
        """A replacement died or timed out before it was ready."""
        return self._failed(early=True)

    def _failed(self, *, early: bool) -> RestartDecision:
        self._failures_in_a_row = self._failures_in_a_row + 1 if early else 1
        failures = self._failures_in_a_row
        give_up = early and failures >= self.policy.crash_loop_limit
        if not give_up:
            self.restarts += 1
        delay = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2 ** (failures - 1))
        return RestartDecision(delay_s=delay, give_up=give_up, failures_in_a_row=failures)
