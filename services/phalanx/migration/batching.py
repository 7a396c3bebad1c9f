"""Restores bound for the same target go together: one Restore call, one KV transfer, one engine command.

A worker's failure makes every one of its streams ask for a migration within
milliseconds. Sent one by one, each restore pays a gRPC call, a tensor
channel to the KV source and a step boundary on the target on its own, and
under that burst the fixed costs, not the bytes, make the stall. Items that
arrive within `window_s` of the first one, or while a call to the same
target is in flight, are sent in one call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class RestoreBatcher(Generic[Item, Result]):
    """Coalesces `submit(key, item)` calls with equal keys into `send(key, items)` calls, results back in order.

    `send` returns one result per item; when it raises, every item of that call gets the exception.
    """

    def __init__(self, send: Callable[[Hashable, list[Item]], Awaitable[list[Result]]], *, window_s: float = 0.005,
                 max_items: int = 64) -> None:  # fmt: skip
        if window_s < 0 or max_items < 1:
            raise ValueError("window_s must be >= 0 and max_items >= 1")
        self._send = send
        self.window_s = window_s
        self.max_items = max_items
        self._pending: dict[Hashable, list[tuple[Item, asyncio.Future[Result]]]] = {}
        self._senders: dict[Hashable, asyncio.Task] = {}
        self.calls = 0

    async def submit(self, key: Hashable, item: Item) -> Result:
        done: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append((item, done))
        if key not in self._senders:
            self._senders[key] = asyncio.create_task(self._drain(key), name=f"restore-batch-{key}")
        return await done

    async def _drain(self, key: Hashable) -> None:
        batch: list[tuple[Item, asyncio.Future[Result]]] = []
        try:
            await asyncio.sleep(self.window_s)
            while self._pending.get(key):
                waiting = self._pending[key]
                batch, self._pending[key] = waiting[: self.max_items], waiting[self.max_items :]
                batch = [(item, done) for item, done in batch if not done.cancelled()]
                if not batch:
                    continue
                self.calls += 1
                try:
                    results = await self._send(key, [item for item, _ in batch])
                except Exception as exc:  # every item of the call learns why
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                    continue
                for (_, done), result in zip(batch, results, strict=True):
                    if not done.done():
                        done.set_result(result)
        except asyncio.CancelledError:
            # Shutting down: nobody will send them, so nobody may wait for them.
            for _, done in batch + self._pending.get(key, []):
                done.cancel()
            raise
        finally:
            self._senders.pop(key, None)
            self._pending.pop(key, None)
