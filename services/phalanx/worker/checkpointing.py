"""Incremental KV checkpointing: every running request's progress goes to the checkpoint store.

Two halves. `CheckpointCapture` runs on the engine thread between steps: for
every running request it takes the output tokens produced since the last
capture (and a sampled request's generator state) and, once
`interval_tokens` new KV positions are due, copies them too (one gather for
all requests). `CheckpointStreamer` runs on the event loop: it sends the
captures queued since its last message as one message over one gRPC stream to
the store, each request's steps merged into one segment (`coalesced`), reads
the store's acks, and reconnects (re-sending every request from position 0)
when the store restarts.

Tokens every step but KV every few tokens keeps the cost per step small (one
message, a few KB) while a commit is never more than a step behind: a
restore recomputes the at most `interval_tokens` positions between the
committed KV and the committed tokens in one prefill pass. A decode step
never waits for the store: while the queue is over its byte budget, capture
takes tokens only, and KV follows in one larger segment later (coarser
batching instead of a stall).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from phalanx._proto import checkpoint_pb2, common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import CheckpointStoreDirectory
from phalanx.common.lease import Backoff
from phalanx.common.tls import open_channel
from phalanx.worker.engine import Engine
from phalanx.worker.sequence import MediaEmbedding, RequestSnapshot, Sequence

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Checkpoint messages are cut at segment boundaries to about this size at most (see stream_requests).
_MESSAGE_BYTES = 1 << 20
# A piece with KV joins its request's piece before it in a message while both hold at most this many positions
# together: copying them into one is cheaper than a segment more (see coalesced).
_MERGE_KV_TOKENS = 64


@dataclass(slots=True)
class _Piece:
    """One request's part of a capture."""

    request_id: str
    seq: int
    kv_start: int
    kv_end: int
    # [layers, 2, kv_end - kv_start, heads, dim]; None when kv_end == kv_start. A numpy array from a simulated engine.
    kv: torch.Tensor | Any
    state: RequestSnapshot | None  # the whole state when kv_start == 0, or when taking over a commit
    appended: list[int]
    generator_state: bytes
    seed: int
    copy_id: int = 0  # the request's copy on this worker (Sequence.copy_id)
    media: tuple[MediaEmbedding, ...] = ()  # with a whole state: the prompt's media embeddings, for restores anywhere


@dataclass
class _Capture:
    pieces: list[_Piece] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    nbytes: int = 0


