"""When the checkpoint store spills and when it drops instead: a failing disk's outage, with no I/O.

A spill that fails (ENOSPC, any OSError) starts an outage, reported once; until ``retry_s`` after the last failure,
what would spill is dropped at once, and from then on the disk is tried again (and the requests whose KV was dropped
are asked to resync). A spill that works ends the outage.
"""

from __future__ import annotations

__all__ = ["SpillOutage"]


class SpillOutage:
    """Whether spilling fails, and when the disk is tried again (clock times are the store's)."""

    def __init__(self, retry_s: float) -> None:
        self.retry_s = retry_s
        self.failures = 0  # spills that failed, in all
        # Set while spilling fails: the clock time of the next try (before it, what would spill is dropped at once).
        self.retry_at: float | None = None

    @property
    def failing(self) -> bool:
        """Whether the last spill failed (and none worked since)."""
        return self.retry_at is not None

    def waiting(self, now: float) -> bool:
        """Whether ``now`` is before the next try of the disk: what would spill is dropped without a try."""
        return self.retry_at is not None and now < self.retry_at

    def failed(self, now: float) -> bool:
        """A spill failed at ``now``; True if that starts an outage (once per outage: on a full disk every segment past the
        memory limit would report it)."""
        self.failures += 1
        started = self.retry_at is None
        self.retry_at = now + self.retry_s
        return started

    def worked(self) -> bool:
        """A spill worked; True if that ends an outage."""
        ended = self.retry_at is not None
        self.retry_at = None
        return ended
