"""A TCP link whose latency a chaos scenario can raise: a delay line between clients and one server.

The faithful way to slow a link is netem (``tc qdisc add dev <veth> root netem delay 300ms`` on a veth into a network
namespace). Kernels without the sch_netem module (this project's CI VMs: no netem, no loadable modules) cannot do
that, so the link is a proxy on loopback instead: every chunk read from one side is written to the other
``delay_s / 2`` later, in order, while later chunks keep flowing (a delay, like netem's, not a throughput cap). With
``delay_s`` 0 the proxy only copies bytes.

The proxy runs on its own thread and event loop, so the harness's own load (the streams it measures) neither slows
the link nor is slowed by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from typing import Any, Self

__all__ = ["DelayLink"]

_CHUNK = 64 * 1024


class DelayLink:
    """Listens on 127.0.0.1 (a free port) and forwards every connection to ``upstream`` (host, port)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._delay_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.connections = 0
        self.chunks_delayed = 0

    @property
    def endpoint(self) -> str:
        """Where clients connect, as host:port."""
        return f"127.0.0.1:{self.port}"

    @property
    def delay_s(self) -> float:
        """Latency added to each round trip (half on each direction); applies to bytes read from now on."""
        return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        if value < 0:
            raise ValueError("a delay cannot be negative")
        self._delay_s = value  # one float store: the link's loop reads it per chunk

    def start(self) -> Self:
        """Start the link's thread and listen; returns once it accepts connections."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as error:  # noqa: BLE001 - handed to the starting thread, which raises it
                failure.append(error)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=main, name=f"delay-link-{self._upstream[1]}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def close(self) -> None:
        """Stop listening, drop every connection, stop the thread; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()  # the server is down: the client sees a refused/closed connection, as it would
            return
        # The connection's two directions: closing either socket ends both (a broken link breaks both ways).
        self._spawn(self._direction(client_reader, upstream_writer, client_writer))
        self._spawn(self._direction(upstream_reader, client_writer, upstream_writer))

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, other: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk written half the current delay after it was read."""
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        pump = asyncio.get_running_loop().create_task(self._read_into(reader, line))
        try:
            while True:
                due, chunk = await line.get()
                if not chunk:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    self.chunks_delayed += 1
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            for end in (writer, other):
                end.close()

    async def _read_into(self, reader: asyncio.StreamReader, line: asyncio.Queue[tuple[float, bytes]]) -> None:
        try:
            while chunk := await reader.read(_CHUNK):
                line.put_nowait((time.monotonic() + self._delay_s / 2, chunk))
        except (ConnectionError, OSError):
            pass
        line.put_nowait((time.monotonic(), b""))