class CheckpointCapture:
    """The engine-thread half; `streamer` decides whether to capture and takes what is captured."""

    def __init__(self, max_pending_bytes: int = 64 << 20, *, interval_tokens: int = 8) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.interval_tokens = interval_tokens
        self._lock = threading.Lock()
        self._queue: collections.deque[_Capture] = collections.deque()
        self._pending_bytes = 0
        self.connected = False
        # Set from the event loop: re-send these requests (or all) from position 0.
        self._resync_all = False
        self._resync: set[str] = set()
        # Copies (request id, copy id) whose commit the store says moved to another copy: not sent any more.
        self._superseded: set[tuple[str, int]] = set()
        self._notify: Callable[[], object] | None = None  # called (thread-safe) when something was queued
        self.lag_tokens = 0
        self.captures_skipped = 0

    # -- called from the event loop -------------------------------------------
    def resync(self, request_id: str | None = None) -> None:
        with self._lock:
            if request_id is None:
                self._resync_all = True
                self._queue.clear()
                self._pending_bytes = 0
            else:
                self._resync.add(request_id)

    def superseded(self, request_id: str, copy_id: int) -> None:
        """The store refused this copy of the request (it runs elsewhere now): stop sending it."""
        with self._lock:
            self._superseded.add((request_id, copy_id))

    def take(self) -> list[_Capture]:
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
            return items

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    # -- the engine thread ------------------------------------------------------
    def capture(self, engine: Engine) -> None:
        released, engine.released = engine.released, []
        if not self.connected:
            return
        with self._lock:
            resync_all, self._resync_all = self._resync_all, False
            resync, self._resync = self._resync, set()
            over_budget = self._pending_bytes > self.max_pending_bytes
            if released and self._superseded:
                gone = set(released)
                self._superseded = {copy for copy in self._superseded if copy[0] not in gone}
            superseded = set(self._superseded)
        lag = 0
        todo: list[tuple[Sequence, int, int]] = []  # (seq, kv_start, kv_end); kv_start == kv_end: tokens only
        for seq in engine.running:
            if seq.canary or seq.prefix_only or (seq.request_id, seq.copy_id) in superseded:
                continue
            if resync_all or seq.request_id in resync:
                seq.ckpt_kv = seq.ckpt_outputs = 0
                seq.ckpt_adopt = False
            end = seq.num_computed
            if seq.ckpt_kv == 0:  # the first segment: whole state and all KV so far (the prompt's, mostly)
                if over_budget:
                    lag += end
                elif end > 0:
                    todo.append((seq, 0, end))
                continue
            due = end - seq.ckpt_kv  # negative while recomputing KV the store has already (after a preemption)
            if due >= self.interval_tokens and not over_budget:
                todo.append((seq, seq.ckpt_kv, end))
                continue
            lag += max(0, due)
            if len(seq.output_ids) > seq.ckpt_outputs or seq.ckpt_adopt:
                todo.append((seq, seq.ckpt_kv, seq.ckpt_kv))
        if over_budget:
            self.captures_skipped += 1
        self.lag_tokens = lag
        if not todo and not released:
            return
        capture = _Capture(released=released)
        with_kv = [(seq, start, end) for seq, start, end in todo if end > start]
        kv = engine.cache.gather_ranges(engine.kv, [(seq.request_id, start, end) for seq, start, end in with_kv]) if with_kv else None
        offset = 0
        for seq, start, end in todo:
            piece_kv = None
            if end > start:
                assert kv is not None  # gathered for every piece with end > start
                piece_kv = kv[:, :, offset : offset + end - start]
                offset += end - start
                capture.nbytes += piece_kv.nbytes
            seq.ckpt_seq += 1
            media: tuple[MediaEmbedding, ...] = ()
            if start == 0 or seq.ckpt_adopt:  # the whole state: a new commit, or one this worker takes over
                state, appended, media = seq.snapshot(), [], tuple(seq.media)
                seq.ckpt_adopt = False
            else:
                state, appended = None, seq.output_ids[seq.ckpt_outputs :]
            generator_state = b"" if seq.params.greedy else seq.sampler.state()
            capture.pieces.append(_Piece(
                seq.request_id, seq.ckpt_seq, start, end, piece_kv, state, appended, generator_state, seq.sampler.seed, seq.copy_id,
                media,
            ))
            seq.ckpt_kv = end
            seq.ckpt_outputs = len(seq.output_ids)
        with self._lock:
            wake = not self._queue  # one wake-up per fill: the streamer takes everything queued by then
            self._queue.append(capture)
            self._pending_bytes += capture.nbytes
        if wake and self._notify is not None:
            self._notify()


