"""gRPC shell of the router: validate, admit, route, relay worker streams, resume them anywhere.

A request's token stream comes from a worker; the router relays it with
each token's output index and keeps count. If a worker drains, its
HANDED_BACK state continues on another worker within the same client
stream. If the client's stream breaks (or this router dies) the worker
keeps generating for a grace period, and `Resume` at any replica finds the
worker through the request's etcd record and re-attaches from the next index.

The servicer turns protos into domain objects, runs the pure policies and
executes their effects: which stream comes next (router/relay.py), when media
are encoded again (router/refetch.py, executed by router/media_flow.py) and
which relays a move under them fences (router/fencing.py, executed with the
migrations by router/moves.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import cast

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from phalanx._proto import common_pb2, migration_pb2, router_pb2, router_pb2_grpc, worker_pb2
from phalanx.common.block_hash import MediaSpan
from phalanx.common.errors import (
    InvalidRequestError,
    NotFoundError,
    PhalanxError,
    RequestShedError,
    TenantLimitError,
    UnavailableError,
)
from phalanx.common.grpc_status import abort_with
from phalanx.common.subjects import validate_request_id
from phalanx.common.telemetry import get_tracer
from phalanx.model.params import SamplingParams
from phalanx.model.tokenizer import Tokenizer
from phalanx.router.admission import Admission, Admitted, Tier
from phalanx.router.channels import WorkerChannels
from phalanx.router.config import RouterConfig
from phalanx.router.disagg_flow import DisaggFlow
from phalanx.router.flow import Flow
from phalanx.router.gate import AdmissionGate
from phalanx.router.limits import TenantPromptError
from phalanx.router.media import MediaEncoder, media_fetch_failed
from phalanx.router.media_flow import MediaFlow
from phalanx.router.metrics import RouterMetrics, tenant_label
from phalanx.router.moves import HandoffChunk, RequestMoves
from phalanx.router.multiplex import MultiplexedCall, WorkerMultiplexer
from phalanx.router.prompts import context_limit, request_prompt
from phalanx.router.quarantine import RequestQuarantine, is_crash, request_fingerprint
from phalanx.router.records import RequestRecords
from phalanx.router.refetch import MediaRefetchPolicy, OpenAgain, WorkerFailed
from phalanx.router.relay import (
    AttachMoved,
    Effect,
    Fail,
    Finish,
    GiveUp,
    HandedBack,
    Migrate,
    MigrationResult,
    RelayPolicy,
    ReportBroken,
    ResumeElsewhere,
    RetryElsewhere,
    StreamBroke,
    StreamEnded,
)
from phalanx.router.routing import RoutingTable
from phalanx.router.slo import LatencyKind, LatencySlo

__all__ = ["RouterServicer", "WorkerChannels"]  # WorkerChannels: re-exported for the process that builds both

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

HANDED_BACK = common_pb2.FINISH_REASON_HANDED_BACK
_RECENT_RECORDS = 10_000


# Opens one worker stream of a request on the given worker (its multiplexed stream, or a call of its own).
_OpenCall = Callable[[WorkerMultiplexer], MultiplexedCall | grpc.aio.UnaryStreamCall]


def _api_key(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else value.strip()
    return None


def _status_of(error: grpc.aio.AioRpcError) -> grpc.Status | None:
    """The worker's status with its google.rpc details, to pass on unchanged."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return rpc_status.to_status(status_pb2.Status.FromString(value))
    return None


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        router_id: str,
        config: RouterConfig,
        table: RoutingTable,
        admission: Admission,
        records: RequestRecords,
        channels: WorkerChannels,
        metrics: RouterMetrics,
        *,
        tokenizer: Callable[[], Tokenizer],
        on_broken_stream: Callable[[str, grpc.aio.AioRpcError], None] | None = None,
        migrate: Callable[[migration_pb2.MigrateRequest], Awaitable[migration_pb2.MigrateResponse | None]] | None = None,
        media_encoder: MediaEncoder | None = None,
        quarantine: RequestQuarantine | None = None,
    ) -> None:
        self.router_id = router_id
        self.config = config
        self.table = table
        self.admission = admission
        self.records = records
        self.channels = channels
        self.metrics = metrics
        self._tokenizer = tokenizer
        self._on_broken_stream = on_broken_stream or (lambda worker_id, error: None)
        # Kept current by the process's etcd watches (and health notifications on NATS).
        self.registrations: dict[str, common_pb2.WorkerRegistration] = {}
        self.health_records: dict[str, common_pb2.WorkerHealthRecord] = {}
        self._recent: OrderedDict[str, common_pb2.RequestRecord] = OrderedDict()
        self.slo = LatencySlo()  # the process sets the SLOs the health service publishes
        self._tenant_names = admission.tenant_names
        self.gate = AdmissionGate(config, table, metrics)  # SLO-aware admission (router/overload.py)
        metrics.queued.set_function(lambda: len(admission.queue))
        self.media = (
            MediaFlow(media_encoder, config, table, metrics, channels, self.registrations) if media_encoder is not None else None
        )
        # Poison requests (router/crashes.py): without a store (tests of the servicer alone) the refusals stay on this router.
        self.quarantine = quarantine or RequestQuarantine(config, router_id, metrics, None)
        self.moves = RequestMoves(channels, metrics, self.registrations, migrate=migrate, media=self.media, repoint=self._repoint)
        self.disagg = DisaggFlow(config, table, channels, self.registrations, metrics.registry)  # prefill/decode workers

    # -- RPCs -----------------------------------------------------------------
    async def Generate(self, request: router_pb2.GenerateRequest, context):
        tier = "unknown"  # until admission resolves it

        async def open_flow():
            nonlocal tier
            try:
                admitted, prompt_ids, params = self._validate(request, context)
            except RequestShedError:
                # Shedding refuses new requests only: a client's retry of one already running streams it on.
                existing = await self._record(request.request_id, context) if request.request_id else None
                if existing is None:
                    raise
                flow = Flow(existing, Tier(existing.tier or Tier.STANDARD), [], counts_output=False)
                tier = flow.tier.label
                self._hold(flow)
                return flow, self._attach(flow)
            tier = admitted.tier.label
            fingerprint = request_fingerprint(self.config.model, prompt_ids, request.media, request.sampling)
            self.quarantine.gate(fingerprint)  # before any worker (or encoder) sees it
            request_id = request.request_id or uuid.uuid4().hex
            await self._enter(admitted, request_id, len(prompt_ids))
            try:
                prefer = None if request_id in self._recent else await self.gate.enter(request_id, admitted.tier, len(prompt_ids), params.max_tokens)
                flow, is_retry = await self._open_new(request_id, request, admitted, prompt_ids, params, prefer)
            except BaseException:
                self.admission.leave(request_id)
                self.gate.ended(request_id, "", finished=False)  # admitted (or held) but never started: its slot is free
                raise
            flow.counted = True
            flow.fingerprint = fingerprint
            if is_retry:
                return flow, self._attach(flow)
            self.metrics.arrivals.labels(tier=tier).inc()
            self.metrics.input_tokens.observe(len(prompt_ids))
            return flow, self._generate(flow, request, params)

        def count(status: str) -> None:
            self.metrics.requests.labels(tier=tier, status=status).inc()

        async for chunk in self._serve(context, open_flow, router_pb2.GenerateResponse, count):
            yield chunk

    async def _open_new(
        self, request_id: str, request: router_pb2.GenerateRequest, admitted: Admitted, prompt_ids: list[int], params,
        prefer: str | None = None,
    ) -> tuple[Flow, bool]:
        """Encodes the media, routes and claims the request; (flow, whether it is a retry of a request already running)."""
        encoded = None
        if request.media:
            assert self.media is not None  # _validate refused media without an encoder pool
            encoded = await self.media.encode(request_id, request, prompt_ids, params)
            prompt_ids = encoded.prompt_ids
        media = encoded.media if encoded is not None else []
        flow, existing = await self._start(request_id, admitted, prompt_ids, media, prefer=encoded.worker_id if encoded else prefer,
                                           noted=encoded is None and prefer is not None)
        if existing is not None:
            if existing.tenant != admitted.tenant:
                # Another tenant's request: its tokens are not this caller's to read (the id is taken, nothing more).
                raise InvalidRequestError("request_id", "is taken by another request; send a new one (or none)")
            # A retry of a request that is already running: stream it from the start (not a new arrival).
            return Flow(existing, Tier(existing.tier or Tier.STANDARD), prompt_ids, counts_output=False), True
        if encoded is not None and any(m.source.key for m in media):
            flow.media_inputs, flow.media_budget = request.media, encoded.budget
            flow.refetch = MediaRefetchPolicy(direct=True, usable_until=encoded.usable_until)
        return flow, False

    async def _enter(self, admitted: Admitted, request_id: str, prompt_tokens: int) -> None:
        """Counts the new stream against its tenant's limits (waiting for a full router's slot); counts refusals."""
        tenant = admitted.tenant
        if request_id in self._recent:
            # A retry of a request this router relays or relayed: not a new stream, nothing to charge.
            self.admission.hold(tenant, request_id)
            return
        try:
            await self.admission.enter(tenant, request_id, prompt_tokens)
        except (TenantLimitError, TenantPromptError) as error:
            self.metrics.tenant_rejections.labels(tenant=tenant_label(tenant, self._tenant_names), limit=str(error.limit)).inc()
            raise
        self.metrics.tenant_tokens.labels(tenant=tenant_label(tenant, self._tenant_names)).inc(prompt_tokens)

    def _hold(self, flow: Flow) -> None:
        """Counts a stream of a request already running (a retry or a Resume) once in its tenant's streams."""
        self.admission.hold(flow.record.tenant, flow.record.request_id, from_index=flow.next_index)
        flow.counted = True

    async def Resume(self, request: router_pb2.ResumeRequest, context):
        async def open_flow():
            flow = await self._resumable(request, context)
            self._hold(flow)
            return flow, self._attach(flow)

        def count(status: str) -> None:
            self.metrics.resumes.labels(status=status).inc()

        async for chunk in self._serve(context, open_flow, router_pb2.ResumeResponse, count):
            yield chunk

    async def _serve(self, context, open_flow, response_type, count) -> AsyncIterator:
        """Relays one stream and counts how it ended: ok, cancelled, or the error's reason."""
        status = "error"
        flow = None
        try:
            flow, chunks = await open_flow()
            async for chunk in self._relay(flow, chunks, response_type):
                if chunk.finish_reason:
                    # Counted before the yield: a client may hang up as soon as it has the last token.
                    status = "ok"
                yield chunk
        except PhalanxError as exc:
            status = exc.reason.lower()
            await _abort(context, exc)
        except asyncio.CancelledError:
            if status != "ok":
                status = "cancelled"
            raise
        finally:
            count(status)
            if flow is not None:
                self.gate.ended(flow.record.request_id, flow.record.worker_id, finished=status == "ok")
            if flow is not None and flow.counted:
                self.admission.leave(flow.record.request_id)

    async def Cancel(self, request: router_pb2.CancelRequest, context):
        record = await self._record(self._request_id(request.request_id), context)
        if record is None:
            return router_pb2.CancelResponse(cancelled=False)
        try:
            reply = await self.channels.stub(record.worker_address).Cancel(
                worker_pb2.CancelRequest(request_id=record.request_id), timeout=2.0
            )
        except grpc.aio.AioRpcError as error:
            raise UnavailableError(f"worker {record.worker_id} did not answer: {error.details()}") from None
        self.records.release(record.request_id)
        return router_pb2.CancelResponse(cancelled=reply.found)

    async def ListWorkers(self, request, context):
        statuses = []
        for w in self.table.workers():
            status = router_pb2.WorkerStatus(
                worker_id=w.worker_id, address=w.address, pid=w.pid, model=w.model, health=cast(common_pb2.WorkerHealth, w.health),
                routing_weight=w.weight, queue_depth=w.queue_depth, running_seqs=w.running_seqs,
                free_blocks=w.free_blocks, total_blocks=w.total_blocks, step_time_ms=w.step_time_ms,
                indexed_blocks=w.indexed_blocks, load_age_s=w.load_age_s, spare=w.spare, routable=w.routable, role=w.role,
            )
            record = self.health_records.get(w.worker_id)
            if record is not None:
                status.circuit = record.circuit
                status.health_reason = record.reason
                status.last_failure = record.last_failure
                status.last_failure_at = record.last_failure_at
            statuses.append(status)
        return router_pb2.ListWorkersResponse(router_id=self.router_id, workers=statuses)

    # -- validation and admission --------------------------------------------
    def _request_id(self, request_id: str) -> str:
        try:
            return validate_request_id(request_id)
        except ValueError as error:
            raise InvalidRequestError("request_id", str(error)) from None

    def _validate(self, request: router_pb2.GenerateRequest, context) -> tuple[Admitted, list[int], SamplingParams]:
        if request.request_id:
            self._request_id(request.request_id)
        admitted = self.admission.admit(tenant=request.tenant, tier=request.tier, api_key=_api_key(context))
        if request.media and self.media is None:
            raise InvalidRequestError("media", "media inputs need the encoder pool, which this deployment does not run")
        prompt_ids, params = request_prompt(request, self._tokenizer(), self.config, context=context_limit(self.registrations))
        return admitted, prompt_ids, params

    # -- routing ----------------------------------------------------------------
    def _route(
        self, prompt_ids: list[int], exclude: frozenset[str] = frozenset(), media: Sequence[common_pb2.MediaEmbedding] = (),
        prefer: str | None = None, noted: bool = False,
    ):
        start = time.perf_counter()
        with tracer.start_as_current_span("router.route") as span:
            spans = [MediaSpan(m.start, m.rows, m.media_hash) for m in media]
            decision = self.table.route(prompt_ids, exclude=exclude, media=spans, prefer=prefer)
            if decision is None:
                raise UnavailableError(
                    "no worker can take the request now" + (f" (excluded: {sorted(exclude)})" if exclude else ""),
                    retry_after_s=self.config.no_worker_retry_after_s,
                )
            span.set_attribute("phalanx.worker_id", decision.worker_id)
            span.set_attribute("phalanx.cached_tokens", decision.cached_tokens)
            span.set_attribute("phalanx.candidates", decision.candidates)
        self.metrics.routing.observe(time.perf_counter() - start)
        self.metrics.cached_tokens.inc(decision.cached_tokens)
        if not (noted and decision.worker_id == prefer):  # admission counted it on its worker already
            self.table.note_routed(decision.worker_id, len(prompt_ids) - decision.cached_tokens)
        return decision

    async def _start(
        self, request_id: str, admitted: Admitted, prompt_ids: list[int], media: list[common_pb2.MediaEmbedding], *, prefer: str | None = None,
        noted: bool = False,
    ):
        """Pick a worker (`prefer` if routable) and claim the request's record; returns (flow, existing record of a retry)."""
        routed = self._route(prompt_ids, media=media, prefer=prefer, noted=noted)
        decision, decode_worker = self.disagg.split(prompt_ids, routed, media)
        record = common_pb2.RequestRecord(
            request_id=request_id, worker_id=decision.worker_id, worker_address=self._address(decision.worker_id),
            router_id=self.router_id, tenant=admitted.tenant, tier=int(admitted.tier), prompt_tokens=len(prompt_ids), created_at=time.time(),
        )
        skipped = self.records.skipped
        existing = self._recent.get(request_id) or await self.records.claim(record)
        self.metrics.unrecorded.inc(self.records.skipped - skipped)
        if existing is not None:
            return None, existing
        self._remember(record)
        return Flow(record, admitted.tier, prompt_ids, media, decode_worker=decode_worker, decode_cached_tokens=routed.cached_tokens), None

    def _address(self, worker_id: str) -> str:
        registration = self.registrations.get(worker_id)
        if registration is None:
            raise UnavailableError(f"worker {worker_id} just left", retry_after_s=0.1)
        return registration.address

    def _remember(self, record: common_pb2.RequestRecord) -> None:
        self._recent[record.request_id] = record
        self._recent.move_to_end(record.request_id)
        while len(self._recent) > _RECENT_RECORDS:
            self._recent.popitem(last=False)

    async def _record(self, request_id: str, context) -> common_pb2.RequestRecord | None:
        record = self._recent.get(request_id) or await self.records.get(request_id)
        if record is not None and self.admission.requires_api_key:
            caller = self.admission.tenant("", _api_key(context))  # no shedding: the request is already running
            if caller != record.tenant:
                return None  # someone else's request: as good as unknown
        return record

    async def _resumable(self, request: router_pb2.ResumeRequest, context) -> Flow:
        request_id = self._request_id(request.request_id)
        if request.tokens_received < 0:
            raise InvalidRequestError("tokens_received", "must be >= 0")
        record = await self._record(request_id, context)
        if record is None:
            raise NotFoundError(f"request {request_id!r} is unknown or no longer resumable (resume window {self.config.resume_window_s} s)")
        return Flow(record, Tier(record.tier or Tier.STANDARD), [], next_index=request.tokens_received)

    # -- worker streams -----------------------------------------------------------
    def _generate(self, flow: Flow, request: router_pb2.GenerateRequest, params) -> AsyncIterator:
        flow.sampling = request.sampling

        def generate(streams: WorkerMultiplexer):
            # Built at each call: a failed media fetch replaces flow.media with the rows inline.
            return streams.generate(worker_pb2.GenerateRequest(
                request_id=flow.record.request_id, tokens=common_pb2.PromptTokens(ids=flow.prompt_ids), sampling=request.sampling,
                priority=int(flow.tier), media=flow.media,
            ))

        return self._worker_stream(flow, generate, retry_elsewhere=True)

    def _attach(self, flow: Flow) -> AsyncIterator:
        attach = worker_pb2.AttachRequest(request_id=flow.record.request_id, from_index=flow.next_index)
        return self._worker_stream(flow, lambda streams: streams.attach(attach), retry_elsewhere=False)

    async def _worker_stream(self, flow: Flow, open_call: _OpenCall, *, retry_elsewhere: bool) -> AsyncIterator:
        """Worker chunks of one request, following handoffs and migrations; re-routes a refused first attempt.

        Which stream comes next is the RelayPolicy's decision; this executes it.
        """
        relay = RelayPolicy(retry_elsewhere=retry_elsewhere, can_migrate=self.moves.can_migrate)
        request_id = flow.record.request_id
        while True:
            call = open_call(self.channels.streams(flow.record.worker_address))
            self.moves.reading(request_id, flow.record.worker_id, call)
            self.quarantine.held(request_id, flow.record.worker_id)
            handoff_chunk = None
            got_any = got_token = False
            broken: grpc.aio.AioRpcError | None = None
            try:
                async for chunk in call:
                    if chunk.index >= 0 and not got_token:
                        got_token = True  # past its prefill or restore there: no longer a suspect of that worker's death
                        self.quarantine.streamed(request_id)
                    got_any = True
                    if chunk.finish_reason == HANDED_BACK:
                        handoff_chunk = chunk
                        break
                    yield chunk
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
                if isinstance(caught, asyncio.CancelledError):
                    if _cancelling():
                        raise  # our own caller's cancellation (the client went away)
                    # The call was cancelled under us (its channel closed): a broken stream, not the end of this
                    # handler, which would otherwise leave the client's stream open with no status until its deadline.
                    caught = _locally_cancelled(flow.record.worker_id)
                broken = caught
            finally:
                call.cancel()
                self.moves.stopped_reading(request_id)
            if flow.decode_worker and (handed_over := await self.disagg.hand_over(flow, handoff_chunk, self._route, self._move)):
                open_call = handed_over  # prefilled on a prefill worker: on to its decode worker (router/disagg_flow.py)
                continue
            if broken is not None and handoff_chunk is None and is_crash(broken):
                # Its worker died under it: a poison request ends here (RequestQuarantinedError) instead of moving on.
                self.quarantine.crashed(request_id, flow.record.worker_id, fingerprint=flow.fingerprint, tenant=flow.record.tenant)
            if broken is not None and flow.media:
                failed = WorkerFailed(got_chunks=got_any, fetch_failed=media_fetch_failed(broken))
                why = f"worker {flow.record.worker_id} could not fetch them ({broken.details()})"
                if isinstance(await self._media_flow().refetch(flow, failed, why), OpenAgain):
                    continue  # the same worker: it submitted nothing
            if self.moves.fenced(flow, handed_back=handoff_chunk is not None):
                # Moved under this relay: nothing more from the old worker, the new owner goes on from the next index.
                relay.moved_under()
                open_call = self._attach_next(flow)
                continue
            worker_id = flow.record.worker_id
            if broken is not None:
                event: StreamEnded | HandedBack | StreamBroke = StreamBroke(worker_id, broken.code(), got_chunks=got_any)
            elif handoff_chunk is not None:
                event = HandedBack(worker_id)
            else:
                event = StreamEnded()
            next_call = await self._follow(flow, relay, relay.on(event), open_call, broken, handoff_chunk)
            if next_call is None:
                return
            open_call = next_call

    async def _follow(
        self, flow: Flow, relay: RelayPolicy, effects: tuple[Effect, ...], open_call: _OpenCall,
        broken: grpc.aio.AioRpcError | None, handoff_chunk: HandoffChunk | None,
    ) -> _OpenCall | None:
        """Executes the relay's effects; returns how to open the next worker stream (None: the relay is over)."""
        while True:
            *first, decision = effects
            for effect in first:
                if isinstance(effect, ReportBroken):
                    self._on_broken_stream(effect.worker_id, broken)
            if isinstance(decision, Migrate):
                avoid = self.quarantine.placement(flow.record.request_id, _candidates(self.table, flow))
                moved = await self.moves.migrate(flow, decision, handoff_chunk, avoid=avoid)
                if moved is not None:
                    self.quarantine.placed(flow.record.request_id, moved.worker_id)
                effects = relay.on(MigrationResult(moved.worker_id if moved is not None else None))
                continue
            if isinstance(decision, RetryElsewhere):
                others = _candidates(self.table, flow) - decision.exclude
                avoid = self.quarantine.placement(flow.record.request_id, others)
                if others - avoid:
                    decision = RetryElsewhere(decision.exclude | avoid)
            return self._open_next(flow, decision, open_call, broken, handoff_chunk)

    def _open_next(
        self, flow: Flow, decision: Effect, open_call: _OpenCall, broken: grpc.aio.AioRpcError | None,
        handoff_chunk: HandoffChunk | None,
    ) -> _OpenCall | None:
        """Executes the effect that decides how the relay goes on."""
        if isinstance(decision, Finish):
            return None
        if isinstance(decision, Fail):
            raise _WorkerStreamError(decision.worker_id, broken)
        if isinstance(decision, GiveUp):
            raise UnavailableError(f"request {flow.record.request_id} was moved {decision.moves} times; giving up", retry_after_s=1.0)
        if isinstance(decision, RetryElsewhere):
            assert broken is not None  # only a broken stream is retried elsewhere
            log.info("worker %s refused %s (%s); routing elsewhere", flow.record.worker_id, flow.record.request_id, broken.code().name)
            self._move(flow, self._route(flow.prompt_ids, decision.exclude, flow.media))
            self.quarantine.placed(flow.record.request_id, flow.record.worker_id)
            return open_call
        if isinstance(decision, AttachMoved):
            return self._attach_next(flow)
        if isinstance(decision, ResumeElsewhere):
            assert handoff_chunk is not None  # only a handed-back stream resumes elsewhere
            handoff = handoff_chunk.handoff
            self.metrics.handoffs.inc()
            route = self._route(list(handoff.prompt_token_ids) + list(handoff.output_token_ids), decision.exclude, flow.media)
            log.info("worker %s handed back %s; continuing on %s", flow.record.worker_id, flow.record.request_id, route.worker_id)
            self._move(flow, route)
            # The media ride along: a resumed prompt recomputes its KV, and its placeholders need the embeddings again.
            return lambda streams: streams.generate(
                worker_pb2.GenerateRequest(request_id=flow.record.request_id, resume_from=handoff, media=flow.media)
            )
        raise AssertionError(f"unexpected relay effect {decision!r}")

    @staticmethod
    def _attach_next(flow: Flow) -> _OpenCall:
        """Attach to the request where it runs now, from the next index the client lacks."""

        def attach(streams: WorkerMultiplexer):
            return streams.attach(worker_pb2.AttachRequest(request_id=flow.record.request_id, from_index=flow.next_index))

        return attach

    def on_migrated(self, event: migration_pb2.MigrationEvent) -> None:
        """A migration moved a request: a relay still reading it from the old worker stops and follows it (fencing)."""
        self.moves.on_migrated(event)

    def on_worker_dead(self, worker_id: str, started_at: float) -> None:
        """Health declared a worker DEAD: relays still reading it stop, as if its stream broke, and migrate."""
        self.moves.on_worker_dead(worker_id, started_at)

    def _media_flow(self) -> MediaFlow:
        assert self.media is not None  # only a request with media gets here, and _validate refused those without an encoder pool
        return self.media

    def _move(self, flow: Flow, decision) -> None:
        self._repoint(flow, decision.worker_id, self._address(decision.worker_id))
        flow.first_sent = False

    def _repoint(self, flow: Flow, worker_id: str, worker_address: str) -> None:
        """The request now runs on `worker_id`: a new record, here and (in the background) in etcd."""
        record = common_pb2.RequestRecord()
        record.CopyFrom(flow.record)
        record.worker_id, record.worker_address = worker_id, worker_address
        flow.record = record
        self._remember(record)
        self.records.update_soon(record)

    async def _relay(self, flow: Flow, chunks: AsyncIterator, response_type) -> AsyncIterator:
        """Client responses from worker chunks: each index once, in order, with latency metrics."""
        tier = flow.tier.label
        ttft, itl, tokens = self.metrics.ttft.labels(tier=tier), self.metrics.itl.labels(tier=tier), self.metrics.tokens
        tenant_tokens = self.metrics.tenant_tokens.labels(tenant=tenant_label(flow.record.tenant, self._tenant_names))
        request_id = flow.record.request_id
        last = time.perf_counter()
        finished = False
        self.metrics.active.inc()
        try:
            async for c in chunks:
                if c.index >= 0:
                    if c.index < flow.next_index:
                        continue  # already delivered (a worker replaying from an earlier index)
                    if c.index > flow.next_index:
                        raise UnavailableError(f"token {flow.next_index} of {request_id} is missing; resume from it", retry_after_s=0.1)
                    flow.next_index += 1
                    flow.output_ids.append(c.token_id)
                    if c.HasField("logprobs"):
                        flow.output_logprobs.append(c.logprobs)
                    self.admission.charge(request_id, c.index)
                    tenant_tokens.inc()
                    now = time.perf_counter()
                    if flow.migrations > flow.stalls_seen:
                        flow.stalls_seen = flow.migrations
                        self.metrics.migration_stall.observe(now - last)
                    elif flow.first_sent:  # a migration's stall is no step of the worker the stream moved to
                        self.gate.on_gap(flow.record.worker_id, now - last, request_id)
                    (itl if flow.first_sent else ttft).observe(now - last)
                    kind = LatencyKind.ITL if flow.first_sent else LatencyKind.TTFT
                    if self.slo.missed(kind, now - last):
                        self.metrics.slo_violations.labels(kind=kind.value).inc()
                    last = now
                    tokens.inc()
                if c.finish_reason:
                    finished = True
                yield _client_response(flow, c, response_type)
        except _WorkerStreamError as error:
            raise error.to_phalanx() from None
        finally:
            self.metrics.active.dec()
            self.quarantine.released(request_id)
            if finished:
                self.records.release(request_id)
                if flow.counts_output:
                    # The client has next_index tokens in all, whichever stream (Generate or a Resume) relayed the last.
                    self.metrics.output_tokens.observe(flow.next_index)


