"""gRPC shell of the worker: protos in, domain objects to the engine, domain errors out as status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from phalanx._proto import common_pb2, migration_pb2, migration_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.common.block_hash import MediaSpan
from phalanx.common.buffers import BufferPool
from phalanx.common.errors import InvalidRequestError, NotFoundError, PhalanxError, ResourceExhaustedError, UnavailableError
from phalanx.common.grpc_channels import GrpcChannels
from phalanx.common.subjects import check_send_request
from phalanx.model.kv_cache import BLOCK_SIZE
from phalanx.model.params import SamplingParams, sampling_from_proto
from phalanx.worker.checkpointing import tensor_bytes
from phalanx.worker.engine import EngineRequest, ParkPick
from phalanx.worker.engine_frontend import EngineFrontend
from phalanx.worker.kv_fetch import KvFetcher, KvFetchPolicy
from phalanx.worker.media_fetch import MediaFetcher, has_sourced_media
from phalanx.worker.metrics import WorkerMetrics
from phalanx.worker.multiplex import MultiplexedStream
from phalanx.worker.sequence import FinishReason, MediaEmbedding, PositionLogprobs, RequestSnapshot, TokenEvent, TokenLogprob
from phalanx.worker.streams import RequestLog, RequestStreams

if TYPE_CHECKING:
    import torch

    from phalanx.common.channels import ChannelEndpoint

logger = logging.getLogger(__name__)  # `log` names request logs here

MAX_PROMPT_CHARS = 1 << 20
CANARY_MAX_TOKENS = 64


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, max_tokens=p.max_tokens,
        stop_token_ids=p.stop_token_ids, stop_strings=p.stop_strings, ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, top_logprobs=p.top_logprobs, prompt_logprobs=p.prompt_logprobs,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def snapshot_to_proto(s: RequestSnapshot) -> common_pb2.RequestState:
    params = sampling_to_proto(s.params)
    params.seed = s.seed
    return common_pb2.RequestState(
        request_id=s.request_id, prompt_token_ids=s.prompt_ids, output_token_ids=s.output_ids,
        sampling=params, generator_state=s.generator_state, priority=s.priority,
        media=[common_pb2.MediaSpanRecord(start=m.start, rows=m.length, media_hash=m.media_hash) for m in s.media_spans],
        output_logprobs=[logprobs_to_proto(p) for p in s.output_logprobs],
        prompt_logprobs=[logprobs_to_proto(p) for p in s.prompt_logprobs],
    )


def _token_to_proto(t: TokenLogprob, msg: common_pb2.TokenLogprob) -> None:
    msg.token_id = t.token_id
    if t.logprob is not None:
        msg.logprob = t.logprob
    msg.token_bytes = t.token_bytes


def logprobs_to_proto(p: PositionLogprobs, msg: common_pb2.PositionLogprobs | None = None) -> common_pb2.PositionLogprobs:
    msg = msg if msg is not None else common_pb2.PositionLogprobs()
    _token_to_proto(p.token, msg.token)
    for t in p.top:
        _token_to_proto(t, msg.top.add())
    return msg


def _token_from_proto(t: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(t.token_id, t.logprob if t.HasField("logprob") else None, t.token_bytes)


def logprobs_from_proto(p: common_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(_token_from_proto(p.token), tuple(_token_from_proto(t) for t in p.top))


def event_to_proto(cls, event: TokenEvent):
    """A GenerateResponse or an AttachResponse (the same fields) for one event."""
    chunk = cls()
    fill_chunk(chunk, event)
    return chunk


def fill_chunk(chunk, event: TokenEvent, handoff_source: str = "") -> None:
    """Sets a new GenerateResponse's (or AttachResponse's) fields from one event.

    Fields that are set one by one, and only when not zero: per token this runs
    for every request of every engine step, on the loop the engine thread shares the GIL with.
    """
    chunk.request_id = event.request_id
    chunk.token_id = event.token_id
    chunk.index = event.index
    if event.text:
        chunk.text = event.text
    if event.finish_reason:
        chunk.finish_reason = int(event.finish_reason)
    if event.prompt_tokens:
        chunk.prompt_tokens = event.prompt_tokens
        chunk.cached_prompt_tokens = event.cached_prompt_tokens
    if event.seed:
        chunk.seed = event.seed
    if event.handoff is not None:
        chunk.handoff.CopyFrom(snapshot_to_proto(event.handoff))
        chunk.handoff_kv_tokens = event.handoff_kv_tokens
    if event.handoff_kv_tokens and handoff_source:
        chunk.handoff_source = handoff_source  # where the parked KV waits
    if event.logprobs is not None:
        logprobs_to_proto(event.logprobs, chunk.logprobs)
    if event.prompt_logprobs:
        for p in event.prompt_logprobs:
            logprobs_to_proto(p, chunk.prompt_logprobs.add())


_MEDIA_DTYPES = ("bfloat16", "float16", "float32")


def media_from_proto(index: int, item: common_pb2.MediaEmbedding, fetched: torch.Tensor | None = None) -> MediaEmbedding:
    """A request's media embeddings as a tensor (`fetched`: its rows, from the encoder that held them); the engine checks
    they fit the prompt and the model."""
    if item.dtype not in _MEDIA_DTYPES:
        raise InvalidRequestError(f"media[{index}].dtype", f"{item.dtype!r} is not one of {sorted(_MEDIA_DTYPES)}")
    import torch  # here, not at the top: a simulated worker that serves no media never imports it

    dtype = getattr(torch, item.dtype)
    if item.rows < 1 or item.hidden < 1 or item.start < 0:
        raise InvalidRequestError(f"media[{index}]", "start must be >= 0, rows and hidden >= 1")
    if fetched is not None:
        return MediaEmbedding(MediaSpan(item.start, item.rows, item.media_hash), fetched)
    expected = item.rows * item.hidden * torch.empty((), dtype=dtype).element_size()
    if len(item.data) != expected:
        raise InvalidRequestError(f"media[{index}].data", f"{len(item.data)} bytes for {item.rows} x {item.hidden} {item.dtype}")
    values = torch.frombuffer(bytearray(item.data), dtype=dtype).view(item.rows, item.hidden)
    return MediaEmbedding(MediaSpan(item.start, item.rows, item.media_hash), values)


def snapshot_from_proto(state: common_pb2.RequestState) -> RequestSnapshot:
    if not state.sampling.HasField("seed"):
        raise InvalidRequestError("resume_from.sampling.seed", "a resumed request needs the seed it started with")
    return RequestSnapshot(
        request_id=state.request_id, prompt_ids=list(state.prompt_token_ids), output_ids=list(state.output_token_ids),
        params=sampling_from_proto(state.sampling), seed=state.sampling.seed, generator_state=state.generator_state,
        priority=state.priority, media_spans=tuple(MediaSpan(m.start, m.rows, m.media_hash) for m in state.media),
        output_logprobs=tuple(logprobs_from_proto(p) for p in state.output_logprobs),
        prompt_logprobs=tuple(logprobs_from_proto(p) for p in state.prompt_logprobs),
    )


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Registered before the server starts; answers UNAVAILABLE until `attach()` gives it the engine.

    Requests outlive the calls that started them: their output goes to a
    RequestLog (streams.py) that Generate and Attach read from any index.
    """

    def __init__(
        self, worker_id: str, metrics: WorkerMetrics, *, on_drain, on_undrain, kv_sequence,
        address: str = "", channels: ChannelEndpoint | None = None, channel_timeout_s: float = 10.0,
        channel_min_bytes: int = 32 << 20, media_channel_min_bytes: int = 4 << 20, checkpointing_to: Callable[[], str] = lambda: "",
        detach_grace_s: float = 15.0, retain_s: float = 30.0, max_retained: int = 10_000, max_retained_bytes: int = 256 << 20,
    ) -> None:
        self.worker_id = worker_id
        self._kv_sequence = kv_sequence
        self._engine: EngineFrontend | None = None
        self.metrics = m = metrics
        # (engine, grace_s, keep_running) -> (finished, handed back); (engine) -> undrained
        self._on_drain = on_drain
        self._on_undrain = on_undrain
        self.model_version = ""
        self.address = address  # where this worker's parked KV can be fetched (KvSource)
        self.channels = channels  # its tensor-channel endpoint; None: KV moves over gRPC only
        self.kv_sources = GrpcChannels(_BULK_OPTIONS)  # the checkpoint stores and workers KV is restored from
        self.checkpointing_to = checkpointing_to  # the store this worker's checkpoints stream to now, if any
        self.channel_timeout_s = channel_timeout_s
        self.channel_min_bytes = channel_min_bytes  # smaller KV from a source with no channel kept goes over gRPC
        self._warming: dict[str, asyncio.Task] = {}  # channels being formed ahead of the next transfer, by source key
        self.kv_buffers = BufferPool(_KV_BUFFER_KEEP_BYTES)  # what restores receive KV into
        self.stall_kv_send = ""  # chaos (WorkerConfig.chaos_stall_kv_send): KV of request ids containing it is sent late
        # Media embeddings an encoder holds for this worker's requests (the router's direct delivery).
        self.media = MediaFetcher(
            channels, KvFetchPolicy(media_channel_min_bytes), metrics, timeout_s=channel_timeout_s, worker_id=worker_id
        )
        self._ttft, self._itl, self._generated = m.for_worker(m.ttft), m.for_worker(m.itl), m.for_worker(m.generated_tokens)
        self._prompt, self._cached_prompt = m.for_worker(m.prompt_tokens), m.for_worker(m.cached_prompt_tokens)
        # Calls that still owe their caller chunks: Generate and Attach while they run, a Multiplex while it has subscriptions
        # or chunks to write (an idle one, open for the next request, owes nothing). Shutdown waits for these alone.
        self._streaming_calls = 0
        self._multiplexes: set[MultiplexedStream] = set()
        self.streams = RequestStreams(
            abort=self._abort, detach_grace_s=detach_grace_s, retain_s=retain_s, max_retained=max_retained,
            max_retained_bytes=max_retained_bytes,
            on_detach=m.for_worker(m.detached).inc, on_detach_timeout=m.for_worker(m.detach_timeouts).inc,
        )

    def attach(self, engine: EngineFrontend, model_version: str = "") -> None:
        self._engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.model_version = model_version
        # The first restore after a failure is the one that counts: its buffer is touched now, not on its clock.
        cache = engine.engine.cache
        if not getattr(cache, "simulated", False):  # a simulated cache receives into numpy arrays of a few bytes
            self.kv_buffers.reserve(engine.engine.config.max_model_len * cache.bytes_per_block // BLOCK_SIZE)

    async def close(self) -> None:
        """Ends what still waits on a request log, stops detach timers, closes channels to KV sources; idempotent."""
        self.streams.close()
        warming = list(self._warming.values())
        for task in warming:
            task.cancel()
        await asyncio.gather(*warming, return_exceptions=True)
        await self.kv_sources.close()
        await self.media.close()

    @property
    def engine(self) -> EngineFrontend:
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

    def _engine_request(self, request: worker_pb2.GenerateRequest, fetched: dict[int, torch.Tensor]) -> EngineRequest:
        # The id is fixed here, not by the engine, so that a retry can find the request's log.
        media = [media_from_proto(i, m, fetched.get(i)) for i, m in enumerate(request.media)]
        if request.HasField("resume_from"):
            snapshot = snapshot_from_proto(request.resume_from)
            request_id = request.request_id or snapshot.request_id or uuid.uuid4().hex
            return EngineRequest(snapshot.prompt_ids, snapshot.params, request_id, resume=snapshot, media=media)
        return EngineRequest(
            self._prompt_ids(request), sampling_from_proto(request.sampling), request.request_id or uuid.uuid4().hex, priority=request.priority,
            media=media,
        )

    async def fetch_media(self, request: worker_pb2.GenerateRequest) -> dict[int, torch.Tensor]:
        """The rows of the request's media that an encoder holds (direct delivery), by index; none for a retry of a
        request this worker has already. FAILED_PRECONDITION (subject media.source) if they cannot come."""
        if not has_sourced_media(request.media) or (request.request_id and self.streams.get(request.request_id) is not None):
            return {}
        try:
            return await self.media.fetch(request.media)
        except PhalanxError as exc:
            self._count(exc)
            raise

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

    async def submit(self, engine: EngineFrontend, request: EngineRequest, log: RequestLog) -> None:
        try:
            await engine.submit(request, log)
        except asyncio.CancelledError:
            raise  # the caller left during admission: the request may still start, and detaches like any other
        except Exception as exc:
            # Not retained, and a retry that joined meanwhile gets the same error.
            self.streams.discard(log, exc)
            raise

    def generate_log(
        self, request: worker_pb2.GenerateRequest, fetched: dict[int, torch.Tensor] | None = None,
    ) -> tuple[RequestLog, EngineRequest | None]:
        """The log a Generate reads, and its request to submit (None: a retry of a request this worker has already).

        `fetched`: the media rows ``fetch_media`` brought."""
        try:
            self.engine  # noqa: B018 - raises UNAVAILABLE while the model loads
            engine_request = self._engine_request(request, fetched or {})
        except PhalanxError as exc:
            self._count(exc)
            raise
        existing = self.streams.get(engine_request.request_id)
        if existing is not None:
            return existing, None
        resumed = engine_request.resume
        log = self.streams.start(
            engine_request.request_id, first_index=len(resumed.output_ids) if resumed else 0, on_event=self._observer()
        )
        return log, engine_request

    def attach_log(self, request: worker_pb2.AttachRequest) -> RequestLog:
        """The log an Attach reads."""
        if request.from_index < 0:
            raise InvalidRequestError("from_index", "must be >= 0")
        log = self.streams.get(request.request_id)
        if log is None:
            raise NotFoundError(f"request {request.request_id!r} is not running on this worker and did not finish recently")
        self.metrics.for_worker(self.metrics.attaches).inc()
        return log

    async def Generate(self, request, context):
        with self._streaming():
            fetched = await self.fetch_media(request)
            log, engine_request = self.generate_log(request, fetched)
            with self.streams.reader(log):
                if engine_request is not None:
                    await self.submit(self.engine, engine_request, log)
                async for event in log.read(log.first_index):
                    yield self.chunk(worker_pb2.GenerateResponse, event)

    async def Attach(self, request, context):
        with self._streaming():
            log = self.attach_log(request)
            with self.streams.reader(log):
                async for event in log.read(request.from_index):
                    yield self.chunk(worker_pb2.AttachResponse, event)

    async def Multiplex(self, request_iterator, context):
        stream = MultiplexedStream(self)
        self._multiplexes.add(stream)
        try:
            async for response in stream.serve(request_iterator):
                yield response
        finally:
            self._multiplexes.discard(stream)

    @contextlib.contextmanager
    def _streaming(self) -> Iterator[None]:
        self._streaming_calls += 1
        try:
            yield
        finally:
            self._streaming_calls -= 1

    async def chunks_written(self, timeout_s: float) -> bool:
        """Waits (up to `timeout_s`) until no call owes its caller a chunk; False if one still did at the timeout."""
        deadline = time.monotonic() + timeout_s
        while self._streaming_calls or any(stream.owes_chunks for stream in self._multiplexes):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def chunk(self, cls, event: TokenEvent):
        chunk = cls()
        fill_chunk(chunk, event, self.address)
        return chunk

    def fill_chunk(self, chunk: worker_pb2.GenerateResponse, event: TokenEvent) -> None:
        fill_chunk(chunk, event, self.address)

    # -- migration ----------------------------------------------------------------
    async def Restore(self, request, context):
        """Brings migrated requests back here; each gets a result (a short target refuses, the rest go on)."""
        engine = self.engine
        timeout = request.timeout_s or self.channel_timeout_s
        prepared, results = [], {}
        continues_commits = bool(request.kv_source_address) and request.kv_source_address == self.checkpointing_to()
        # Direct delivery: a request's media may come as handles into the encoder that holds them, fetched here the way
        # Generate fetches them (the router then holds no rows for a migration either).
        fetched = await asyncio.gather(*(self._restore_media(item) for item in request.items), return_exceptions=True)
        for item, media in zip(request.items, fetched, strict=True):
            if isinstance(media, PhalanxError):
                results[item.state.request_id] = _failed(item.state.request_id, media)
                continue
            if isinstance(media, BaseException):
                raise media
            try:
                engine_request = self._restore_request(item, engine, media)
                engine_request.continues_commit = continues_commits and item.method == migration_pb2.MIGRATION_METHOD_CHECKPOINT
                prepared.append((item, engine_request))
            except PhalanxError as exc:
                results[item.state.request_id] = _failed(item.state.request_id, exc)
        wants_kv = [(item, er) for item, er in prepared if _kv_method(item) and item.kv_tokens > 0]
        kv: dict[str, torch.Tensor | Any] = {}
        kv_bytes, transfer_s = 0, 0.0
        if wants_kv:
            start = time.perf_counter()
            kv = await self._receive_kv(
                [item for item, _ in wants_kv], request.kv_source_address, request.transport, timeout, engine
            )
            transfer_s = time.perf_counter() - start
            kv_bytes = sum(t.nbytes for t in kv.values())

        async def restore_one(item, engine_request: EngineRequest) -> worker_pb2.RestoreResult:
            request_id = engine_request.request_id
            try:
                log = self.streams.start_migrated(request_id, on_event=self._observer())
            except ValueError as exc:
                return _failed(request_id, InvalidRequestError("request_id", str(exc)))
            try:
                if _kv_method(item):
                    kv_tokens = item.kv_tokens if request_id in kv else 0
                    await engine.restore(engine_request, kv.get(request_id), kv_tokens, log)
                else:
                    await engine.submit(engine_request, log)
            except PhalanxError as exc:
                self.streams.discard(log, exc)
                return _failed(request_id, exc)
            return worker_pb2.RestoreResult(request_id=request_id, ok=True, kv_tokens=item.kv_tokens if request_id in kv else 0)

        # Together: the engine takes them all at its next step boundary, not one per step.
        for result in await asyncio.gather(*(restore_one(item, engine_request) for item, engine_request in prepared)):
            results[result.request_id] = result
        if not getattr(engine.engine.cache, "simulated", False):
            for tensor in kv.values():  # the engine copied each into its cache (or refused it): reusable
                self.kv_buffers.give(tensor)
        self.metrics.for_worker(self.metrics.restores).inc(sum(1 for r in results.values() if r.ok))
        return worker_pb2.RestoreResponse(
            results=[results[i.state.request_id] for i in request.items if i.state.request_id in results],
            kv_bytes=kv_bytes, transfer_s=transfer_s,
        )

    async def _restore_media(self, item: migration_pb2.RestoreItem) -> dict[int, torch.Tensor]:
        """The rows of a restored request's media that an encoder holds, by index; FAILED_PRECONDITION (subject
        media.source) if they cannot come."""
        if not has_sourced_media(item.media):
            return {}
        self._check_room(item.state)  # a worker without the KV blocks refuses before it fetches the rows, too
        return await self.media.fetch(item.media)

    def _check_room(self, state: common_pb2.RequestState) -> None:
        """ResourceExhaustedError unless the KV blocks of a restored request's tokens (and the next) are free here."""
        needed = -(-(len(state.prompt_token_ids) + len(state.output_token_ids) + 1) // BLOCK_SIZE)
        if needed > self.engine.load().free_blocks:
            raise ResourceExhaustedError(f"{needed} KV blocks are not free here", retry_after_s=0.1)

    def _restore_request(self, item, engine: EngineFrontend, fetched: dict[int, torch.Tensor] | None = None) -> EngineRequest:
        state = common_pb2.RequestState()
        state.CopyFrom(item.state)
        if not state.sampling.HasField("seed"):
            state.sampling.seed = item.seed
        snapshot = snapshot_from_proto(state)
        if not snapshot.request_id:
            raise InvalidRequestError("items.state.request_id", "is required")
        if item.kv_from_token and not (item.method == migration_pb2.MIGRATION_METHOD_TRANSFER and 0 < item.kv_from_token < item.kv_tokens):
            raise InvalidRequestError("items.kv_from_token", f"must be 0, or in (0, kv_tokens {item.kv_tokens}) with a TRANSFER")
        request = EngineRequest(
            snapshot.prompt_ids, snapshot.params, snapshot.request_id, resume=snapshot, migrated=True,
            sequential_replay=item.method == migration_pb2.MIGRATION_METHOD_SEQUENTIAL_REPLAY,
            media=[media_from_proto(i, m, (fetched or {}).get(i)) for i, m in enumerate(item.media)],
            kv_from_token=item.kv_from_token,
        )
        engine.engine.validate(request)
        self._check_room(state)
        return request

    async def _receive_kv(self, items, source: str, transport: int, timeout: float, engine: EngineFrontend) -> dict[str, torch.Tensor | Any]:
        """KV of each item from `source` (a KvSource) into fresh tensors, over a tensor channel or gRPC."""
        if not source:
            raise InvalidRequestError("kv_source_address", "is required for transfer and checkpoint restores")
        cache = engine.engine.cache
        layers, _, _, _, heads, dim = cache.full_shape
        if getattr(cache, "simulated", False):
            simulated: Any = cache  # worker/simulated.py's SimulatedKvCache
            buffers = {i.state.request_id: simulated.empty((layers, 2, i.kv_tokens - i.kv_from_token, heads, dim)) for i in items}
        else:
            buffers = {
                i.state.request_id: self.kv_buffers.take((layers, 2, i.kv_tokens - i.kv_from_token, heads, dim), cache.data.dtype)
                for i in items
            }
        pieces = [migration_pb2.KvPiece(request_id=i.state.request_id, kv_tokens=i.kv_tokens, from_token=i.kv_from_token) for i in items]
        stub = migration_pb2_grpc.KvSourceStub(self.kv_sources.get(source))
        fetcher = KvFetcher(self.channels, KvFetchPolicy(self.channel_min_bytes), warming=self._warming)
        try:
            await fetcher.fetch(stub, source, pieces, buffers, timeout, grpc_requested=transport == migration_pb2.KV_TRANSPORT_GRPC)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.kv_sources.discard(source)  # a new connection next time, not one stuck in reconnect backoff
            raise UnavailableError(f"the KV source {source} failed: {error.code().name}: {error.details()}", retry_after_s=0.1) from None
        return buffers

    async def Park(self, request, context):
        ttl = request.ttl_s or 10.0
        if request.limit < 0 or request.min_remaining_tokens < 0:
            raise InvalidRequestError("limit", "limit and min_remaining_tokens must be >= 0")
        pick = None
        if request.limit and not request.request_ids:
            pick = ParkPick(request.limit, frozenset(request.exclude_request_ids), request.min_remaining_tokens)
        events = await self.engine.park(list(request.request_ids) or None, ttl, pick)
        return worker_pb2.ParkResponse(
            parked=[_parked(e) for e in events],
            channel_endpoint=self.channels.endpoint_id if self.channels is not None else "",
        )

    async def Cancel(self, request, context):
        found = self.streams.cancel(request.request_id)
        if found:
            self.metrics.for_worker(self.metrics.cancels).inc()
        return worker_pb2.CancelResponse(found=found)

    async def Canary(self, request, context):
        prompt = self._prompt_ids(request)
        max_tokens = request.max_tokens or 8
        if not 0 < max_tokens <= CANARY_MAX_TOKENS:
            raise InvalidRequestError("max_tokens", f"must be in [1, {CANARY_MAX_TOKENS}], got {max_tokens}")
        engine_request = EngineRequest(
            prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"canary-{time.monotonic_ns()}",
            record_top_logits=True, canary=True,
        )
        start = time.perf_counter()
        tokens: list[int] = []
        logits: list[float] = []
        margins: list[float] = []
        text: list[str] = []
        held = 0  # the most requests it ran beside (health judges its latency by them, not by lagging load reports)
        async for event in self.engine.generate(engine_request):
            load = self.engine.load()
            held = max(held, load.running_seqs + load.queue_depth)
            if event.index >= 0:
                assert event.top_logit is not None and event.top_margin is not None  # a canary records them
                tokens.append(event.token_id)
                logits.append(event.top_logit)
                margins.append(event.top_margin)
                text.append(event.text)
            if event.finish_reason in (FinishReason.ABORTED, FinishReason.HANDED_BACK):
                raise UnavailableError("the canary was interrupted: the worker is stopping", retry_after_s=0.5)
        latency = time.perf_counter() - start
        return worker_pb2.CanaryResponse(
            token_ids=tokens, top_logits=logits, top_margins=margins, latency_s=latency,
            model=self.engine.engine.model.config.name, model_version=self.model_version, text="".join(text),
            held_requests=held, step_s=latency / max(1, len(tokens)),
        )

    async def Prefill(self, request, context):
        """Fills the prefix cache with a request's text prefix while its media are encoded (see the proto)."""
        prompt = list(request.tokens.ids)
        if not prompt:
            raise InvalidRequestError("tokens", "must not be empty")
        # One token is sampled (an engine sequence ends on one), then dropped: the blocks stay cached once it ends.
        engine_request = EngineRequest(
            prompt, SamplingParams(max_tokens=1, ignore_eos=True), f"prefill-{request.request_id}-{time.monotonic_ns()}", prefix_only=True,
        )
        cached = 0
        async for event in self.engine.generate(engine_request):
            if event.prompt_tokens:
                cached = event.cached_prompt_tokens
            if event.finish_reason in (FinishReason.ABORTED, FinishReason.HANDED_BACK):
                raise UnavailableError("the prefix prefill was interrupted: the worker is stopping", retry_after_s=0.5)
        return worker_pb2.PrefillResponse(prompt_tokens=len(prompt), cached_tokens=cached)

    async def Stats(self, request, context):
        e = self.engine.engine
        load = self.engine.load()
        return worker_pb2.StatsResponse(
            worker_id=self.worker_id, model=e.model.config.name, queue_depth=load.queue_depth,
            running_seqs=load.running_seqs, free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            step_time_ms=load.step_time_ms, decode_tokens_per_s=load.decode_tokens_per_s,
            prefill_tokens_per_s=load.prefill_tokens_per_s, prefix_cache_hit_tokens=e.prefix_hit_tokens,
            prompt_tokens_total=e.prompt_tokens_total, generated_tokens_total=e.generated_tokens_total,
            preemptions_total=e.preemptions, draining=self.engine.draining, deterministic=e.config.deterministic,
            max_model_len=e.config.max_model_len, canary_tokens_total=e.canary_tokens_computed,
            computed_tokens_total=e.tokens_computed, canaries_total=e.canaries_total, model_version=self.model_version,
        )

    async def Drain(self, request, context):
        if not math.isfinite(request.grace_s) or request.grace_s < 0:
            raise InvalidRequestError("grace_s", "must be a finite number of seconds >= 0")
        finished, handed_back = await self._on_drain(self.engine, request.grace_s, request.keep_running)
        return worker_pb2.DrainResponse(finished=finished, handed_back=handed_back)

    async def Undrain(self, request, context):
        undrained = await self._on_undrain(self.engine)
        return worker_pb2.UndrainResponse(undrained=undrained)

    async def KvSnapshot(self, request, context):
        # Read before the blocks: events numbered after it may be reflected in
        # them already, and replaying add/remove events in order converges.
        sequence = self._kv_sequence()
        blocks = await self.engine.cached_blocks()
        return worker_pb2.KvSnapshotResponse(
            worker_id=self.worker_id, sequence=sequence,
            blocks=[common_pb2.KvBlockStored(block_hash=h, parent_hash=p, num_tokens=n) for h, p, n in blocks],
        )


def _kv_method(item) -> bool:
    return item.method in (migration_pb2.MIGRATION_METHOD_TRANSFER, migration_pb2.MIGRATION_METHOD_CHECKPOINT)


def _parked(event: TokenEvent) -> worker_pb2.ParkedRequest:
    assert event.handoff is not None  # park() answers with the handed-back events
    return worker_pb2.ParkedRequest(state=snapshot_to_proto(event.handoff), seed=event.handoff.seed, kv_tokens=event.handoff_kv_tokens)


def _failed(request_id: str, exc: PhalanxError) -> worker_pb2.RestoreResult:
    return worker_pb2.RestoreResult(request_id=request_id, ok=False, code=exc.reason, message=str(exc), subject=getattr(exc, "subject", ""))


# Receive buffers kept for the next restore (see BufferPool).
_KV_BUFFER_KEEP_BYTES = 64 << 20
_BULK_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
_CHUNK_BYTES = 1 << 20


class KvSourceServicer(migration_pb2_grpc.KvSourceServicer):
    """This worker's parked KV, sent to a migration target."""

    def __init__(self, servicer: WorkerServicer) -> None:
        self.worker = servicer

    async def SendKv(self, request, context):
        engine = self.worker.engine
        channels = self.worker.channels
        if channels is None:
            raise UnavailableError("this worker has no tensor-channel endpoint; use FetchKv", retry_after_s=0.1)
        check_send_request(request.target_endpoint, request.channel_id, request.timeout_s)
        timeout = request.timeout_s or self.worker.channel_timeout_s
        await _chaos_stall(self.worker.stall_kv_send, request.pieces)
        start = time.perf_counter()
        tensors = [await engine.export_kv(p.request_id, p.kv_tokens, p.from_token) for p in request.pieces]
        # Kept afterwards: a drain moves many requests to the same few targets.
        async with channels.opened(request.target_endpoint, request.channel_id, reuse=request.reuse_channel, timeout_s=timeout) as channel:
            for tensor in tensors:
                await channel.send(tensor, timeout_s=timeout)
        for p in request.pieces:
            await engine.unpark(p.request_id)
        nbytes = sum(t.nbytes for t in tensors)
        self.worker.metrics.kv_sent_bytes.labels(worker=self.worker.metrics.worker_id, transport="channel").inc(nbytes)
        return migration_pb2.SendKvResponse(bytes=nbytes, seconds=time.perf_counter() - start)

    async def FetchKv(self, request, context):
        engine = self.worker.engine
        await _chaos_stall(self.worker.stall_kv_send, request.pieces)
        for index, p in enumerate(request.pieces):
            data = tensor_bytes(await engine.export_kv(p.request_id, p.kv_tokens, p.from_token))
            for offset in range(0, len(data), _CHUNK_BYTES):
                yield migration_pb2.FetchKvResponse(piece=index, data=data[offset : offset + _CHUNK_BYTES])
            self.worker.metrics.kv_sent_bytes.labels(worker=self.worker.metrics.worker_id, transport="grpc").inc(len(data))
        for p in request.pieces:
            await engine.unpark(p.request_id)


async def _chaos_stall(marker: str, pieces) -> None:
    """A hung KV transfer (chaos): a minute's wait before sending a piece whose request id contains `marker`."""
    if marker and any(marker in p.request_id for p in pieces):
        logging.getLogger(__name__).warning("chaos: stalling the KV transfer of %s", [p.request_id for p in pieces])
        await asyncio.sleep(_CHAOS_STALL_S)


_CHAOS_STALL_S = 60.0


async def drain_engine(engine: EngineFrontend, grace_s: float, *, keep_running: bool = False, park_ttl_s: float = 0.0) -> tuple[int, int]:
    """Stops admission, lets running requests finish for up to grace_s, hands back the rest.

    Canaries are not counted and not handed back. With keep_running the
    worker stays up admitting canaries only (a quarantine); without, it
    admits nothing more. A quarantine lifted meanwhile (Undrain) ends the
    drain early and hands nothing back.
    """
    engine.draining = True
    if not keep_running:
        engine.exiting = True
    in_flight = engine.num_requests
    deadline = time.monotonic() + grace_s
    while engine.num_requests and time.monotonic() < deadline and engine.draining:
        await asyncio.sleep(0.02)
    remaining = engine.num_requests
    if not engine.draining:
        return in_flight - remaining, 0
    if remaining:
        if park_ttl_s > 0:
            # Their KV waits here for park_ttl_s, so migration can transfer it instead of recomputing.
            await engine.park(None, park_ttl_s)
        else:
            engine.hand_back_all()
        while engine.num_requests and time.monotonic() < deadline + 2.0:
            await asyncio.sleep(0.01)
    return in_flight - remaining, remaining
