"""``phalanx memory-service``: the out-of-process owner of a slot's weight segments, on a unix socket.

The segments are the files of ``phalanx.failover.weights``; the service
decides who may write and who may read them, and a connection *is* the
grant: per layout hash one writer or many readers. The protocol is one JSON
object per line.

    client -> {"role": "write" | "read", "name": ..., "layout": <hash>, "timeout_s": ..., "device": "cpu" | "cuda[:n]"}
    service -> {"granted": "write", "root": ...}     (only if nothing is committed yet)
             | {"granted": "read", "root": ..., "cuda": <IPC descriptor>?}      (committed, no writer)
             | {"error": "not_ready" | "stale_layout" | "bad_request", "message": ...}
    writer  -> {"commit": true}  after publish_state_dict;  service -> {"committed": true, "cuda": ...?}, and the
               connection becomes a read grant

A request the service cannot take (not one JSON object on a line of at most
``MAX_LINE`` bytes, a role other than write or read, a layout that is not a
hash, a name that is not a segment name, a timeout that is not a number of
seconds from 0 to ``MAX_TIMEOUT_S``) gets ``bad_request`` and the connection
is closed; so is a writer's line that is not its commit (the grant is freed).
Bytes a reader sends while it holds its grant are discarded.

A service started with a CUDA ``device`` owns the weights' GPU copy
(phalanx.failover.cuda_weights): a read grant to an engine that asked for a
CUDA device carries the IPC descriptor of that copy, so engines on the GPU
map the same device memory instead of holding a copy each.

A writer that disconnects before committing frees the write grant (its
staging directories are removed), so the next engine 0 writes. The client
keeps reading its connection while it serves: EOF means the service died.
Weights mapped from the segment files (CPU) stay valid without it: the
client keeps them and re-attaches, asking the service's successor (restarted
on the same socket and root, as a supervisor does) for a read grant again,
with capped backoff, so an engine serving or standing by goes on unharmed
and engines started later get their weights from the successor. Only where
that cannot hold is ``broken`` set (the engine should exit non-zero): the
weights were the dead service's GPU memory (CUDA IPC memory dies with its
owner), or the successor holds other weights under the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from prometheus_client import CollectorRegistry, Gauge
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.common.config import TelemetryConfig
from phalanx.common.lease import Backoff
from phalanx.common.service import ServiceShell
from phalanx.failover.cuda_weights import GpuSegment, map_gpu_segment
from phalanx.failover.weights import (
    COMMIT_FILE,
    DEFAULT_ROOT,
    StaleLayoutError,
    WeightLayout,
    WeightRole,
    WeightsError,
    WeightsNotReadyError,
    is_committed,
    map_state_dict,
    publish_state_dict,
    published_hash,
)

__all__ = ["MemoryServiceClient", "MemoryServiceConfig", "MemoryServiceProcess", "MemoryServiceUnavailableError"]

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_LINE = 64 * 1024
# Re-attaching to a successor: the first retry after this many seconds, doubling up to the cap (with jitter).
_REATTACH_FIRST_S = 0.1
_REATTACH_MAX_S = 2.0
# The longest a request may wait for a grant: a waiting connection is not read, so its client's leaving goes unseen
# until then.
MAX_TIMEOUT_S = 3600.0
# A layout hash (WeightLayout.hash: hex) and a segment name (phalanx.worker.failover_engine.segment_name): both end up in file
# names and glob patterns, so nothing else is taken.
_LAYOUT = re.compile(r"[0-9a-f]{8,64}")
_NAME = re.compile(r"[A-Za-z0-9._@=-]{0,200}")
_QUOTED = 200  # characters of a bad request quoted back in its error message
_DISCARD_CHUNK = 64 * 1024


class _BadRequest(Exception):
    """A request the protocol does not allow: answered ``bad_request`` with this message, then the connection closes."""


def _check_request(request: object) -> tuple[str, str, str, float, str]:
    """(role, layout, name, timeout_s, device) of a grant request; _BadRequest naming what is wrong otherwise."""
    if not isinstance(request, dict):
        raise _BadRequest(f"expected a JSON object with role, name and layout; got {_quote(request)}")
    role, layout, name = request.get("role"), request.get("layout"), request.get("name", "")
    if role not in ("write", "read"):
        raise _BadRequest(f"role: expected write or read; got {_quote(role)}")
    if not isinstance(layout, str) or not _LAYOUT.fullmatch(layout):
        raise _BadRequest(f"layout: expected a layout hash (8-64 hex digits); got {_quote(layout)}")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _BadRequest(f"name: expected a segment name (at most 200 of A-Z a-z 0-9 . _ @ = -); got {_quote(name)}")
    timeout_s = request.get("timeout_s", 30.0)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 <= timeout_s <= MAX_TIMEOUT_S:
        raise _BadRequest(f"timeout_s: expected seconds from 0 to {MAX_TIMEOUT_S:g}; got {_quote(timeout_s)}")
    device = request.get("device", "cpu")
    if not isinstance(device, str) or len(device) > 32:
        raise _BadRequest(f"device: expected cpu or cuda[:n]; got {_quote(device)}")
    return role, layout, name, float(timeout_s), device


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTED else f"{text[:_QUOTED]}... ({len(text)} characters)"


async def _read_message(reader: asyncio.StreamReader) -> object:
    """The next line's JSON value (None at EOF); _BadRequest if it is too long or not JSON."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError, as readline raises it
        raise _BadRequest(f"a line exceeds {MAX_LINE} bytes") from None
    if not line:
        return None
    try:
        # JSON's NaN and Infinity are not numbers a request may hold (json.loads takes them; the checks refuse them).
        return json.loads(line, parse_constant=lambda token: math.nan)
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, or nested past the parser's depth
        raise _BadRequest(f"not one JSON value per line: {type(error).__name__}: {_quote(str(error))}") from None


