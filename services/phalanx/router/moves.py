"""A relayed request's moves to another worker: the migrations its relay asks for, and the moves made under it (fencing).

The relay policy (router/relay.py) decides when a request is to be migrated;
`RequestMoves` asks the migration service, with the state the client has as a
fallback and the request's media as the refetch policy (router/refetch.py)
wants them. A migration that health or the migration service started while
the relay still read the old worker is the fencing policy's
(router/fencing.py): `RequestMoves` stops that read, points the request at
its new worker and asks the old one to drop its copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from phalanx._proto import common_pb2, migration_pb2, worker_pb2
from phalanx.common.errors import MEDIA_SOURCE_SUBJECT, FailedPreconditionError
from phalanx.common.telemetry import get_tracer
from phalanx.router.channels import WorkerChannels
from phalanx.router.fencing import (
    Effect as FencingEffect,
    Fence,
    FencingPolicy,
    Migrated,
    ReadStarted,
    ReadStopped,
    StopReading,
    StreamOver,
    WorkerDead,
)
from phalanx.router.flow import Flow
from phalanx.router.media_flow import MediaFlow
from phalanx.router.metrics import RouterMetrics
from phalanx.router.refetch import MigrationDue, PassOn, SkipMigration, TargetRefused
from phalanx.router.relay import Migrate

__all__ = ["HandoffChunk", "RequestMoves", "migrate_request"]

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

# How long a fenced worker has to act on the Cancel of a request that moved off it (a hung one, once it runs again).
_FENCE_CANCEL_S = 10.0

# A worker's last chunk of a request it handed back: the state to continue from (Generate and Attach alike).
HandoffChunk = worker_pb2.GenerateResponse | worker_pb2.AttachResponse
MigrateCall = Callable[[migration_pb2.MigrateRequest], Awaitable[migration_pb2.MigrateResponse | None]]


class RequestMoves:
    """Executes the moves of the router's relays: asks for migrations, and fences relays off workers their request left.

    `repoint(flow, worker_id, address)` records that a request runs on another worker now.
    """

    def __init__(
        self, channels: WorkerChannels, metrics: RouterMetrics, registrations: Mapping[str, common_pb2.WorkerRegistration], *,
        migrate: MigrateCall | None, media: MediaFlow | None, repoint: Callable[[Flow, str, str], None],
    ) -> None:
        self.channels = channels
        self.metrics = metrics
        self.registrations = registrations  # the servicer's, kept current by the process
        self._migrate = migrate
        self._media = media
        self._repoint = repoint
        self._fencing = FencingPolicy()
        self._calls: dict[str, Any] = {}  # request id -> the worker call its relay reads now
        self._fence_tasks: set[asyncio.Task] = set()

    @property
    def can_migrate(self) -> bool:
        """Whether this router has a migration service to ask."""
        return self._migrate is not None

    # -- fencing --------------------------------------------------------------------------
    def reading(self, request_id: str, worker_id: str, call: Any) -> None:
        """A relay reads the request from `worker_id` through `call` now (what a move under it cancels)."""
        self._calls[request_id] = call
        self._fencing.on(ReadStarted(request_id, worker_id))

    def stopped_reading(self, request_id: str) -> None:
        self._calls.pop(request_id, None)
        self._fencing.on(ReadStopped(request_id))

    def on_migrated(self, event: migration_pb2.MigrationEvent) -> None:
        """A migration moved a request (its worker died or was declared dead): a relay still reading it from the
        old worker stops and follows it, so that a hung worker that wakes up delivers nothing more (fencing)."""
        self._execute(self._fencing.on(Migrated(event.request_id, event.from_worker_id, event.worker_id, event.worker_address)))

    def on_worker_dead(self, worker_id: str, started_at: float) -> None:
        """Health declared a worker DEAD: relays still reading it stop, as if its stream broke, and migrate.

        A hung worker's streams never break by themselves, and the migration service's DEAD trigger moves only what
        the checkpoint store holds for it: not a request it has no commit of yet, nor one whose media embeddings only
        this router has. A request that trigger is moving already is shared by this router's call (one migration).
        A record of another incarnation (a stable id, as compose and Helm give, restarted) leaves this one alone.
        """
        registration = self.registrations.get(worker_id)
        registered = registration.started_at if registration is not None else None
        for effect in self._fencing.on(WorkerDead(worker_id, started_at, registered)):
            log.warning("worker %s was declared dead while relaying %s: moving it", worker_id, effect.request_id)
            self._execute((effect,))

    def fenced(self, flow: Flow, *, handed_back: bool) -> bool:
        """The relay's stream of `flow` is over: whether the request was moved under it (then it points at the new owner,
        and the relay attaches there from the next index the client lacks)."""
        effects = self._fencing.on(StreamOver(flow.record.request_id, handed_back))
        self._execute(effects, flow)
        return bool(effects)

    def _execute(self, effects: tuple[FencingEffect, ...], flow: Flow | None = None) -> None:
        for effect in effects:
            if isinstance(effect, StopReading):
                call = self._calls.get(effect.request_id)
                if call is not None:
                    call.cancel()
            elif isinstance(effect, Fence):
                assert flow is not None  # only the end of a relay's stream fences
                # Nothing more from the old worker reaches the client (it hung, or its lease lapsed); the new owner
                # continues from the next index.
                flow.migrations += 1
                self.metrics.migrations.inc()
                log.warning("%s moved from %s to %s under its relay: fenced the old stream", effect.request_id, effect.from_worker_id,
                            effect.worker_id)
                self._cancel_on(effect.from_worker_id, effect.request_id)
                self._repoint(flow, effect.worker_id, effect.worker_address)

    def _cancel_on(self, worker_id: str, request_id: str) -> None:
        """Ask the old owner to drop its copy, in the background: a hung worker acts on it once it runs again."""
        registration = self.registrations.get(worker_id)
        if registration is None:
            return

        async def cancel() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.channels.stub(registration.address).Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=_FENCE_CANCEL_S)

        task = asyncio.get_running_loop().create_task(cancel())
        self._fence_tasks.add(task)
        task.add_done_callback(self._fence_tasks.discard)

    # -- migrations -----------------------------------------------------------------------
    async def migrate(
        self, flow: Flow, move: Migrate, handoff_chunk: HandoffChunk | None, *, avoid: frozenset[str] = frozenset(),
    ) -> migration_pb2.MigrateResponse | None:
        """Asks the migration service to move the request, off `avoid` if it can; None when it did not (the relay policy
        decides what then)."""
        if self._migrate is None:
            return None
        # Direct delivery: the target fetches the media from the encoder that holds them (Restore does as Generate does),
        # so this router holds no rows; past their hold time, or when the target could not fetch them, they are
        # encoded again and go inline.
        if flow.media:
            due = MigrationDue(time.monotonic())
            if isinstance(await self._media_flow().refetch(flow, due, "a migration is due past their hold"), SkipMigration):
                return None
        with tracer.start_as_current_span("router.migrate") as span:
            span.set_attribute("phalanx.request_id", flow.record.request_id)
            request = migrate_request(flow, move, handoff_chunk)
            request.avoid_worker_ids.extend(sorted(avoid))
            try:
                moved = await self._migrate(request)
            except FailedPreconditionError as error:
                if error.subject != MEDIA_SOURCE_SUBJECT or not flow.media:
                    raise
                effect = await self._media_flow().refetch(flow, TargetRefused(), f"the target could not fetch them ({error})")
                if isinstance(effect, PassOn):
                    raise
                if isinstance(effect, SkipMigration):
                    return None
                request = migrate_request(flow, move, handoff_chunk)
                request.avoid_worker_ids.extend(sorted(avoid))
                moved = await self._migrate(request)
            if moved is None:
                return None
            span.set_attribute("phalanx.worker_id", moved.worker_id)
        flow.migrations += 1
        self.metrics.migrations.inc()
        log.info("%s moved from %s to %s (%s)", flow.record.request_id, flow.record.worker_id, moved.worker_id, request.reason)
        self._repoint(flow, moved.worker_id, moved.worker_address)
        return moved

    def _media_flow(self) -> MediaFlow:
        assert self._media is not None  # only a request with media gets here, and the servicer refuses those without encoders
        return self._media


def migrate_request(flow: Flow, move: Migrate, handoff_chunk: HandoffChunk | None) -> migration_pb2.MigrateRequest:
    """The migration service's request to move `flow`: what the client has is the fallback state to restore from."""
    request = migration_pb2.MigrateRequest(
        request_id=flow.record.request_id, worker_id=flow.record.worker_id, tokens_delivered=flow.next_index, seed=flow.seed,
        reason=move.reason, priority=int(flow.tier), media=flow.media,
    )
    if flow.prompt_ids:
        known = request.known_state
        known.request_id = flow.record.request_id
        known.prompt_token_ids.extend(flow.prompt_ids)
        known.output_token_ids.extend(flow.output_ids)
        if len(flow.output_logprobs) == len(flow.output_ids):  # whole or not at all: a resumed stream may lack the first
            known.output_logprobs.extend(flow.output_logprobs)
        known.prompt_logprobs.extend(flow.prompt_logprobs)
        if flow.sampling is not None:
            known.sampling.CopyFrom(flow.sampling)
        known.sampling.seed = flow.seed
        known.priority = int(flow.tier)
    if handoff_chunk is not None:
        request.handoff.CopyFrom(handoff_chunk.handoff)
        request.handoff_kv_tokens = handoff_chunk.handoff_kv_tokens
        request.handoff_source_address = handoff_chunk.handoff_source
    return request
