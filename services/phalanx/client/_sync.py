"""The blocking client: the async Client on one private event loop in a daemon thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar, Unpack

from phalanx.client._client import Client
from phalanx.client._config import RetryPolicy, TlsConfig
from phalanx.client._options import GenerateOptions, GenerateParams
from phalanx.client._stream import GenerateStream
from phalanx.client._types import Chunk, Completion, Media, WorkerInfo

__all__ = ["SyncClient", "SyncGenerateStream"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread; coroutines are submitted from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._detached: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name="phalanx-client", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the loop in the caller's contextvars (so its trace context) and waits."""
        context = contextvars.copy_context()
        result: concurrent.futures.Future = concurrent.futures.Future()
        started: list[asyncio.Task] = []

        def start() -> None:
            task = self.loop.create_task(coro, context=context)
            started.append(task)
            task.add_done_callback(lambda t: _copy_outcome(t, result))

        self.loop.call_soon_threadsafe(start)
        try:
            return result.result()
        except BaseException:
            # KeyboardInterrupt or the like in the caller's thread: stop the work it was waiting on.
            if not result.done():
                self.loop.call_soon_threadsafe(lambda: started and started[0].cancel())
            raise

    def submit(self, make_coro: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Runs ``make_coro()`` on the loop without waiting for it (nothing once the loop is closed)."""

        def start() -> None:
            task = self.loop.create_task(make_coro())
            self._detached.add(task)
            task.add_done_callback(self._detached.discard)

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:
            pass  # the loop closed: its client is closed and nothing is left to cancel

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.run(self.loop.shutdown_asyncgens())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _copy_outcome(task: asyncio.Task, result: concurrent.futures.Future) -> None:
    if task.cancelled():
        result.cancel()
    elif task.exception() is not None:
        result.set_exception(task.exception())
    else:
        result.set_result(task.result())


class SyncGenerateStream(Iterator[Chunk]):
    """Blocking iterator of a request's chunks; leaving early (``break``, ``close()``, the ``with`` block) cancels it."""

    def __init__(self, loop: _LoopThread, stream: GenerateStream) -> None:
        self._loop = loop
        self._stream = stream
        self._lock = threading.Lock()
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def resumes(self) -> int:
        """Calls made so far to recover from a break."""
        return self._stream.resumes

    @property
    def tokens_received(self) -> int:
        return self._stream.tokens_received

    def __iter__(self) -> SyncGenerateStream:
        return self

    def __next__(self) -> Chunk:
        with self._lock:
            try:
                return self._loop.run(_next(self._stream))
            except StopAsyncIteration:
                self._closed = True
                raise StopIteration from None

    def close(self) -> None:
        """Stops the stream, cancelling the request server-side if it was unfinished."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._loop.run(self._stream.aclose())

    def __enter__(self) -> SyncGenerateStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        # A plain `break` drops the iterator: close it without blocking the dropping thread.
        if not getattr(self, "_closed", True):
            self._closed = True
            self._loop.submit(self._stream.aclose)


async def _next(stream: GenerateStream) -> Chunk:
    return await stream.__anext__()


class SyncClient:
    """Blocking client of the Phalanx router, safe to share between threads: ``with SyncClient.connect(target) as client``."""

    def __init__(self, loop: _LoopThread, client: Client) -> None:
        # Use SyncClient.connect.
        self._loop = loop
        self._client = client
        self._close_lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool | TlsConfig | None = None,
        timeout: float | None = None,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen, so one shared default is safe
        channel_options: Sequence[tuple[str, Any]] | None = None,
    ) -> SyncClient:
        """Opens a channel to ``target``; the options are those of ``Client.connect``."""
        loop = _LoopThread()
        try:
            client = loop.run(
                Client.connect(target, api_key=api_key, tls=tls, timeout=timeout, retry=retry, channel_options=channel_options)
            )
        except BaseException:
            loop.stop()
            raise
        return cls(loop, client)

    def generate(
        self,
        prompt: str | list[int],
        *,
        options: GenerateOptions | None = None,
        media: Sequence[Media] = (),
        request_id: str | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> SyncGenerateStream:
        """Blocking twin of ``Client.generate``."""
        stream = self._client.generate(prompt, options=options, media=media, request_id=request_id, timeout=timeout, **params)
        return SyncGenerateStream(self._loop, stream)

    def complete(
        self,
        prompt: str | list[int],
        *,
        options: GenerateOptions | None = None,
        media: Sequence[Media] = (),
        request_id: str | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        """Blocking twin of ``Client.complete``."""
        return self._loop.run(
            self._client.complete(prompt, options=options, media=media, request_id=request_id, timeout=timeout, **params)
        )

    def resume(self, request_id: str, tokens_received: int, *, timeout: float | None = None) -> SyncGenerateStream:
        """Blocking twin of ``Client.resume``."""
        return SyncGenerateStream(self._loop, self._client.resume(request_id, tokens_received, timeout=timeout))

    def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Blocking twin of ``Client.cancel``."""
        return self._loop.run(self._client.cancel(request_id, timeout=timeout))

    def list_workers(self, *, timeout: float | None = None) -> list[WorkerInfo]:
        """Blocking twin of ``Client.list_workers``."""
        return self._loop.run(self._client.list_workers(timeout=timeout))

    @property
    def wrong_peers(self) -> int:
        """Calls so far that reached a service that is not a router (``Client.wrong_peers``)."""
        return self._client.wrong_peers

    def close(self) -> None:
        """Closes the client and stops its thread. Idempotent."""
        with self._close_lock:
            if self._loop.loop.is_closed():
                return
            try:
                self._loop.run(self._client.close())
            finally:
                self._loop.stop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