class MemoryServiceUnavailableError(WeightsError, ConnectionError):
    """The memory service cannot be reached or broke the connection: fatal for an engine."""


class MemoryServiceConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_MEMORY_", extra="forbid", frozen=True)

    socket_path: str = Field("/dev/shm/phalanx-memory.sock", description="Unix socket engines connect to (on the slot's shared volume)")
    root: str = Field(str(DEFAULT_ROOT), description="Directory of the weight segments (tmpfs: /dev/shm)")
    host: str = Field("127.0.0.1", description="Address of the gRPC health server")
    port: int = Field(0, ge=0, le=65535, description="gRPC health port; 0 picks a free one")
    advertise_host: str = Field("", description="Host others reach us at (default: host)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    shutdown_grace_s: float = Field(1.0, ge=0, description="How long the health server may finish RPCs at shutdown")
    device: str = Field(
        "cpu", description="cpu, or the CUDA device whose memory holds the weights for engines on the GPU (shared over CUDA IPC)"
    )


@dataclass
class _Segment:
    """Grants on one layout hash; ``changed`` wakes waiters whenever they change."""

    writer: object | None = None
    readers: set[object] = field(default_factory=set)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    connections: int = 0  # that named it, holding or awaiting a grant: at 0 it is forgotten


class MemoryServiceServer:
    """The socket server; see the module docstring for the protocol."""

    def __init__(self, root: Path, socket_path: Path, registry: CollectorRegistry | None = None, *, device: str = "cpu") -> None:
        self.root = root
        self.socket_path = socket_path
        self.device = device
        self._segments: dict[str, _Segment] = {}
        # Layout hash -> the committed weights' copy on the GPU (kept for the service's life), made at the first ask.
        self._gpu_segments: dict[str, GpuSegment] = {}
        self._gpu_lock = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._readers = Gauge("phalanx_memory_readers", "Connections holding a read grant", registry=registry)
        self._writers = Gauge("phalanx_memory_writers", "Connections holding a write grant", registry=registry)
        self._gpu_bytes = Gauge("phalanx_memory_gpu_bytes", "Bytes of weights this service holds on its GPU for its engines", registry=registry)

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a leftover of a dead service; the socket path is ours
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path), limit=MAX_LINE)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):
                connection.close()  # engines see EOF: the service is gone
            if self._handlers:
                # They end on their closed connections; left to asyncio.run's cancellation they would log tracebacks.
                await asyncio.wait(set(self._handlers), timeout=1.0)
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def counts(self, layout_hash: str) -> tuple[int, int]:
        """(writers, readers) holding grants on a layout."""
        segment = self._segments.get(layout_hash)
        return (0, 0) if segment is None else (int(segment.writer is not None), len(segment.readers))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = object()
        segment: _Segment | None = None
        self._connections.add(writer)
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        try:
            role, layout_hash, name, timeout_s, device = _check_request(await _read_message(reader))
            segment = self._segments.setdefault(layout_hash, _Segment())
            segment.connections += 1
            granted = await _unless_gone(reader, self._grant(segment, me, role, layout_hash, name, timeout_s))
            if granted is None:  # the client left while it waited
                return
            if "error" in granted:
                await _send(writer, granted)
                return
            wants_gpu = device.startswith("cuda")
            if granted["granted"] == "read" and wants_gpu:
                granted = {**granted, **await self._gpu_share(layout_hash)}
            await _send(writer, granted)
            if granted["granted"] == "write":
                if not await self._await_commit(reader, writer, segment, me, layout_hash, wants_gpu):
                    return
            # Hold the read grant until the engine disconnects (EOF); what it sends meanwhile is dropped, not kept.
            while await reader.read(_DISCARD_CHUNK):
                pass
        except _BadRequest as error:
            log.info("memory-service bad request: %s", error)
            with contextlib.suppress(ConnectionError):
                await _send(writer, {"error": "bad_request", "message": str(error)})
        except ConnectionError as error:
            log.info("memory-service connection ended: %s", error)
        finally:
            if segment is not None:
                await self._drop(segment, me)
                segment.connections -= 1
                if segment.connections == 0 and self._segments.get(layout_hash) is segment:
                    # Nobody holds or awaits it: forget it (a client naming ever new layouts would grow the table).
                    del self._segments[layout_hash]
            self._connections.discard(writer)
            writer.close()

    async def _grant(self, segment: _Segment, me: object, role: str, layout_hash: str, name: str, timeout_s: float) -> dict[str, object]:
        directory = segment_dir_for(self.root, layout_hash)

        def decided() -> bool:
            if segment.writer is not None:
                return False
            return is_committed(directory) or role == "write" or self._stale(layout_hash, name) is not None

        async with segment.changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await segment.changed.wait_for(decided)
            except TimeoutError:
                return {"error": "not_ready", "message": f"no weights committed for layout {layout_hash} within {timeout_s} s"}
            if is_committed(directory):
                segment.readers.add(me)
                self._readers.inc()
                return {"granted": "read", "root": str(self.root)}
            if (stale := self._stale(layout_hash, name)) is not None and role == "read":
                return {"error": "stale_layout", "message": f"{name} is published with layout {stale}, not {layout_hash}"}
            segment.writer = me
            self._writers.inc()
            return {"granted": "write", "root": str(self.root)}

    def _stale(self, layout_hash: str, name: str) -> str | None:
        published = published_hash(name, self.root) if name else None
        return published if published not in (None, layout_hash) else None

    async def _gpu_share(self, layout_hash: str) -> dict[str, object]:
        """``{"cuda": descriptor}`` of the committed weights' GPU copy; ``{}`` if this service keeps none (CPU)."""
        if torch.device(self.device).type != "cuda":
            return {}
        async with self._gpu_lock:
            shared = self._gpu_segments.get(layout_hash)
            if shared is None:
                directory = segment_dir_for(self.root, layout_hash)
                try:
                    layout = WeightLayout.from_json(await asyncio.to_thread((directory / COMMIT_FILE).read_text))
                    shared = await asyncio.to_thread(GpuSegment, directory, layout, self.device)
                except (OSError, RuntimeError, WeightsError) as error:
                    # The engine then copies the host pages to its device itself: slower and not shared, but serving.
                    log.error("cannot put the weights of layout %s on %s: %s", layout_hash, self.device, error)
                    return {}
                self._gpu_segments[layout_hash] = shared
                self._gpu_bytes.set(sum(s.nbytes for s in self._gpu_segments.values()))
                log.info("weights of layout %s on %s: %.1f MiB shared over CUDA IPC", layout_hash, self.device, shared.nbytes / 2**20)
        return {"cuda": shared.descriptor}

    async def _await_commit(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, segment: _Segment, me: object, layout_hash: str,
        wants_gpu: bool = False,
    ) -> bool:
        try:
            message = await _read_message(reader)
        except _BadRequest:
            message = None
        directory = segment_dir_for(self.root, layout_hash)
        if not (isinstance(message, dict) and message.get("commit") is True and is_committed(directory)):
            log.warning("writer of layout %s left without committing; freeing the write grant", layout_hash)
            for staging in self.root.glob(f"{directory.name}.staging-*"):
                shutil.rmtree(staging, ignore_errors=True)
            return False
        async with segment.changed:
            segment.writer = None
            self._writers.dec()
            segment.readers.add(me)
            self._readers.inc()
            segment.changed.notify_all()
        await _send(writer, {"committed": True, **(await self._gpu_share(layout_hash) if wants_gpu else {})})
        return True

    async def _drop(self, segment: _Segment, me: object) -> None:
        async with segment.changed:
            if segment.writer is me:
                segment.writer = None
                self._writers.dec()
            if me in segment.readers:
                segment.readers.discard(me)
                self._readers.dec()
            segment.changed.notify_all()


