"""Blocking torch calls off the event loop, on reused daemon threads.

gloo work has no completion callback, so a thread waits on each op: that
costs ~0.1-0.2 ms per op (a 4-byte round trip takes ~0.5 ms against ~0.1 ms
for bare gloo) and nothing on bulk transfers.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

class _DaemonPool:
    """Runs blocking calls on reused daemon threads.

    Not a ThreadPoolExecutor: it joins its threads at interpreter exit, and a
    gloo wait on a closed channel only returns at its timeout, which would
    hold up exit by that long. Not ``asyncio.to_thread`` either: the default
    executor has cpu+4 threads, which a few pending receives would exhaust.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._shut = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name} is shut down")
            if self._idle > 0:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        self._queue.put(fn)

    def _work(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()
            fn = None  # drop what the call held before idling
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Idle threads exit now, busy ones after their current call."""
        with self._lock:
            self._shut = True
            count = self._threads
        for _ in range(count):
            self._queue.put(None)


def _settle(waiter: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    if waiter.done():  # already failed by close() or cancelled
        return
    result, error = outcome
    if error is None:
        waiter.set_result(result)
    else:
        waiter.set_exception(error)


async def _in_thread(pool: _DaemonPool, fn: Callable[[], T], waiters: set[asyncio.Future[Any]] | None = None) -> T:
    """Run ``fn`` on ``pool``; ``waiters`` lets a closing channel fail the await without waiting for the thread."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()
    # Only the worker holds ``fn`` (and the process group it may bind): the
    # last reference to a group must go on a worker, since its destructor
    # blocks for tens of ms (and it is what closes the peer's sockets).
    box = [fn]
    del fn

    def run() -> None:
        call = box.pop()
        try:
            outcome: tuple[Any, BaseException | None] = (call(), None)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            # Without the traceback, whose frames would keep the group alive as long as the error.
            outcome = (None, error.with_traceback(None))
        del call
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, waiter, outcome)

    pool.submit(run)
    if waiters is None:
        return await waiter
    waiters.add(waiter)
    try:
        return await waiter
    finally:
        waiters.discard(waiter)

