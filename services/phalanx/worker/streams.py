"""Each request's output, kept by the worker apart from the gRPC calls that read it.

A router relaying a stream may die mid-request, and the worker cannot tell
that from a client giving up. So a request runs on when its last reader goes
(for `detach_grace_s`, then it is aborted), and its events stay in a log
that a new reader (Attach, or Generate retried with the same id) reads from
any index. Finished logs are kept for `retain_s` (at most `max_retained`
of them, and at most `max_retained_bytes` of them by estimate: a count alone
lets long outputs hold gigabytes) so that a late reader still gets the tail. Plain asyncio, no gRPC and no
engine: unit tests drive it with hand-made events.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator

from phalanx.common.errors import InvalidRequestError
from phalanx.worker.sequence import FinishReason, TokenEvent

__all__ = ["LogCursor", "RequestLog", "RequestStreams"]

# What one TokenEvent in a log costs in memory beside its text (measured with tracemalloc: the slotted instance, its
# list slot and a short str object), and one token id of a hand-back snapshot (an int object and its list slot).
EVENT_BYTES = 248
SNAPSHOT_TOKEN_BYTES = 36
# An event's log-probabilities (tracemalloc too): per position, and per token in it (the chosen one and each alternative).
LOGPROB_POSITION_BYTES = 50
LOGPROB_TOKEN_BYTES = 155


class RequestLog:
    """One request's events: its tokens in index order, then how it ended.

    It is the request's event sink too: the engine's dispatcher calls
    `put_nowait` on the event loop, which costs one list append and one
    wakeup per token however many readers there are.
    """

    def __init__(self, request_id: str, first_index: int = 0, on_event: Callable[[TokenEvent], None] | None = None) -> None:
        self.request_id = request_id
        # A resumed request's indices continue from the tokens delivered elsewhere.
        self.first_index = first_index
        self.tokens: list[TokenEvent] = []
        # The final event: the last token's (LENGTH, STOP) or a no-token one (ABORTED, HANDED_BACK, an error).
        self.end: TokenEvent | None = None
        self.readers = 0
        self.ended_at = 0.0
        self._on_event = on_event
        self._on_end: Callable[[RequestLog], None] | None = None
        self._changed = asyncio.Event()
        self._watchers: list[Callable[[], None]] = []

    @property
    def finished(self) -> bool:
        return self.end is not None

    def estimated_bytes(self) -> int:
        """Memory its events hold, by estimate (EVENT_BYTES each plus their text; a hand-back's snapshot by its tokens)."""
        events = [*self.tokens, self.end] if self.end is not None and self.end.index < 0 else self.tokens
        total = sum(EVENT_BYTES + len(e.text) for e in events)
        for e in events:
            scored = ([e.logprobs] if e.logprobs is not None else []) + (e.prompt_logprobs or [])
            total += sum(LOGPROB_POSITION_BYTES + LOGPROB_TOKEN_BYTES * (1 + len(p.top)) for p in scored)
        handoff = self.end.handoff if self.end is not None else None
        if handoff is not None:
            total += SNAPSHOT_TOKEN_BYTES * (len(handoff.prompt_ids) + len(handoff.output_ids)) + len(handoff.generator_state)
        return total

    def put_nowait(self, event: TokenEvent) -> None:
        """Appends an event; events after the final one are dropped (it ended here first, e.g. cancelled)."""
        if self.end is not None:
            return
        if self._on_event is not None:
            self._on_event(event)
        if event.index >= 0:
            self.tokens.append(event)
        if event.finish_reason is not FinishReason.NONE:
            self.end = event
            if self._on_end is not None:
                self._on_end(self)
        self._notify()

    def seed(self, events: list[TokenEvent]) -> None:
        """Starts the log with tokens produced elsewhere (a migrated request); not counted as generated here."""
        if self.tokens or self.end is not None or self.first_index:
            raise ValueError(f"the log of {self.request_id} is not empty")
        self.tokens.extend(events)
        self._notify()

    def close(self, reason: FinishReason = FinishReason.ABORTED, error: Exception | None = None) -> None:
        """Ends the log here, with no token, unless it has ended already."""
        self.put_nowait(TokenEvent(self.request_id, -1, "", -1, reason, error=error))

    def cursor(self, from_index: int) -> LogCursor:
        """A reader from `from_index` that takes what is new when told, with no task of its own (see LogCursor)."""
        return LogCursor(self, from_index)

    def watch(self, on_change: Callable[[], None]) -> None:
        """Calls `on_change` after every change of the log (a token, the end), until `unwatch`."""
        self._watchers.append(on_change)

    def unwatch(self, on_change: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._watchers.remove(on_change)

    def _notify(self) -> None:
        self._changed.set()
        for watcher in self._watchers:
            watcher()

    async def read(self, from_index: int) -> AsyncIterator[TokenEvent]:
        """Yields the tokens from `from_index` on (waiting for those not made yet), then the end.

        The end is the last token's event when it finished the request and
        this reader got it; otherwise a no-token event with the reason (and,
        when handed back, the state to continue from). Raises the engine's
        error if the request failed.
        """
        cursor = self.cursor(from_index)
        while True:
            events, error = cursor.take()
            for event in events:
                yield event
            if error is not None:
                raise error
            if cursor.done:
                return
            if not events:
                # No await between take() and the wait: no wakeup is missed.
                self._changed.clear()
                await self._changed.wait()


class LogCursor:
    """Where one reader is in a log: `take()` returns what it has not had yet.

    The same order and ending as `RequestLog.read`, for a caller that is
    told of changes (`RequestLog.watch`) and takes them in batches, e.g. one
    stream that carries many requests' tokens.
    """

    def __init__(self, log: RequestLog, from_index: int) -> None:
        if from_index < log.first_index:
            raise InvalidRequestError("from_index", f"this request's output starts at index {log.first_index} on this worker")
        self.log = log
        self._start = self._pos = from_index - log.first_index
        self.done = False

    def take(self) -> tuple[list[TokenEvent], Exception | None]:
        """The events not taken yet, and the error to end with after them; `done` once the end was taken."""
        if self.done:
            return [], None
        log = self.log
        tokens = log.tokens
        pos = self._pos
        events = tokens[pos:] if pos < len(tokens) else []
        self._pos = pos + len(events)
        end = log.end
        if end is None:
            return events, None
        self.done = True
        if end.error is not None:
            return events, end.error
        if self._pos > len(tokens):
            return events, InvalidRequestError("from_index", f"the request ended after {log.first_index + len(tokens)} tokens")
        if end.index < 0:
            events.append(end)
        elif self._start >= len(tokens):  # the reader already had the last token, but not the news that it was the last
            events.append(TokenEvent(log.request_id, -1, "", -1, end.finish_reason))
        return events, None


class RequestStreams:
    """The worker's request logs by id: running ones, then finished ones for a while.

    `abort(request_id)` is how a request is stopped in the engine (freeing
    its KV): called on Cancel and when a detached request's grace runs out.
    """

    def __init__(
        self,
        *,
        abort: Callable[[str], None],
        detach_grace_s: float = 15.0,
        retain_s: float = 30.0,
        max_retained: int = 10_000,
        max_retained_bytes: int = 256 << 20,
        on_detach: Callable[[], None] | None = None,
        on_detach_timeout: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.detach_grace_s = detach_grace_s
        self.retain_s = retain_s
        self.max_retained = max_retained
        self.max_retained_bytes = max_retained_bytes
        self._abort = abort
        self._on_detach = on_detach
        self._on_detach_timeout = on_detach_timeout
        self._clock = clock
        self._running: dict[str, RequestLog] = {}
        # Finished logs in the order they ended, which is also the order they expire in.
        self._retained: OrderedDict[str, RequestLog] = OrderedDict()
        self._retained_sizes: dict[str, int] = {}  # each retained log's estimated_bytes, taken when it ended
        self._retained_bytes = 0
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._closed = False

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_retained(self) -> int:
        self._expire()
        return len(self._retained)

    @property
    def retained_bytes(self) -> int:
        """Estimated memory of the finished logs kept (at most max_retained_bytes)."""
        self._expire()
        return self._retained_bytes

    def get(self, request_id: str) -> RequestLog | None:
        """The log of a request running here or finished recently; None once forgotten."""
        log = self._running.get(request_id)
        if log is None:
            self._expire()
            log = self._retained.get(request_id)
        return log

    def start(self, request_id: str, *, first_index: int = 0, on_event: Callable[[TokenEvent], None] | None = None) -> RequestLog:
        """A new log for a request about to be submitted to the engine (hand the log to it as the sink)."""
        if self.get(request_id) is not None:
            raise ValueError(f"request {request_id!r} already has a log")
        log = RequestLog(request_id, first_index, on_event)
        log._on_end = self._ended
        self._running[request_id] = log
        return log

    def start_migrated(self, request_id: str, *, on_event: Callable[[TokenEvent], None] | None = None) -> RequestLog:
        """A log for a request migrated here; replaces a finished one (it may have run here before).

        Nobody reads it yet: the detach grace starts at once, so a request nobody attaches to is aborted.
        """
        old = self.get(request_id)
        if old is not None:
            if not old.finished:
                raise ValueError(f"request {request_id!r} is running here already")
            self._forget(old)
        log = self.start(request_id, on_event=on_event)
        if not self._closed:
            self._timers[request_id] = asyncio.get_running_loop().call_later(self.detach_grace_s, self._detach_timeout, log)
        return log

    def discard(self, log: RequestLog, error: Exception) -> None:
        """The request failed admission: forget it, and end its readers with `error`."""
        self._forget(log)
        log.close(FinishReason.ABORTED, error)

    @contextlib.contextmanager
    def reader(self, log: RequestLog) -> Iterator[RequestLog]:
        """Counts a reader of `log` for as long as the block runs; the last one out starts the detach grace."""
        timer = self._timers.pop(log.request_id, None)
        if timer is not None:
            timer.cancel()
        log.readers += 1
        try:
            yield log
        finally:
            log.readers -= 1
            if log.readers == 0 and not log.finished and not self._closed and self._running.get(log.request_id) is log:
                self._timers[log.request_id] = asyncio.get_running_loop().call_later(self.detach_grace_s, self._detach_timeout, log)
                if self._on_detach is not None:
                    self._on_detach()

    def cancel(self, request_id: str) -> bool:
        """Aborts a request at once (its readers end with ABORTED) and forgets it; False if unknown."""
        log = self.get(request_id)
        if log is None:
            return False
        self._forget(log)
        if not log.finished:
            log.close(FinishReason.ABORTED)
            self._abort(request_id)
        return True

    def close(self) -> None:
        """At shutdown: stops every timer and ends the logs still open (their readers see ABORTED); idempotent."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for log in list(self._running.values()):
            log.close(FinishReason.ABORTED)
        self._running.clear()

    # -- internals ----------------------------------------------------------
    def _detach_timeout(self, log: RequestLog) -> None:
        self._timers.pop(log.request_id, None)
        if log.readers or log.finished:
            return
        if self._on_detach_timeout is not None:
            self._on_detach_timeout()
        # Ended here first, so that the engine's own ABORTED (or a token still in flight) is dropped;
        # the log is kept like any finished one, so a late reader learns the request was aborted.
        log.close(FinishReason.ABORTED)
        self._abort(log.request_id)

    def _ended(self, log: RequestLog) -> None:
        timer = self._timers.pop(log.request_id, None)
        if timer is not None:
            timer.cancel()
        if self._running.get(log.request_id) is not log:
            return  # forgotten already (cancelled, failed admission)
        del self._running[log.request_id]
        log.ended_at = self._clock()
        size = log.estimated_bytes()
        self._retained[log.request_id] = log
        self._retained_sizes[log.request_id] = size
        self._retained_bytes += size
        while self._retained and (len(self._retained) > self.max_retained or self._retained_bytes > self.max_retained_bytes):
            self._drop_oldest()
        self._expire()

    def _drop_oldest(self) -> None:
        request_id, _ = self._retained.popitem(last=False)
        self._retained_bytes -= self._retained_sizes.pop(request_id)

    def _expire(self) -> None:
        retained = self._retained
        if not retained:
            return
        horizon = self._clock() - self.retain_s
        while retained:
            oldest = next(iter(retained.values()))
            if oldest.ended_at > horizon:
                break
            self._drop_oldest()

    def _forget(self, log: RequestLog) -> None:
        log._on_end = None
        timer = self._timers.pop(log.request_id, None)
        if timer is not None:
            timer.cancel()
        if self._running.get(log.request_id) is log:
            del self._running[log.request_id]
        elif self._retained.get(log.request_id) is log:
            del self._retained[log.request_id]
            self._retained_bytes -= self._retained_sizes.pop(log.request_id)
