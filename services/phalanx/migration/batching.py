"""Restores bound for the same target go together: one Restore call, one KV transfer, one engine command.

A worker's failure makes every one of its streams ask for a migration within
milliseconds. Sent one by one, each restore pays a gRPC call, a tensor
channel to the KV source and a step boundary on the target on its own, and
under that burst the fixed costs, not the bytes, make the stall. Items that
arrive within `window_s` of the first one are sent in one call. A call in
flight to the same target does not hold the next one back: the target takes
every restore that reached it before its next step boundary together, so a
later call can still make the boundary the first one waits for (held back,
it waited for that boundary and then for the step after it: measured at
load 10 on the 2-core dev box, 2026-11-26, that made the slowest streams of
a burst wait 0.2 s longer). The same burst shares its reads (`SharedCalls`)
and books what it sends to each target (`Reservations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from functools import partial
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Item = TypeVar("Item")
Result = TypeVar("Result")


class RestoreBatcher(Generic[Key, Item, Result]):
    """Coalesces `submit(key, item)` calls with equal keys into `send(key, items)` calls, results back in order.

    A batch opens with its first item and is sent `window_s` later (or once it holds `max_items`: the next item opens
    another); calls to one key may run at once. `send` returns one result per item; when it raises, every item of
    that call gets the exception.
    """

    def __init__(self, send: Callable[[Key, list[Item]], Awaitable[list[Result]]], *, window_s: float = 0.005,
                 max_items: int = 64) -> None:
        if window_s < 0 or max_items < 1:
            raise ValueError("window_s must be >= 0 and max_items >= 1")
        self._send = send
        self.window_s = window_s
        self.max_items = max_items
        self._open: dict[Key, list[tuple[Item, asyncio.Future[Result]]]] = {}
        self._senders: set[asyncio.Task] = set()
        self.calls = 0

    async def submit(self, key: Key, item: Item) -> Result:
        done: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = []
            sender = asyncio.create_task(self._send_after_window(key, batch), name=f"restore-batch-{key}")
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        batch.append((item, done))
        if len(batch) >= self.max_items and self._open.get(key) is batch:
            del self._open[key]  # full: the next item opens another batch
        return await done

    async def _send_after_window(self, key: Key, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            await asyncio.sleep(self.window_s)
        except asyncio.CancelledError:
            # Shutting down: nobody will send them, so nobody may wait for them.
            for _, done in batch:
                done.cancel()
            raise
        finally:
            if self._open.get(key) is batch:
                del self._open[key]
        # Not held back by a call to this key in flight: that one may be waiting for the target's step boundary,
        # and a later batch that arrives before it passes is taken at the same boundary.
        batch = [(item, done) for item, done in batch if not done.cancelled()]
        if not batch:
            return
        self.calls += 1
        try:
            results = await self._send(key, [item for item, _ in batch])
        except asyncio.CancelledError:
            for _, done in batch:
                done.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every item of the call learns why
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
        for (_, done), result in zip(batch, results, strict=True):
            if not done.done():
                done.set_result(result)


class SharedCalls(Generic[Result]):
    """Callers that ask for the same key while a call for it runs share that call's result.

    A failed worker's streams all ask for a migration within milliseconds, and
    each wants the same facts (the stores, the workers, the targets' load):
    one read serves them all instead of one per request on a host that the
    failure has just made busier. A result also serves callers up to `reuse_s`
    after it arrived; a failure serves only those that were waiting for it.
    """

    def __init__(self, *, reuse_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if reuse_s < 0:
            raise ValueError("reuse_s must be >= 0")
        self.reuse_s = reuse_s
        self._clock = clock
        self._calls: dict[Hashable, tuple[float, asyncio.Future[Result]]] = {}
        self.calls = 0

    async def get(self, key: Hashable, call: Callable[[], Awaitable[Result]]) -> Result:
        now = self._clock()
        for old in [k for k, (at, f) in self._calls.items() if f.done() and (f.exception() is not None or now - at > self.reuse_s)]:
            del self._calls[old]
        entry = self._calls.get(key)
        if entry is None:
            self.calls += 1
            future = asyncio.ensure_future(call())
            future.add_done_callback(partial(self._stamp, key))
            entry = self._calls[key] = (now, future)
        # Shielded: one caller going away must not cancel the read the others wait for.
        return await asyncio.shield(entry[1])

    def _stamp(self, key: Hashable, future: asyncio.Future[Result]) -> None:
        """A result is reused from when it arrived, not from when it was asked for."""
        if self._calls.get(key, (0.0, None))[1] is future:
            self._calls[key] = (self._clock(), future)


class Reservations:
    """Requests and KV blocks promised to each target by migrations whose restore has not finished.

    The targets' reported load lags behind the restores in flight; a burst
    priced against it alone would pile onto the one target that looked
    emptiest, and overrun its free blocks.
    """

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}  # target -> [requests, blocks]

    def of(self, target: str) -> tuple[int, int]:
        requests, blocks = self._held.get(target, (0, 0))
        return requests, blocks

    @contextlib.contextmanager
    def hold(self, target: str, blocks: int) -> Iterator[None]:
        held = self._held.setdefault(target, [0, 0])
        held[0] += 1
        held[1] += blocks
        try:
            yield
        finally:
            held[0] -= 1
            held[1] -= blocks
            if held[0] == 0:
                del self._held[target]
