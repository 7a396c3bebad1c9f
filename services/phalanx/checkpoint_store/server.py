"""gRPC shell of the checkpoint store: CheckpointStore (workers stream in) and KvSource (restores go out)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import torch

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, migration_pb2, migration_pb2_grpc
from phalanx.checkpoint_store.metrics import CheckpointMetrics
from phalanx.checkpoint_store.store import CheckpointStore, CorruptCheckpointError, InvalidCheckpointError, SegmentResult, Writer, byte_view
from phalanx.common.buffers import BufferPool
from phalanx.common.errors import InvalidRequestError, UnavailableError
from phalanx.common.subjects import validate_request_id
from phalanx.common.telemetry import get_tracer

if TYPE_CHECKING:
    from phalanx.common.channels import ChannelEndpoint

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

# FetchKv's chunk size: well under gRPC's default 4 MiB message limit on the receiving side.
FETCH_CHUNK_BYTES = 1 << 20
# Restores' staging buffers kept for the next restore (see BufferPool).
_STAGING_KEEP_BYTES = 64 << 20
# Errors of torch.distributed and sockets under a tensor channel that the channel module may let through.
_CHANNEL_FAILURES = (TimeoutError, ConnectionError, OSError, RuntimeError)


class CheckpointStoreServicer(checkpoint_pb2_grpc.CheckpointStoreServicer, migration_pb2_grpc.KvSourceServicer):
    """Both services of the store over one ``CheckpointStore``; ``channel_endpoint`` is set once the process started it."""

    def __init__(self, store: CheckpointStore, metrics: CheckpointMetrics, *, channel_timeout_s: float) -> None:
        self.store = store
        self.metrics = metrics
        self.channel_timeout_s = channel_timeout_s
        self.channel_endpoint: ChannelEndpoint | None = None
        self.streams: Counter[str] = Counter()  # open streams per worker
        self.restores_total = 0
        self.staging = BufferPool(_STAGING_KEEP_BYTES)
        self.staging.reserve(_STAGING_KEEP_BYTES // 4)  # touched now: the first restore after a failure is the one that counts

    # -- CheckpointStore ------------------------------------------------------------------------

    async def Stream(self, request_iterator, context) -> AsyncIterator[checkpoint_pb2.StreamResponse]:
        writer: Writer | None = None
        try:
            async for message in request_iterator:
                body = message.WhichOneof("body")
                if writer is None:
                    if body != "hello":
                        raise InvalidCheckpointError("hello", "the first message of a checkpoint stream must be a Hello")
                    writer = Writer.from_hello(message.hello)
                    self._connected(writer.worker_id, +1)
                elif body == "batch":
                    yield self._apply(writer, message.batch)
                else:
                    raise InvalidCheckpointError(body or "body", "expected a Batch after the Hello")
        finally:
            if writer is not None:
                self._connected(writer.worker_id, -1)

    def _apply(self, writer: Writer, batch: checkpoint_pb2.Batch) -> checkpoint_pb2.StreamResponse:
        response = checkpoint_pb2.StreamResponse()
        for segment in batch.segments:
            ack = self.store.apply(writer, segment)
            if ack.result is SegmentResult.APPLIED and ack.kv_bytes and not segment.HasField("kv_crc32"):
                self.metrics.unchecked_segments.inc()
            self.metrics.bytes_received.inc(ack.kv_bytes)
            self.metrics.segments.labels(result=ack.result.value).inc()
            if ack.result is SegmentResult.GAP:
                log.info("request %s from %s: gap at KV %d (store has %d); resync",
                         ack.request_id, writer.worker_id, segment.kv_start, ack.kv_tokens)
            response.acks.append(ack.to_proto())
        for request_id in batch.released_request_ids:
            self.store.release(request_id, worker_id=writer.worker_id)
        self.metrics.observe_store(self.store)
        return response

    async def GetCommit(self, request, context) -> checkpoint_pb2.GetCommitResponse:
        media = self.store.media(request.request_id)  # first: embeddings it cannot read back leave media_held 0
        return checkpoint_pb2.GetCommitResponse(commit=self.store.get(request.request_id), media=media)

    async def ListCommits(self, request, context) -> checkpoint_pb2.ListCommitsResponse:
        return checkpoint_pb2.ListCommitsResponse(commits=self.store.records(request.worker_id))

    async def Stats(self, request, context) -> checkpoint_pb2.StatsResponse:
        stats = self.store.stats()
        return checkpoint_pb2.StatsResponse(
            requests=stats.requests, memory_bytes=stats.memory_bytes, spilled_bytes=stats.spilled_bytes,
            bytes_received_total=stats.bytes_received_total, segments_applied_total=stats.segments_total[SegmentResult.APPLIED],
            connected_workers=len(self.streams), restores_total=self.restores_total,
        )

    # -- KvSource -------------------------------------------------------------------------------

    async def SendKv(self, request, context) -> migration_pb2.SendKvResponse:
        """Each piece's KV [L, 2, kv_tokens, H, D], in order, over a tensor channel to ``target_endpoint``.

        The store's tensors are on CPU, so the channel is a gloo one: the target accepts with ``device="cpu"``.
        """
        started = time.perf_counter()
        sent = 0
        pieces = self._check_pieces(request.pieces, required=False)  # none: only form the channel and keep it
        if not request.target_endpoint:
            raise InvalidRequestError("target_endpoint", "required: the tensor-channel endpoint id of the target worker")
        try:
            validate_request_id(request.channel_id)  # the same alphabet as channel ids
        except ValueError:
            raise InvalidRequestError("channel_id", "need 1-128 characters of [A-Za-z0-9_.:-]") from None
        endpoint = self.channel_endpoint
        if endpoint is None:
            raise UnavailableError("the store's tensor-channel endpoint is not up yet", retry_after_s=1.0)
        deadline = time.monotonic() + (request.timeout_s if request.timeout_s > 0 else self.channel_timeout_s)
        with tracer.start_as_current_span(
            "checkpoint.restore", attributes={"phalanx.transport": "channel", "phalanx.pieces": len(pieces)}
        ) as span:
            # Kept between restores into the same target: forming a channel costs more than sending a request's KV.
            with _channel_failure(request.target_endpoint):
                async with endpoint.opened(
                    request.target_endpoint, request.channel_id, reuse=request.reuse_channel, timeout_s=_left(deadline)
                ) as channel:
                    for piece in pieces:
                        tensor = self._read(piece)
                        await channel.send(tensor, timeout_s=_left(deadline))
                        self.staging.give(tensor)
                        sent += tensor.nbytes
            span.set_attribute("phalanx.bytes", sent)
        seconds = time.perf_counter() - started
        if pieces:
            self._restored("channel", len(pieces), seconds)
        return migration_pb2.SendKvResponse(bytes=sent, seconds=seconds)

    async def FetchKv(self, request, context) -> AsyncIterator[migration_pb2.FetchKvResponse]:
        """Each piece's KV bytes (C order [L, 2, kv_tokens, H, D]) as chunks of at most 1 MiB, in order."""
        started = time.perf_counter()
        pieces = self._check_pieces(request.pieces)
        for index, piece in enumerate(pieces):
            tensor = self._read(piece)
            data = byte_view(tensor)
            for offset in range(0, len(data), FETCH_CHUNK_BYTES):
                yield migration_pb2.FetchKvResponse(piece=index, data=bytes(data[offset : offset + FETCH_CHUNK_BYTES]))
            self.staging.give(tensor)
        self._restored("grpc", len(pieces), time.perf_counter() - started)

    # -- helpers --------------------------------------------------------------------------------

    def _read(self, piece: migration_pb2.KvPiece) -> torch.Tensor:
        """The piece's KV in a staging buffer: give it back once sent (not after a failed send, which may still read it)."""
        layout = self.store.check(piece.request_id, piece.kv_tokens)
        out = self.staging.take(layout.shape(piece.kv_tokens), layout.dtype)
        try:
            return self.store.read_kv(piece.request_id, piece.kv_tokens, out)
        except CorruptCheckpointError:
            self.staging.give(out)
            self.metrics.corrupt_restores.inc()
            raise

    def _check_pieces(self, pieces, *, required: bool = True) -> list[migration_pb2.KvPiece]:
        """Every piece committed (so that nothing is sent when one would fail), else the error for the first that is not."""
        if required and not pieces:
            raise InvalidRequestError("pieces", "at least one piece is required")
        for i, piece in enumerate(pieces):
            try:
                validate_request_id(piece.request_id)
            except ValueError as error:
                raise InvalidRequestError(f"pieces[{i}].request_id", str(error)) from None
            self.store.check(piece.request_id, piece.kv_tokens)
        return list(pieces)

    def _connected(self, worker_id: str, delta: int) -> None:
        self.streams[worker_id] += delta
        if self.streams[worker_id] <= 0:
            del self.streams[worker_id]
        self.metrics.connected_workers.set(len(self.streams))

    def _restored(self, transport: str, requests: int, seconds: float) -> None:
        self.restores_total += requests
        self.metrics.restores.labels(transport=transport).inc(requests)
        self.metrics.restore_seconds.labels(transport=transport).observe(seconds)


def _left(deadline: float) -> float:
    """Seconds to the deadline (a little at least, so the last step fails by its own timeout)."""
    return max(deadline - time.monotonic(), 0.001)


@contextlib.contextmanager
def _channel_failure(target: str) -> Iterator[None]:
    """Low-level failures of a tensor channel surface as UnavailableError (the ChannelError family)."""
    try:
        yield
    except _CHANNEL_FAILURES as error:
        raise UnavailableError(f"tensor channel to {target!r} failed: {type(error).__name__}: {error}") from error
