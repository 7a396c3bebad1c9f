"""Which waiting migration goes next: the most important request first, then the one that waited longest."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

STANDARD = 2


def effective_priority(*candidates: int) -> int:
    """The first set priority among `candidates` (RequestState.priority values); standard when none is."""
    return next((p for p in candidates if p > 0), STANDARD)


class PriorityGate:
    """At most `slots` holders at once; waiters get in by (priority, arrival), lower priority values first.

    A worker's failure queues all its requests at once: premium ones must be restored before best-effort ones,
    whether they came through the health service's DEAD event or through routers whose streams broke.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self._free = slots
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # granted just as it was cancelled: pass the slot on
            raise

    def _release(self) -> None:
        while self._waiters:
            _, _, granted = heapq.heappop(self._waiters)
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1