class CheckpointStreamer:
    """The event-loop half: one stream to the store found in etcd, kept up for the worker's life."""

    def __init__(
        self, capture: CheckpointCapture, *, worker_id: str, model_version: str, layout: checkpoint_pb2.KvLayout,
        channel_endpoint: str, etcd_config: EtcdConfig, sent_bytes=None, snapshot_to_proto=None, flush_interval_s: float = 0.0,
    ) -> None:
        self.capture = capture
        # Captures queued within this of the last message go in the next one: fewer, larger messages (each costs the
        # event loop, whose GIL the engine thread shares, about the same whatever its size).
        self.flush_interval_s = flush_interval_s
        self.worker_id = worker_id
        self.hello = checkpoint_pb2.Hello(worker_id=worker_id, model_version=model_version, layout=layout, channel_endpoint=channel_endpoint)
        self.etcd_config = etcd_config
        self._sent_bytes = sent_bytes  # a Counter (labelled), or None
        self._snapshot_to_proto = snapshot_to_proto
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.store_address = ""
        self.acked_segments = 0
        self.bytes_sent = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.capture._notify = lambda: loop.call_soon_threadsafe(self._wake.set)
        self._task = asyncio.create_task(self._run(), name="checkpoint-streamer")

    async def stop(self) -> None:
        self.capture.connected = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        backoff = Backoff(initial=0.05, cap=1.0)
        stores = CheckpointStoreDirectory(self.etcd_config)
        failed = ""
        try:
            while True:
                try:
                    address = pick_store(await stores.addresses(), failed)
                except Exception as exc:  # noqa: BLE001 - etcd away: keep serving, try again
                    log.debug("no checkpoint store lookup: %r", exc)
                    address = None
                if address is None:
                    await asyncio.sleep(min(1.0, backoff.next() * 4))
                    continue
                failed = address  # unless it ends well: the next lookup then prefers another store
                try:
                    await self._stream(address)
                    backoff.reset()
                    failed = ""
                except (grpc.aio.AioRpcError, ConnectionError, TimeoutError) as exc:
                    log.warning("checkpoint stream to %s broke (%s); re-syncing every request", address, _describe(exc))
                except Exception:
                    log.exception("checkpoint stream to %s failed; re-syncing every request", address)
                finally:
                    self.capture.connected = False
                    self.capture.resync()
                await asyncio.sleep(backoff.next())
        finally:
            await stores.close()

    async def _stream(self, address: str) -> None:
        async with open_channel(
            address, options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        ) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=2.0)
            # Messages go out as bytes written here (see stream_requests); the store reads plain StreamRequests.
            call = channel.stream_stream(
                _STREAM_METHOD, request_serializer=_as_is, response_deserializer=checkpoint_pb2.StreamResponse.FromString
            )()
            await call.write(checkpoint_pb2.StreamRequest(hello=self.hello).SerializeToString())
            self.store_address = address
            self.capture.resync()
            self.capture.connected = True
            log.info("checkpointing to the store at %s", address)
            acks = asyncio.create_task(self._read_acks(call))
            try:
                while True:
                    if acks.done():
                        acks.result()  # raises what broke the stream
                        raise ConnectionError("the store ended the stream")
                    items = self.capture.take()
                    if not items:
                        self._wake.clear()
                        waiter = asyncio.ensure_future(self._wake.wait())
                        await asyncio.wait({waiter, acks}, return_when=asyncio.FIRST_COMPLETED)
                        waiter.cancel()
                        if self.flush_interval_s > 0:
                            await asyncio.sleep(self.flush_interval_s)  # let the next steps' captures join this message
                        continue
                    await self._send(call, items)
            finally:
                acks.cancel()
                call.cancel()
                self.store_address = ""

    async def _send(self, call, items: list[_Capture]) -> None:
        """Every queued capture, in capture order (so each request's segments stay in order), in messages of ~1 MiB."""
        for message in stream_requests(items, self._snapshot_to_proto):
            await call.write(message)
        nbytes = sum(item.nbytes for item in items)  # not len(segment.kv): each read of a bytes field copies it
        self.bytes_sent += nbytes
        if self._sent_bytes is not None and nbytes:
            self._sent_bytes.inc(nbytes)
        self.capture.sent(nbytes)

    async def _read_acks(self, call) -> None:
        async for response in call:
            self.acked_segments += len(response.acks)
            for ack in response.acks:
                if ack.resync:
                    self.capture.resync(ack.request_id)
                elif ack.superseded:
                    log.info("checkpoint of %s refused: the request runs elsewhere now; not sending it any more", ack.request_id)
                    self.capture.superseded(ack.request_id, ack.copy_id)


def pick_store(addresses: list[str], failed: str) -> str | None:
    """The first advertised store, passing over the one whose stream just broke while another is advertised.

    A crashed store stays advertised until its lease lapses (a TTL); its replacement is usually there already.
    """
    candidates = [a for a in addresses if a != failed] or addresses
    return candidates[0] if candidates else None