def _client_response(flow: Flow, c, response_type):
    """The client's response for a worker chunk; the first names the worker and the prompt's counts, a move the new worker."""
    out = response_type(request_id=flow.record.request_id, token_id=c.token_id, text=c.text, index=c.index, finish_reason=c.finish_reason)
    if c.HasField("logprobs"):
        out.logprobs.CopyFrom(c.logprobs)
    if c.prompt_logprobs:
        # A worker sends them with index 0, to a stream that starts there; a move's replay skips past it.
        flow.prompt_logprobs = c.prompt_logprobs
        out.prompt_logprobs.extend(c.prompt_logprobs)
    if c.seed and not flow.seed:
        flow.seed = c.seed
    if flow.named_worker != flow.record.worker_id:
        flow.named_worker = out.worker_id = flow.record.worker_id
    if not flow.first_sent:
        flow.first_sent = True
        out.worker_id = flow.record.worker_id
        out.prompt_tokens = c.prompt_tokens
        out.cached_prompt_tokens = c.cached_prompt_tokens
        out.seed = c.seed
    return out


def _candidates(table: RoutingTable, flow: Flow) -> frozenset[str]:
    """The workers a request may move to: the routable ones but its own."""
    return frozenset(w.worker_id for w in table.workers() if w.routable) - {flow.record.worker_id}


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _locally_cancelled(worker_id: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"the call to worker {worker_id} was cancelled locally"
    )


async def _abort(context: grpc.aio.ServicerContext, error: PhalanxError) -> None:
    status = error.status() if isinstance(error, _PassThrough) else None
    if status is not None:
        await context.abort_with_status(status)
    await abort_with(context, error)


class _WorkerStreamError(Exception):
    """A worker stream failed; carries the worker's status to pass on."""

    def __init__(self, worker_id: str, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{worker_id}: {error.code().name}: {error.details()}")
        self.worker_id = worker_id
        self.error = error

    def to_phalanx(self) -> PhalanxError:
        code = self.error.code()
        if code == grpc.StatusCode.NOT_FOUND:
            return NotFoundError(f"worker {self.worker_id} no longer has the request: {self.error.details()}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            return UnavailableError(f"worker {self.worker_id} failed mid-request ({code.name}: {self.error.details()})", retry_after_s=0.2)
        return _PassThrough(self.error)


class _PassThrough(PhalanxError):
    """A worker's own status (e.g. INVALID_ARGUMENT with BadRequest), relayed unchanged."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details() or error.code().name)
        self.error = error
        self.reason = error.code().name

    def status(self) -> grpc.Status | None:
        return _status_of(self.error)
