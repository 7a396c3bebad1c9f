"""Membership and shared state in etcd: list the keys under a prefix, then watch them change.

Each worker puts ``/phalanx/v1/workers/<id>`` (the JSON form of
WorkerRegistration) under its LeasedKey; the key vanishes when the worker
dies. ``list()`` records the etcd revision it read at, and ``watch()``
resumes from the revision after it, so no change falls between the two.
``EtcdDirectory`` does this for any prefix of JSON-encoded protobuf
messages (health records, degradation state); ``WorkerDirectory`` is the
one for workers, ``CheckpointStoreDirectory``, ``MigrationDirectory`` and
``EncoderDirectory`` the ones for the instances of those services.
``DirectoryView`` keeps one directory's entries current by its watch, for
readers on a latency-critical path (a migration) that cannot afford an etcd
round trip per read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end
from google.protobuf import json_format
from google.protobuf.message import Message

from phalanx._proto import checkpoint_pb2, common_pb2, encoder_pb2, expert_pb2, migration_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.lease import TRANSIENT_ERRORS, Backoff, connect_etcd
from phalanx.common.subjects import (
    CHECKPOINT_STORES_PREFIX,
    ENCODERS_PREFIX,
    EXPERT_WORKERS_PREFIX,
    MIGRATIONS_PREFIX,
    WORKERS_PREFIX,
    validate_worker_id,
)

__all__ = [
    "CheckpointStoreDirectory", "DirectoryView", "EncoderDirectory", "EtcdDirectory", "ExpertWorkerDirectory", "MigrationDirectory",
    "WatchEvent", "WorkerDirectory",
    "addresses_of", "decode_json", "decode_registration", "encode_json", "encode_registration",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
# ("put", name, message) or ("delete", name, None); name is the key below the prefix.
WatchEvent = tuple[Literal["put", "delete"], str, "M | None"]

_DELETE = rpc.Event.EventType.DELETE


def encode_json(message: Message) -> bytes:
    """The etcd value for a message: its canonical proto3 JSON, one line (readable with etcdctl)."""
    return json_format.MessageToJson(message, indent=None).encode()


def decode_json(data: bytes | str, message_type: type[M]) -> M:
    """Parse an etcd value; unknown fields (from a newer writer) are ignored."""
    return json_format.Parse(data, message_type(), ignore_unknown_fields=True)


def encode_registration(registration: common_pb2.WorkerRegistration) -> bytes:
    """The etcd value for a registration."""
    return encode_json(registration)


def decode_registration(data: bytes | str) -> common_pb2.WorkerRegistration:
    """Parse a registration value."""
    return decode_json(data, common_pb2.WorkerRegistration)


@dataclass
class _Cursor:
    """Revision the next watch stream starts at (0: the current one)."""

    next: int


class EtcdDirectory(Generic[M]):
    """``list()`` and ``watch()`` over the JSON-encoded ``message_type`` values under ``prefix``.

    Names (the key below the prefix) must pass ``validate_worker_id`` (one
    path segment of safe characters); other keys are logged and skipped.
    """

    def __init__(self, config: EtcdConfig, *, prefix: str, message_type: type[M]) -> None:
        self._config = config
        self._prefix = prefix.encode()
        self._message_type = message_type
        self._client = connect_etcd(config)
        self._revision: int | None = None
        self._known: set[str] = set()

    @property
    def revision(self) -> int | None:
        """The etcd revision the last ``list()`` read at (None before the first)."""
        return self._revision

    async def list(self) -> dict[str, M]:
        """Every value by name; also records the revision for ``watch()``."""
        result = await self._client.get_prefix(self._prefix)
        values: dict[str, M] = {}
        for kv in result.kvs:
            parsed = self._parse(kv.key, kv.value)
            if parsed is not None:
                values[parsed[0]] = parsed[1]
        self._revision = result.header.revision
        self._known = set(values)
        return values

    async def follow(self, apply: Callable[[Literal["put", "delete"], str, M | None], object]) -> None:
        """Calls ``apply(kind, name, message)`` for every change from now on (``watch``), until cancelled: run it as a task."""
        async with aclosing(self.watch()) as events:
            async for kind, name, message in events:
                apply(kind, name, message)

    async def watch(self, *, start_revision: int | None = None) -> AsyncGenerator[WatchEvent]:
        """Yield ``(event_type, name, message | None)`` for every change.

        Starts at ``start_revision``, else just after the last ``list()``, else
        now. Survives etcd restarts by resuming from the last revision seen; if
        that was compacted away it re-lists and yields the difference. Close it
        with ``contextlib.aclosing`` (or ``await gen.aclose()``) when done.
        """
        if start_revision is not None:
            next_revision = start_revision
        elif self._revision is not None:
            next_revision = self._revision + 1
        else:
            next_revision = 0  # etcd: from the current revision on
        cursor = _Cursor(next_revision)
        backoff = Backoff(initial=0.05, cap=self._config.max_retry_wait_s)
        while True:
            try:
                async with aclosing(self._watch_stream(cursor, backoff)) as events:
                    async for event in events:
                        yield event
            except TRANSIENT_ERRORS as error:
                delay = backoff.next()
                log.warning(
                    "watch of %s interrupted (%s); resuming at revision %d in %.2f s", self._prefix.decode(), error, cursor.next, delay
                )
                await asyncio.sleep(delay)

    async def _watch_stream(self, cursor: _Cursor, backoff: Backoff) -> AsyncGenerator[WatchEvent]:
        """Events of one Watch stream from ``cursor.next`` on; returns after a resync."""
        await self._client.connect()
        call = rpc.WatchStub(self._client.channel).Watch(metadata=self._client.metadata)
        try:
            create = rpc.WatchCreateRequest(
                key=self._prefix, range_end=prefix_range_end(self._prefix), start_revision=cursor.next
            )
            await call.write(rpc.WatchRequest(create_request=create))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("etcd closed the watch stream")
                if response.compact_revision:
                    log.warning("watch fell behind compaction at %d; re-listing", response.compact_revision)
                    async for event in self._resync():
                        yield event
                    cursor.next = (self._revision or 0) + 1
                    return
                if response.canceled:
                    raise ConnectionError(f"etcd cancelled the watch: {response.cancel_reason}")
                if response.created and cursor.next == 0:
                    cursor.next = response.header.revision + 1
                backoff.reset()
                for event in response.events:
                    cursor.next = event.kv.mod_revision + 1
                    converted = self._convert(event)
                    if converted is not None:
                        yield converted
        finally:
            call.cancel()

    async def close(self) -> None:
        """Close the etcd connection; idempotent."""
        await self._client.close()

    async def __aenter__(self) -> EtcdDirectory[M]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _convert(self, event: rpc.Event) -> WatchEvent | None:
        if event.type == _DELETE:
            try:
                name = self._name(event.kv.key)
            except ValueError:
                return None
            self._known.discard(name)
            return ("delete", name, None)
        parsed = self._parse(event.kv.key, event.kv.value)
        if parsed is None:
            return None
        self._known.add(parsed[0])
        return ("put", parsed[0], parsed[1])

    async def _resync(self) -> AsyncGenerator[WatchEvent]:
        before = set(self._known)
        values = await self.list()
        for name in sorted(before - set(values)):
            yield ("delete", name, None)
        for name, message in values.items():
            yield ("put", name, message)

    def _name(self, key: bytes) -> str:
        return validate_worker_id(key[len(self._prefix) :].decode())

    def _parse(self, key: bytes, value: bytes) -> tuple[str, M] | None:
        try:
            return self._name(key), decode_json(value, self._message_type)
        except (ValueError, json_format.ParseError) as error:
            # Someone else's key or a corrupt value must not stop discovery.
            log.warning("ignoring %r under %s: %s", key, self._prefix.decode(), error)
            return None


class DirectoryView(Generic[M]):
    """A directory's entries as its watch last left them: ``get()`` reads them without an etcd round trip.

    Run ``follow()`` as a task for as long as the view is read; until its
    first list (and after it ended) ``get()`` reads etcd itself. A failure
    burst reads the same membership once per request otherwise: measured on
    the loaded 2-core dev box (load 8, 2026-11-26) such a read took 1-34 ms
    on the path from a worker's death to its streams' next token. A watch
    lags etcd by milliseconds; while etcd is unreachable the view keeps what
    it last saw (a lookup would fail then).
    """

    def __init__(self, directory: EtcdDirectory[M]) -> None:
        self.directory = directory  # its own: a list() elsewhere would move the watch's resync baseline
        self._entries: dict[str, M] | None = None

    async def follow(self) -> None:
        backoff = Backoff(initial=0.05, cap=self.directory._config.max_retry_wait_s)
        while True:
            try:
                entries = await self.directory.list()
                break
            except TRANSIENT_ERRORS as error:
                log.warning("cannot list %s (%r); retrying", self.directory._prefix.decode(), error)
                await asyncio.sleep(backoff.next())
        try:
            self._entries = entries
            async with aclosing(self.directory.watch()) as events:
                async for kind, name, message in events:
                    if kind == "put" and message is not None:
                        entries[name] = message
                    else:
                        entries.pop(name, None)
        finally:
            self._entries = None

    async def get(self) -> dict[str, M]:
        """Every entry by name (a copy)."""
        if self._entries is not None:
            return dict(self._entries)
        return await self.directory.list()

    async def close(self) -> None:
        await self.directory.close()


def addresses_of(instances: Mapping[str, checkpoint_pb2.CheckpointStoreRegistration | migration_pb2.MigrationRegistration]) -> list[str]:
    """Each instance's gRPC address, in name (key) order."""
    return [instance.address for _, instance in sorted(instances.items())]