async def _unless_gone(reader: asyncio.StreamReader, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if the client closes its side first.

    Until the reply nothing may come from the client, so what does is read and dropped while watching for EOF."""

    async def gone() -> None:
        while await reader.read(_DISCARD_CHUNK):
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for waiting in (task, watcher):
            waiting.cancel()
        # Awaited, not only cancelled: the stream takes one reader at a time, and the caller reads next.
        await asyncio.gather(task, watcher, return_exceptions=True)


def segment_dir_for(root: Path, layout_hash: str) -> Path:
    return root / f"phalanx-weights-{layout_hash}"


async def _send(writer: asyncio.StreamWriter, message: Mapping[str, object]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


class MemoryServiceClient:
    """An engine's grant on one segment: ``obtain()`` once, keep the client while the tensors are used."""

    def __init__(self, socket_path: str | os.PathLike[str]) -> None:
        self.socket_path = os.fspath(socket_path)
        # The mapped weights cannot be trusted any more (see the module docstring): the engine must exit.
        self.broken = asyncio.Event()
        self.reattached = 0  # times this client took its read grant again from a successor of its service
        self.attached = False  # holds a grant now (False between a service's death and its successor's grant)
        self._regrant: dict[str, object] | None = None  # what to ask a successor for; None: the weights died with the service
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._watch: asyncio.Task[None] | None = None

    async def obtain(
        self,
        role: WeightRole,
        expected: WeightLayout,
        load: Callable[[], Mapping[str, torch.Tensor]],
        *,
        name: str,
        timeout_s: float = 30.0,
        device: str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Shared tensors under a grant: RW_OR_RO writes if nothing is committed, else (and RO always) reads.

        On a CUDA ``device`` they are views of the service's GPU copy; from a service that keeps none (a CPU
        service) they are a private copy on the device, made from the shared host pages.
        """
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE)
        except OSError as error:
            raise MemoryServiceUnavailableError(f"memory service at {self.socket_path} unreachable: {error}") from error
        wants = "write" if role is WeightRole.RW_OR_RO else "read"
        reply = await self._ask({"role": wants, "name": name, "layout": expected.hash, "timeout_s": timeout_s, "device": device})
        if reply.get("error") == "not_ready":
            raise WeightsNotReadyError(str(reply["message"]))
        if reply.get("error") == "stale_layout":
            raise StaleLayoutError(expected.hash, "?", str(reply["message"]))
        if "granted" not in reply:
            raise WeightsError(f"memory service refused: {reply}")
        root = Path(str(reply["root"]))
        if reply["granted"] == "write":
            published = await asyncio.to_thread(lambda: publish_state_dict(load(), name=name, root=root))
            if published != expected:
                raise StaleLayoutError(expected.hash, published.hash, "the loaded weights differ from the model's layout")
            reply = await self._ask({"commit": True})
            if reply.get("committed") is not True:
                raise WeightsError("the memory service did not accept the commit")
        shared_gpu = reply.get("cuda")
        if isinstance(shared_gpu, dict):
            tensors = await asyncio.to_thread(map_gpu_segment, shared_gpu, expected)
        else:
            self._regrant = {"role": "read", "name": name, "layout": expected.hash, "timeout_s": timeout_s, "device": "cpu"}
            tensors = map_state_dict(expected, name=name, root=root, timeout_s=1.0)
            if torch.device(device).type != "cpu":
                log.warning("the memory service keeps no weights on %s: this engine copies them there (not shared)", device)
                tensors = await asyncio.to_thread(lambda: {k: v.to(device) for k, v in tensors.items()})
        self.attached = True
        self._watch = asyncio.create_task(self._watch_connection(), name="memory-service-watch")
        return tensors

    async def _ask(self, message: Mapping[str, object]) -> dict[str, object]:
        assert self._reader is not None and self._writer is not None
        try:
            await _send(self._writer, message)
            line = await self._reader.readline()
        except OSError as error:
            raise MemoryServiceUnavailableError(f"memory service connection broke: {error}") from error
        if not line:
            raise MemoryServiceUnavailableError("the memory service closed the connection")
        reply = json.loads(line)
        assert isinstance(reply, dict)
        return reply

    async def _watch_connection(self) -> None:
        while True:
            assert self._reader is not None
            with contextlib.suppress(OSError):
                await self._reader.read()  # the service never sends after the grant: any return is EOF
            self.attached = False
            if self._regrant is None:
                log.error("the memory service at %s went away, and the weights on the GPU with it", self.socket_path)
                self.broken.set()
                return
            log.warning("the memory service at %s went away; the mapped weights stay valid: re-attaching to its successor",
                        self.socket_path)
            if not await self._reattach(self._regrant):
                self.broken.set()
                return

    async def _reattach(self, request: Mapping[str, object]) -> bool:
        """A read grant again from a service on our socket, retried until one answers; False if it refuses for good."""
        backoff = Backoff(_REATTACH_FIRST_S, _REATTACH_MAX_S)
        while True:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE)
                reply = await self._ask(request)
            except (OSError, MemoryServiceUnavailableError, ValueError) as error:  # not restarted yet (or cut off mid-reply)
                log.debug("memory service at %s not back yet: %s", self.socket_path, error)
                await asyncio.sleep(backoff.next())
                continue
            if reply.get("granted") == "read":
                self.reattached += 1
                self.attached = True
                log.warning("re-attached to the memory service at %s", self.socket_path)
                return True
            log.error("the memory service at %s refused to grant this engine's weights again: %s", self.socket_path, reply)
            return False

    async def close(self) -> None:
        """Give the grant back; idempotent."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class MemoryServiceProcess:
    """Start: health NOT_SERVING -> socket server -> SERVING. Stop (SIGTERM): NOT_SERVING -> socket closed (clients see EOF)."""

    def __init__(self, config: MemoryServiceConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.shell = ServiceShell("phalanx-memory-service", config, telemetry, registry=self.registry, shutdown_grace_s=config.shutdown_grace_s)
        self.ready = self.shell.ready
        self.server = MemoryServiceServer(Path(config.root), Path(config.socket_path), self.registry, device=config.device)

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        async with self.shell as shell:
            await shell.start()
            await asyncio.to_thread(Path(self.config.root).mkdir, parents=True, exist_ok=True)
            await self.server.start()
            shell.push_async_callback(self.server.close)
            await shell.set_serving(True)
            log.info("memory service on %s (segments in %s, health %s)", self.config.socket_path, self.config.root, shell.address)
            await shell.wait_for_stop()
            await shell.stop_server()
