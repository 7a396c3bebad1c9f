"""gRPC shell of the worker: protos in, domain objects to the engine, domain errors out as status."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.errors import InvalidRequestError, NotFoundError, PhalanxError, UnavailableError
from phalanx.common.grpc_status import abort_with
from phalanx.model.params import SamplingParams, sampling_from_proto
from phalanx.worker.async_engine import AsyncEngine
from phalanx.worker.engine import EngineRequest
from phalanx.worker.metrics import WorkerMetrics
from phalanx.worker.sequence import FinishReason, RequestSnapshot, TokenEvent
from phalanx.worker.streams import RequestLog, RequestStreams

MAX_PROMPT_CHARS = 1 << 20
CANARY_MAX_TOKENS = 64


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, max_tokens=p.max_tokens,
        stop_token_ids=p.stop_token_ids, stop_strings=p.stop_strings, ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def snapshot_to_proto(s: RequestSnapshot) -> common_pb2.RequestState:
    params = sampling_to_proto(s.params)
    params.seed = s.seed
    return common_pb2.RequestState(
        request_id=s.request_id, prompt_token_ids=s.prompt_ids, output_token_ids=s.output_ids,
        sampling=params, generator_state=s.generator_state,
    )


def event_to_proto(cls, event: TokenEvent):
    """A GenerateResponse or an AttachResponse (the same fields) for one event."""
    chunk = cls(
        request_id=event.request_id, token_id=event.token_id, text=event.text, index=event.index,
        finish_reason=int(event.finish_reason), prompt_tokens=event.prompt_tokens,
        cached_prompt_tokens=event.cached_prompt_tokens, seed=event.seed,
    )
    if event.handoff is not None:
        chunk.handoff.CopyFrom(snapshot_to_proto(event.handoff))
    return chunk


def snapshot_from_proto(state: common_pb2.RequestState) -> RequestSnapshot:
    if not state.sampling.HasField("seed"):
        raise InvalidRequestError("resume_from.sampling.seed", "a resumed request needs the seed it started with")
    return RequestSnapshot(
        request_id=state.request_id, prompt_ids=list(state.prompt_token_ids), output_ids=list(state.output_token_ids),
        params=sampling_from_proto(state.sampling), seed=state.sampling.seed, generator_state=state.generator_state,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Registered before the server starts; answers UNAVAILABLE until `attach()` gives it the engine.

    Requests outlive the calls that started them: their output goes to a
    RequestLog (streams.py) that Generate and Attach read from any index.
    """

    def __init__(
        self, worker_id: str, metrics: WorkerMetrics, *, on_drain, kv_sequence,
        detach_grace_s: float = 15.0, retain_s: float = 30.0, max_retained: int = 10_000,
    ) -> None:
        self.worker_id = worker_id
        self._kv_sequence = kv_sequence
        self._engine: AsyncEngine | None = None
        self.metrics = m = metrics
        self._on_drain = on_drain
        self._ttft, self._itl, self._generated = m.for_worker(m.ttft), m.for_worker(m.itl), m.for_worker(m.generated_tokens)
        self._prompt, self._cached_prompt = m.for_worker(m.prompt_tokens), m.for_worker(m.cached_prompt_tokens)
        self.streams = RequestStreams(
            abort=self._abort, detach_grace_s=detach_grace_s, retain_s=retain_s, max_retained=max_retained,
            on_detach=m.for_worker(m.detached).inc, on_detach_timeout=m.for_worker(m.detach_timeouts).inc,
        )

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.tokenizer = engine.engine.tokenizer

    def close(self) -> None:
        """Ends what still waits on a request log and stops detach timers; idempotent."""
        self.streams.close()

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise UnavailableError("worker is still loading its model", retry_after_s=1.0)
        return self._engine

    def _abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    def _prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            if len(request.text) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("prompt.text", f"longer than {MAX_PROMPT_CHARS} characters")
            return self.tokenizer.encode(request.text) if request.text else []
        if which == "tokens":
            return list(request.tokens.ids)
        return []

    def _engine_request(self, request: worker_pb2.GenerateRequest) -> EngineRequest:
        # The id is fixed here, not by the engine, so that a retry can find the request's log.
        if request.HasField("resume_from"):
            snapshot = snapshot_from_proto(request.resume_from)
            request_id = request.request_id or snapshot.request_id or uuid.uuid4().hex
            return EngineRequest(snapshot.prompt_ids, snapshot.params, request_id, resume=snapshot)
        return EngineRequest(self._prompt_ids(request), sampling_from_proto(request.sampling), request.request_id or uuid.uuid4().hex)

    def _count(self, error: BaseException | None) -> None:
        status = "ok" if error is None else getattr(error, "reason", "internal").lower()
        self.metrics.requests.labels(worker=self.worker_id, status=status).inc()

    def _observer(self) -> Callable[[TokenEvent], None]:
        """Metrics of one request, taken as its events arrive: once per token, however many read it."""
        ttft, itl, generated = self._ttft, self._itl, self._generated
        last = time.perf_counter()
        first = True

        def on_event(event: TokenEvent) -> None:
            nonlocal last, first
            if event.index >= 0:
                now = time.perf_counter()
                (ttft if first else itl).observe(now - last)
                generated.inc()
                last, first = now, False
            if event.prompt_tokens:
                self._prompt.inc(event.prompt_tokens)
                self._cached_prompt.inc(event.cached_prompt_tokens)
            if event.finish_reason is not FinishReason.NONE:
                self._count(event.error)

        return on_event

    async def _submit(self, engine: AsyncEngine, request: EngineRequest, log: RequestLog) -> None:
        try:
            await engine.submit(request, log)
        except asyncio.CancelledError:
            raise  # the caller left during admission: the request may still start, and detaches like any other
        except Exception as exc:
            # Not retained, and a retry that joined meanwhile gets the same error.
            self.streams.discard(log, exc)
            raise

    async def Generate(self, request, context):
        try:
            engine = self.engine
            engine_request = self._engine_request(request)
        except PhalanxError as exc:
            self._count(exc)
            await abort_with(context, exc)
        streams = self.streams
        log = streams.get(engine_request.request_id)
        fresh = log is None
        if fresh:
            resumed = engine_request.resume
            log = streams.start(
                engine_request.request_id, first_index=len(resumed.output_ids) if resumed else 0, on_event=self._observer()
            )
        try:
            with streams.reader(log):
                if fresh:
                    await self._submit(engine, engine_request, log)
                async for event in log.read(log.first_index):
                    yield event_to_proto(worker_pb2.GenerateResponse, event)
        except PhalanxError as exc:
            await abort_with(context, exc)

    async def Attach(self, request, context):
        try:
            if request.from_index < 0:
                raise InvalidRequestError("from_index", "must be >= 0")
            log = self.streams.get(request.request_id)
            if log is None:
                raise NotFoundError(f"request {request.request_id!r} is not running on this worker and did not finish recently")
            self.metrics.for_worker(self.metrics.attaches).inc()
            with self.streams.reader(log):
                async for event in log.read(request.from_index):
                    yield event_to_proto(worker_pb2.AttachResponse, event)
        except PhalanxError as exc:
            await abort_with(context, exc)

    async def Cancel(self, request, context):
        found = self.streams.cancel(request.request_id)
        if found:
            self.metrics.for_worker(self.metrics.cancels).inc()
        return worker_pb2.CancelResponse(found=found)

    async def Canary(self, request, context):
        try:
            prompt = self._prompt_ids(request)
            max_tokens = request.max_tokens or 8
            if not 0 < max_tokens <= CANARY_MAX_TOKENS:
                raise InvalidRequestError("max_tokens", f"must be in [1, {CANARY_MAX_TOKENS}], got {max_tokens}")
            engine_request = EngineRequest(
                prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"canary-{time.monotonic_ns()}", record_top_logits=True
            )
            start = time.perf_counter()
            tokens, logits = [], []
            async for event in self.engine.generate(engine_request):
                tokens.append(event.token_id)
                logits.append(event.top_logit)
            return worker_pb2.CanaryResponse(
                token_ids=tokens, top_logits=logits, latency_s=time.perf_counter() - start, model=self.engine.engine.model.config.name
            )
        except PhalanxError as exc:
            await abort_with(context, exc)

    async def Stats(self, request, context):
        try:
            e = self.engine.engine
        except PhalanxError as exc:
            await abort_with(context, exc)
        load = self.engine.load()
        return worker_pb2.StatsResponse(
            worker_id=self.worker_id, model=e.model.config.name, queue_depth=load.queue_depth,
            running_seqs=load.running_seqs, free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            step_time_ms=load.step_time_ms, decode_tokens_per_s=load.decode_tokens_per_s,
            prefill_tokens_per_s=load.prefill_tokens_per_s, prefix_cache_hit_tokens=e.prefix_hit_tokens,
            prompt_tokens_total=e.prompt_tokens_total, generated_tokens_total=e.generated_tokens_total,
            preemptions_total=e.preemptions, draining=self.engine.draining, deterministic=e.config.deterministic,
            max_model_len=e.config.max_model_len,
        )

    async def Drain(self, request, context):
        try:
            if request.grace_s < 0:
                raise InvalidRequestError("grace_s", "must be >= 0")
            finished, handed_back = await self._on_drain(self.engine, request.grace_s)
        except PhalanxError as exc:
            await abort_with(context, exc)
        return worker_pb2.DrainResponse(finished=finished, handed_back=handed_back)

    async def KvSnapshot(self, request, context):
        # Read before the blocks: events numbered after it may be reflected in
        # them already, and replaying add/remove events in order converges.
        sequence = self._kv_sequence()
        try:
            blocks = await self.engine.cached_blocks()
        except PhalanxError as exc:
            await abort_with(context, exc)
        return worker_pb2.KvSnapshotResponse(
            worker_id=self.worker_id, sequence=sequence,
            blocks=[common_pb2.KvBlockStored(block_hash=h, parent_hash=p, num_tokens=n) for h, p, n in blocks],
        )


async def drain_engine(engine: AsyncEngine, grace_s: float) -> tuple[int, int]:
    """Stops admission, lets running requests finish for up to grace_s, hands back the rest."""
    engine.draining = True
    in_flight = engine.num_requests
    deadline = time.monotonic() + grace_s
    while engine.num_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    remaining = engine.num_requests
    if remaining:
        engine.hand_back_all()
        while engine.num_requests and time.monotonic() < deadline + 2.0:
            await asyncio.sleep(0.01)
    return in_flight - remaining, remaining