def batch_of(captures: list[_Capture], snapshot_to_proto) -> checkpoint_pb2.Batch:
    """Captures, in order, as the one message that carries them to the store (each request's segments stay in order).

    A request's steps join its segment before them in the message where they continue it (see `coalesced`): the
    store then applies about one segment per request and message, not one per step, and ends in the same state.
    The streamer sends this message as `stream_requests` writes it.
    """
    batch = checkpoint_pb2.Batch()
    for capture in captures:
        batch.released_request_ids.extend(capture.released)
    for piece in coalesced(captures):
        segment = batch.segments.add()
        segment.CopyFrom(_segment_without_kv(piece, snapshot_to_proto))
        if piece.kv is not None:
            segment.kv = tensor_bytes(piece.kv)
            if segment.kv:
                segment.kv_crc32 = zlib.crc32(segment.kv)
    return batch


def stream_requests(captures: list[_Capture], snapshot_to_proto, *, max_bytes: int = _MESSAGE_BYTES) -> list[bytes]:
    """``StreamRequest(batch=batch_of(captures))`` serialized, as messages of about ``max_bytes`` at most, in order.

    Each segment's KV is copied once, into its message. Through protobuf it was copied three times more (to bytes,
    into the field, out to the wire), each time into fresh memory: serializing was the largest part of a worker's
    checkpointing cost. Here protobuf serializes every segment but its KV, and the KV field (bytes: on the wire it
    may come last, as fields go in any order) and the length prefixes of the enclosing messages are written around
    it. Segments go into messages of ``max_bytes`` or fewer (one larger segment goes alone), the release list into
    the last: grpc writes a stream of 1 MiB messages several times faster than one large message (MEASURED.md), and
    the store applies the messages' segments in the same order.
    """
    messages: list[bytes] = []
    parts: list[bytes | memoryview] = []
    size = 0
    for piece in coalesced(captures):
        kv = _c_order_bytes(piece.kv) if piece.kv is not None else b""
        segment_fields = _segment_without_kv(piece, snapshot_to_proto)
        if len(kv):
            segment_fields.kv_crc32 = zlib.crc32(kv)  # the store checks the KV against it, on write and before a restore
        body = segment_fields.SerializeToString()
        kv_field = [_KV_TAG, _varint(len(kv)), kv] if len(kv) else []
        segment = [_SEGMENTS_TAG, _varint(len(body) + sum(len(p) for p in kv_field)), body, *kv_field]
        length = sum(len(p) for p in segment)
        if parts and size + length > max_bytes:
            messages.append(_batch_message(parts, size))
            parts, size = [], 0
        parts += segment
        size += length
    released = checkpoint_pb2.Batch(released_request_ids=[r for capture in captures for r in capture.released]).SerializeToString()
    messages.append(_batch_message([*parts, released], size + len(released)))
    return messages


def _batch_message(parts: list[bytes | memoryview], size: int) -> bytes:
    """A StreamRequest whose batch is ``parts`` (serialized fields of a Batch, ``size`` bytes in all)."""
    return b"".join([_BATCH_TAG, _varint(size), *parts])


def _segment_without_kv(piece: _Piece, snapshot_to_proto) -> checkpoint_pb2.Segment:
    segment = checkpoint_pb2.Segment(
        request_id=piece.request_id, seq=piece.seq, kv_start=piece.kv_start, kv_end=piece.kv_end,
        appended_output_ids=piece.appended, generator_state=piece.generator_state, seed=piece.seed, copy_id=piece.copy_id,
    )
    if piece.state is not None:
        segment.state.CopyFrom(snapshot_to_proto(piece.state))
        segment.media.extend(media_to_proto(item) for item in piece.media)
    return segment


def media_to_proto(item: MediaEmbedding) -> common_pb2.MediaEmbedding:
    """One media item's embeddings as they travel (common.proto's MediaEmbedding), in their dtype, from host memory."""
    rows = item.embeddings
    return common_pb2.MediaEmbedding(
        start=item.span.start, rows=item.span.length, hidden=rows.shape[-1], dtype=str(rows.dtype).removeprefix("torch."),
        data=tensor_bytes(rows), media_hash=item.span.media_hash,
    )