class WorkerDirectory(EtcdDirectory[common_pb2.WorkerRegistration]):
    """Read side of worker membership: ``list()`` and ``watch()`` over the workers prefix."""

    def __init__(self, config: EtcdConfig, *, prefix: str = WORKERS_PREFIX) -> None:
        super().__init__(config, prefix=prefix, message_type=common_pb2.WorkerRegistration)


class CheckpointStoreDirectory(EtcdDirectory[checkpoint_pb2.CheckpointStoreRegistration]):
    """The checkpoint stores, each advertised under its lease (a crashed one's lingers for the lease TTL)."""

    def __init__(self, config: EtcdConfig, *, prefix: str = CHECKPOINT_STORES_PREFIX) -> None:
        super().__init__(config, prefix=prefix, message_type=checkpoint_pb2.CheckpointStoreRegistration)

    async def addresses(self) -> list[str]:
        """Each store's gRPC address, in key order."""
        return addresses_of(await self.list())


class MigrationDirectory(EtcdDirectory[migration_pb2.MigrationRegistration]):
    """The migration service's instances, each advertised under its lease."""

    def __init__(self, config: EtcdConfig, *, prefix: str = MIGRATIONS_PREFIX) -> None:
        super().__init__(config, prefix=prefix, message_type=migration_pb2.MigrationRegistration)

    async def addresses(self) -> list[str]:
        """Each instance's gRPC address, in key order."""
        return addresses_of(await self.list())


class ExpertWorkerDirectory(EtcdDirectory[expert_pb2.ExpertWorkerRegistration]):
    """The expert workers of a disaggregated MoE deployment, each advertised under its lease."""

    def __init__(self, config: EtcdConfig, *, prefix: str = EXPERT_WORKERS_PREFIX) -> None:
        super().__init__(config, prefix=prefix, message_type=expert_pb2.ExpertWorkerRegistration)


class EncoderDirectory(EtcdDirectory[encoder_pb2.EncoderRegistration]):
    """The encoder pool's instances, each advertised under its lease with its backlog, refreshed as it changes."""

    def __init__(self, config: EtcdConfig, *, prefix: str = ENCODERS_PREFIX) -> None:
        super().__init__(config, prefix=prefix, message_type=encoder_pb2.EncoderRegistration)
