"""Which worker deaths already started a migration: bounded memory, no I/O.

The health service publishes a worker's DEAD record more than once (each
status change and re-publication), and each would start ``migrate_worker``
again. One migration per worker incarnation (worker id and start time) is
enough; the memory of it outlives the migration by ``forget_after_s`` to
absorb late repeats, and at most ``max_entries`` incarnations are kept so a
long-lived service with a churning fleet stays small.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DeadWorker", "TriggerMemory"]


@dataclass(frozen=True)
class DeadWorker:
    """One incarnation of a worker: a restarted worker with the same id is another one."""

    worker_id: str
    started_at: float


class TriggerMemory:
    """Claims each DEAD incarnation once; forgets it ``forget_after_s`` after its migration finished."""

    def __init__(self, *, forget_after_s: float = 600.0, max_entries: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if forget_after_s < 0 or max_entries < 1:
            raise ValueError("forget_after_s must be >= 0 and max_entries >= 1")
        self._forget_after_s = forget_after_s
        self._max_entries = max_entries
        self._clock = clock
        # Oldest claim first; the value is when to forget it, None while its migration runs.
        self._entries: OrderedDict[DeadWorker, float | None] = OrderedDict()

    def claim(self, worker: DeadWorker) -> bool:
        """True if this incarnation's death starts a migration now; False if one started already."""
        self._prune()
        if worker in self._entries:
            return False
        self._entries[worker] = None
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)  # at worst a very old death is migrated twice: a no-op then
        return True

    def finished(self, worker: DeadWorker) -> None:
        """The incarnation's migration ended (done or failed): forget it after ``forget_after_s``."""
        if worker in self._entries:
            self._entries[worker] = self._clock() + self._forget_after_s

    def __len__(self) -> int:
        self._prune()
        return len(self._entries)

    def __contains__(self, worker: object) -> bool:
        self._prune()
        return worker in self._entries

    def _prune(self) -> None:
        now = self._clock()
        for worker in [w for w, forget_at in self._entries.items() if forget_at is not None and forget_at <= now]:
            del self._entries[worker]