# The wire keys (field number << 3 | 2, length-delimited) of StreamRequest.batch, Batch.segments and Segment.kv
# (checkpoint.proto); a unit test checks that stream_requests parse back into what protobuf writes.
_BATCH_TAG = bytes([2 << 3 | 2])
_SEGMENTS_TAG = bytes([1 << 3 | 2])
_KV_TAG = bytes([5 << 3 | 2])
_STREAM_METHOD = "/phalanx.checkpoint.v1.CheckpointStore/Stream"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _as_is(message: bytes) -> bytes:
    return message


def _c_order_bytes(tensor: torch.Tensor | Any) -> memoryview:
    """The tensor's raw C-order bytes: a view where it is contiguous, else of a contiguous copy (kept alive by the view).

    A numpy array (a simulated engine's KV) the same; a GPU tensor (a CUDA worker's KV) comes to host memory first.
    """
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data
    import torch

    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def coalesced(captures: list[_Capture]) -> list[_Piece]:
    """The captures' pieces, in order, each merged into its request's piece before it where it continues that one.

    A merged piece spans both KV ranges, appends both pieces' outputs and takes the later one's seq and generator
    state: what the store would hold after applying the two one after the other. A piece with a whole state starts a
    new one, and so does one whose KV would make the merged piece's long (merging copies KV once more).
    """
    pieces: list[_Piece] = []
    last: dict[str, int] = {}  # request id -> index in pieces of its latest piece
    merged: set[int] = set()
    for capture in captures:
        for request_id in capture.released:  # ended before this capture: its id may come back as a new request
            last.pop(request_id, None)
        for piece in capture.pieces:
            index = last.get(piece.request_id)
            if index is None or not _joins(pieces[index], piece):
                last[piece.request_id] = len(pieces)
                pieces.append(piece)
                continue
            if index not in merged:  # a copy takes the merges: the captures' own pieces stay as they were
                pieces[index] = replace(pieces[index])
                merged.add(index)
            head = pieces[index]
            if piece.kv is not None:
                head.kv = piece.kv if head.kv is None else _concat_positions(head.kv, piece.kv)
                head.kv_end = piece.kv_end
            if head.state is not None:  # a whole state: the outputs go into it, which the store takes as it is
                head.state = replace(head.state, output_ids=[*head.state.output_ids, *piece.appended])
            else:
                head.appended = head.appended + piece.appended
            head.seq = piece.seq
            if piece.generator_state:
                head.generator_state = piece.generator_state
    return pieces


def _concat_positions(first: torch.Tensor | Any, second: torch.Tensor | Any) -> torch.Tensor | Any:
    """Two KV pieces [layers, 2, positions, heads, dim] one after the other along the positions (torch or numpy)."""
    if isinstance(first, np.ndarray):
        return np.concatenate([first, second], axis=2)
    import torch

    return torch.cat([first, second], dim=2)


def _joins(head: _Piece, piece: _Piece) -> bool:
    """Whether ``piece`` (the request's next) merges into ``head``: it continues it, and brings no state and little KV."""
    if piece.state is not None or piece.kv_start != head.kv_end or piece.copy_id != head.copy_id:
        return False
    return piece.kv is None or head.kv_end - head.kv_start + piece.kv_end - piece.kv_start <= _MERGE_KV_TOKENS


def tensor_bytes(tensor: torch.Tensor | Any) -> bytes:
    """The tensor's raw C-order bytes, any dtype (numpy has no bfloat16, so through a byte view).

    One copy: numpy writes a strided array (a piece of a capture's gather) out in C order itself. A numpy array (a
    simulated engine's KV) is written as it is; a GPU tensor (a CUDA worker's KV) comes to host memory first.
    """
    if isinstance(tensor, np.ndarray):
        return tensor.tobytes()
    import torch

    if tensor.device.type != "cpu":
        tensor = tensor.contiguous().cpu()
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        tensor = tensor.contiguous().view(-1)
    return tensor.view(torch.uint8).numpy().tobytes()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
