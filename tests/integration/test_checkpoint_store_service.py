"""The checkpoint store process against a real etcd: workers stream KV in over gRPC, restores come out over gRPC and
tensor channels byte-exact, the store advertises itself under a lease and leaves on SIGTERM.

One store for the module (the process imports torch: seconds); tests run in file order and the last one stops it.
"""

from __future__ import annotations

import asyncio
import signal
import time
import zlib

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, common_pb2, migration_pb2, migration_pb2_grpc
from phalanx.common.channels import TensorChannel
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import decode_json
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import CHECKPOINT_STORES_PREFIX
from phalanx.launch.services import CheckpointStoreHandle, start_checkpoint_store
from phalanx.launch.stack import unique_id
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MEMORY_LIMIT = 1 << 20  # small enough that the long request below spills
F32 = checkpoint_pb2.KvLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32")  # 1 KiB per token
BF16 = checkpoint_pb2.KvLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16")


@pytest.fixture(scope="module")
def store(etcd_server, tmp_path_factory):
    etcd_config = EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)
    spill_dir = tmp_path_factory.mktemp("ckpt-spill")
    handle = asyncio.run(
        start_checkpoint_store(
            unique_id("ckpt"), etcd_config, "--memory-limit-bytes", str(MEMORY_LIMIT), "--spill-dir", str(spill_dir)
        )
    )
    handle.spill_dir = spill_dir
    try:
        yield handle
    finally:
        handle.kill()


def shape(layout: checkpoint_pb2.KvLayout, tokens: int) -> tuple[int, ...]:
    return (layout.num_layers, 2, tokens, layout.num_kv_heads, layout.head_dim)


def random_kv(layout: checkpoint_pb2.KvLayout, tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape(layout, tokens), generator=generator).to(getattr(torch, layout.dtype))


def raw(kv: torch.Tensor) -> bytes:
    return kv.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class FakeWorker:
    """One Stream as a worker drives it: a Hello, then segments and releases; reads the acks."""

    def __init__(self, store: CheckpointStoreHandle, worker_id: str, layout: checkpoint_pb2.KvLayout) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self._grpc = grpc.aio.insecure_channel(store.address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.call = checkpoint_pb2_grpc.CheckpointStoreStub(self._grpc).Stream()
        self.seq: dict[str, int] = {}

    async def __aenter__(self) -> FakeWorker:
        await self.call.write(checkpoint_pb2.StreamRequest(hello=checkpoint_pb2.Hello(
            worker_id=self.worker_id, model_version="tiny@1", layout=self.layout, channel_endpoint=f"ep-{self.worker_id}")))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._grpc.close()

    async def segment(self, request_id: str, kv: torch.Tensor, start: int, end: int, *, outputs=(), seq: int | None = None,
                      prompt=(1, 2, 3), checksum: bool = False, flip_bit: int | None = None, copy_id: int = 0) -> checkpoint_pb2.SegmentAck:
        """Send KV positions [start, end) of ``kv`` and wait for the ack."""
        self.seq[request_id] = seq if seq is not None else self.seq.get(request_id, 0) + 1
        message = checkpoint_pb2.Segment(
            request_id=request_id, seq=self.seq[request_id], kv_start=start, kv_end=end, kv=raw(kv[:, :, start:end]), copy_id=copy_id
        )
        if checksum:
            message.kv_crc32 = zlib.crc32(message.kv)
        if flip_bit is not None:  # after the checksum: the bytes went bad on the way
            data = bytearray(message.kv)
            data[flip_bit // 8] ^= 1 << (flip_bit % 8)
            message.kv = bytes(data)
        if start == 0:
            message.state.CopyFrom(common_pb2.RequestState(prompt_token_ids=prompt, output_token_ids=list(outputs),
                                                           sampling=common_pb2.SamplingParams(max_tokens=64)))
            message.seed = 1234
        else:
            message.appended_output_ids.extend(outputs)
        await self.call.write(checkpoint_pb2.StreamRequest(batch=checkpoint_pb2.Batch(segments=[message])))
        response = await self.call.read()
        assert [ack.request_id for ack in response.acks] == [request_id], response
        return response.acks[0]

    async def release(self, request_id: str) -> None:
        await self.call.write(checkpoint_pb2.StreamRequest(batch=checkpoint_pb2.Batch(released_request_ids=[request_id])))
        assert not (await self.call.read()).acks


async def list_commits(store: CheckpointStoreHandle, worker_id: str) -> list[str]:
    async with grpc.aio.insecure_channel(store.address) as channel:
        listing = await checkpoint_pb2_grpc.CheckpointStoreStub(channel).ListCommits(
            checkpoint_pb2.ListCommitsRequest(worker_id=worker_id), timeout=2
        )
    return [commit.request_id for commit in listing.commits]


async def fetch(store: CheckpointStoreHandle, pieces: list[tuple[str, int]]) -> dict[int, bytes]:
    async with grpc.aio.insecure_channel(store.address) as channel:
        request = migration_pb2.FetchKvRequest(pieces=[migration_pb2.KvPiece(request_id=r, kv_tokens=n) for r, n in pieces])
        got: dict[int, bytearray] = {}
        async for chunk in migration_pb2_grpc.KvSourceStub(channel).FetchKv(request, timeout=10):
            assert len(chunk.data) <= 1 << 20
            got.setdefault(chunk.piece, bytearray()).extend(chunk.data)
        return {piece: bytes(data) for piece, data in got.items()}


async def test_store_advertises_itself_in_etcd_under_a_lease(store, etcd_config):
    client = connect_etcd(etcd_config)
    try:
        held = await client.get((CHECKPOINT_STORES_PREFIX + store.store_id).encode())
    finally:
        await client.close()
    advertisement = decode_json(held.value, checkpoint_pb2.CheckpointStoreRegistration)
    assert advertisement.store_id == store.store_id and advertisement.address == store.address
    assert advertisement.channel_endpoint == f"ckpt-{store.store_id}" and advertisement.pid == store.process.pid
    assert held.lease  # it vanishes with the process
    stats = await store.stats()
    assert stats.requests == 0 and stats.connected_workers == 0


async def test_streamed_segments_become_commits_and_fetch_back_byte_exact(store):
    kv = random_kv(F32, 40, seed=1)
    async with FakeWorker(store, "w-a", F32) as worker:
        ack = await worker.segment("req-a", kv, 0, 8, outputs=[100])
        assert (ack.seq, ack.kv_tokens, ack.resync) == (1, 8, False)
        for start in range(8, 40, 4):
            ack = await worker.segment("req-a", kv, start, start + 4, outputs=[100 + start])
            assert ack.kv_tokens == start + 4 and not ack.resync
        duplicate = await worker.segment("req-a", kv, 36, 40, seq=5)
        assert duplicate.kv_tokens == 40 and duplicate.seq == 9 and not duplicate.resync
        gap = await worker.segment("req-b", kv, 4, 8)  # the store never saw req-b from 0
        assert gap.resync and gap.kv_tokens == 0

        record = await store.get_commit("req-a")
        assert record.worker_id == "w-a" and record.kv_tokens == 40 and record.seq == 9 and record.seed == 1234
        assert list(record.state.prompt_token_ids) == [1, 2, 3] and record.last_index == 8
        assert list(record.state.output_token_ids) == [100, *range(108, 140, 4)]
        assert record.model_version == "tiny@1" and record.layout == F32
        stats = await store.stats()
        assert stats.connected_workers == 1 and stats.requests == 1 and stats.segments_applied_total == 9
        assert stats.bytes_received_total >= 40 * 1024

        got = await fetch(store, [("req-a", 40), ("req-a", 13)])
        assert got[0] == raw(kv) and got[1] == raw(kv[:, :, :13])
        assert await list_commits(store, "w-a") == ["req-a"]
        assert await list_commits(store, "w-other") == []
        assert "req-a" in await list_commits(store, "")

    # The worker's stream ended (it died): its commit stays for a restore elsewhere.
    await assert_eventually(lambda: _connected(store, 0), timeout=5)
    assert (await store.get_commit("req-a")).kv_tokens == 40


async def _connected(store: CheckpointStoreHandle, n: int) -> bool:
    assert (await store.stats()).connected_workers == n
    return True


async def test_many_workers_stream_at_once_and_a_new_owner_continues(store):
    kvs = {i: random_kv(BF16, 30, seed=10 + i) for i in range(4)}

    async def run(i: int) -> None:
        async with FakeWorker(store, f"w-many-{i}", BF16) as worker:
            for start in range(0, 30, 5):
                ack = await worker.segment(f"many-{i}", kvs[i], start, start + 5, outputs=[i])
                assert ack.kv_tokens == start + 5 and not ack.resync

    await asyncio.gather(*(run(i) for i in range(4)))
    got = await fetch(store, [(f"many-{i}", 30) for i in range(4)])
    assert all(got[i] == raw(kvs[i]) for i in range(4))

    # many-0 restored on w-new from 30 tokens: it numbers its segments afresh and overwrites from position 28.
    tail = random_kv(BF16, 34, seed=99)
    async with FakeWorker(store, "w-new", BF16) as worker:
        ack = await worker.segment("many-0", tail, 28, 34, outputs=[7, 8], seq=1)
        assert ack.kv_tokens == 34 and not ack.resync
        record = await store.get_commit("many-0")
        assert record.worker_id == "w-new" and list(record.state.output_token_ids)[-2:] == [7, 8]
        got = await fetch(store, [("many-0", 34)])
        assert got[0] == raw(torch.cat([kvs[0][:, :, :28], tail[:, :, 28:34]], dim=2))
        await worker.release("many-0")
        await assert_eventually(lambda: _gone(store, "many-0"), timeout=5)


async def _gone(store: CheckpointStoreHandle, request_id: str) -> bool:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await store.get_commit(request_id)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    return True


async def test_a_long_request_spills_to_disk_and_still_restores_byte_exact(store):
    kv = random_kv(F32, 1600, seed=3)  # 1.6 MiB against a 1 MiB memory limit
    async with FakeWorker(store, "w-long", F32) as worker:
        for start in range(0, 1600, 200):
            assert (await worker.segment("long", kv, start, start + 200)).kv_tokens == start + 200
    stats = await store.stats()
    assert stats.spilled_bytes > 0 and stats.memory_bytes <= MEMORY_LIMIT
    assert (await store.get_commit("long")).spilled
    assert any(store.spill_dir.rglob("*.kv"))
    got = await fetch(store, [("long", 1600), ("long", 1)])
    assert got[0] == raw(kv) and got[1] == raw(kv[:, :, :1])
    assert store.metric("phalanx_checkpoint_spilled_bytes") > 0
    assert store.metric("phalanx_checkpoint_segments_total", result="gap") >= 1
    assert store.metric("phalanx_checkpoint_committed_tokens") >= 1600
    assert store.metric("phalanx_checkpoint_restores_total", transport="grpc") >= 1


async def test_errors_name_what_is_missing(store):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fetch(store, [("no-such-request", 1)])
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fetch(store, [("req-a", 41)])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "41 KV tokens asked for, but only 40 are committed" in caught.value.details()
    status = rpc_status.from_call(caught.value)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.reason == "KV_NOT_COMMITTED" and info.metadata["committed"] == "40"
    await _gone(store, "nope")

    async with grpc.aio.insecure_channel(store.address) as channel:
        call = checkpoint_pb2_grpc.CheckpointStoreStub(channel).Stream()
        await call.write(checkpoint_pb2.StreamRequest(batch=checkpoint_pb2.Batch(released_request_ids=["req-a"])))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Hello" in caught.value.details()
    assert (await store.get_commit("req-a")).kv_tokens == 40  # the Release before any Hello did nothing


async def test_send_kv_over_a_tensor_channel_is_byte_exact(store, etcd_config):
    from phalanx.common.channels import ChannelEndpoint

    endpoint_id = unique_id("target")
    endpoint = ChannelEndpoint(endpoint_id, etcd_config, host="127.0.0.1", timeout_s=10)
    await endpoint.start()
    try:
        pieces = [("req-a", 40), ("long", 1600), ("many-1", 17)]
        expected = [
            random_kv(F32, 40, seed=1),
            random_kv(F32, 1600, seed=3),
            random_kv(BF16, 30, seed=11)[:, :, :17].contiguous(),
        ]
        channel_id = unique_id("restore")

        async def receive() -> list[torch.Tensor]:
            channel = await endpoint.accept(channel_id)
            try:
                buffers = [torch.empty_like(e) for e in expected]
                for buffer in buffers:
                    await channel.recv_into(buffer)
                return buffers
            finally:
                await channel.close()

        receiving = asyncio.create_task(receive())
        async with grpc.aio.insecure_channel(store.address) as grpc_channel:
            response = await migration_pb2_grpc.KvSourceStub(grpc_channel).SendKv(
                migration_pb2.SendKvRequest(
                    pieces=[migration_pb2.KvPiece(request_id=r, kv_tokens=n) for r, n in pieces],
                    target_endpoint=endpoint_id, channel_id=channel_id, timeout_s=20,
                ),
                timeout=30,
            )
        received = await asyncio.wait_for(receiving, 30)
        assert all(raw(got) == raw(want) for got, want in zip(received, expected, strict=True))
        assert response.bytes == sum(e.nbytes for e in expected) and response.seconds > 0
        assert store.metric("phalanx_checkpoint_restores_total", transport="channel") == 3

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with grpc.aio.insecure_channel(store.address) as grpc_channel:
                await migration_pb2_grpc.KvSourceStub(grpc_channel).SendKv(
                    migration_pb2.SendKvRequest(pieces=[migration_pb2.KvPiece(request_id="req-a", kv_tokens=4)],
                                                target_endpoint=unique_id("nobody"), channel_id=unique_id("c"), timeout_s=1),
                    timeout=10,
                )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await endpoint.close()


async def test_send_kv_keeps_its_channel_for_the_next_restore_into_that_target(store, etcd_config):
    """Forming a channel costs more than sending a request's KV: both ends keep it, and a reuse the store cannot
    honour (it no longer keeps that channel) is NOT_FOUND at once, not a wait for the timeout."""
    from phalanx.common.channels import ChannelEndpoint

    endpoint_id = unique_id("target")
    endpoint = ChannelEndpoint(endpoint_id, etcd_config, host="127.0.0.1", timeout_s=10)
    await endpoint.start()
    expected = random_kv(F32, 40, seed=1)
    channel_id = unique_id("kept")

    def send_kv(stub, *, reuse: bool, channel: str = channel_id):
        request = migration_pb2.SendKvRequest(
            pieces=[migration_pb2.KvPiece(request_id="req-a", kv_tokens=40)],
            target_endpoint=endpoint_id, channel_id=channel, timeout_s=5, reuse_channel=reuse,
        )
        return stub.SendKv(request, timeout=10)

    try:
        async with grpc.aio.insecure_channel(store.address) as grpc_channel:
            stub = migration_pb2_grpc.KvSourceStub(grpc_channel)
            async def restore(channel_or_accept, *, reuse: bool, channel: str = channel_id) -> TensorChannel:
                sending = asyncio.ensure_future(send_kv(stub, reuse=reuse, channel=channel))
                target = await channel_or_accept if asyncio.isfuture(channel_or_accept) else channel_or_accept
                buffer = torch.empty_like(expected)
                await target.recv_into(buffer, timeout_s=10)
                await sending
                assert raw(buffer) == raw(expected)
                return target

            channel = await restore(asyncio.ensure_future(endpoint.accept(channel_id)), reuse=False)
            for _ in range(2):
                await restore(channel, reuse=True)
            assert endpoint.channels == {channel} and not channel.broken

            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await send_kv(stub, reuse=True, channel=unique_id("never-formed"))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "keeps no channel" in caught.value.details()
            assert time.monotonic() - started < 2

            # The target closing its end breaks the store's: a reuse then fails, and a fresh channel works again.
            await channel.close()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await send_kv(stub, reuse=True)
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
            fresh_id = unique_id("fresh")
            await restore(asyncio.ensure_future(endpoint.accept(fresh_id)), reuse=False, channel=fresh_id)
    finally:
        await endpoint.close()


async def test_a_segment_with_a_flipped_bit_is_refused_counted_and_never_applied(store):
    kv = random_kv(F32, 16, seed=5)
    corrupt_before = await asyncio.to_thread(store.metric, "phalanx_checkpoint_segments_total", result="corrupt")
    async with FakeWorker(store, "w-crc", F32) as worker:
        ack = await worker.segment("req-crc", kv, 0, 8, checksum=True)
        assert (ack.kv_tokens, ack.resync) == (8, False)
        ack = await worker.segment("req-crc", kv, 8, 16, checksum=True, flip_bit=1234, outputs=[7])
        assert (ack.kv_tokens, ack.resync) == (8, True)  # not applied: send it again from position 0
        record = await store.get_commit("req-crc")
        assert record.kv_tokens == 8 and list(record.state.output_token_ids) == []
        assert (await fetch(store, [("req-crc", 8)]))[0] == raw(kv[:, :, :8])
    corrupt_after = await asyncio.to_thread(store.metric, "phalanx_checkpoint_segments_total", result="corrupt")
    assert corrupt_after == (corrupt_before or 0) + 1


async def test_a_worker_back_from_a_partition_cannot_take_a_moved_request_s_commit_back(store):
    kv = random_kv(BF16, 12, seed=5)
    async with FakeWorker(store, "w-cut-off", BF16) as old, FakeWorker(store, "w-took-over", BF16) as new:
        assert not (await old.segment("moved", kv, 0, 6, outputs=[1], copy_id=100)).superseded
        assert not (await new.segment("moved", kv, 6, 8, outputs=[2], seq=1, copy_id=200)).superseded  # migrated: takes it over
        before = await asyncio.to_thread(store.metric, "phalanx_checkpoint_segments_total", result="superseded")
        for start, end in ((8, 12), (0, 12)):  # what it queued while cut off, then its re-sync from position 0
            ack = await old.segment("moved", kv, start, end, outputs=[9], copy_id=100)
            assert ack.superseded and not ack.resync and ack.copy_id == 100 and ack.kv_tokens == 8
        record = await store.get_commit("moved")
        assert record.worker_id == "w-took-over" and record.kv_tokens == 8 and list(record.state.output_token_ids) == [1, 2]
        assert "moved" not in await list_commits(store, "w-cut-off")
        after = await asyncio.to_thread(store.metric, "phalanx_checkpoint_segments_total", result="superseded")
        assert after - before == 2
        await new.release("moved")


async def test_a_burst_of_migrations_reads_its_worker_s_commits_in_one_listing(store, etcd_config):
    from phalanx.migration.config import MigrationConfig
    from phalanx.migration.core import Migrator
    from phalanx.migration.metrics import MigrationMetrics

    worker_id, other_id = unique_id("burst"), unique_id("other")
    ids = [f"{worker_id}-r{i}" for i in range(4)]
    async with FakeWorker(store, worker_id, F32) as worker, FakeWorker(store, other_id, F32) as other:
        for i, request_id in enumerate(ids):
            await worker.segment(request_id, random_kv(F32, 8, i), 0, 8, outputs=[10 + i])
        await other.segment(f"{other_id}-moved", random_kv(F32, 8, 9), 0, 8, outputs=[99])
        migrator = Migrator(MigrationConfig(), etcd_config, None, MigrationMetrics())
        try:
            def ask(request_id: str, owner: str = worker_id):
                return migrator._commit(migration_pb2.MigrateRequest(request_id=request_id, worker_id=owner))

            # The worker died with its four streams: the first reads its commit alone, the other three share a listing.
            found = await asyncio.gather(*(ask(r) for r in ids))
            assert [plan.state.output_token_ids[:] for _, (plan, _), _ in found] == [[10 + i] for i in range(4)]
            assert {address for address, _, _ in found} == {store.address}
            assert migrator._listings.calls == 1
            # A request the listing does not hold (another worker owns its commit now) is still found, alone.
            (_, (moved, _), _), (_, (first, _), _) = await asyncio.gather(ask(f"{other_id}-moved"), ask(ids[0]))
            assert moved.state.output_token_ids[:] == [99] and first.state.output_token_ids[:] == [10]
            assert await ask("nobody-knows-it") == ("", None, ())
        finally:
            await migrator.close()


async def test_sigterm_exits_cleanly_and_revokes_the_advertisement(store, etcd_config):
    async with FakeWorker(store, "w-last", F32) as worker:
        await worker.segment("last", random_kv(F32, 4, seed=5), 0, 4)  # a worker stream is open at SIGTERM
        store.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(store.process.wait, 15) == 0
        with pytest.raises(grpc.aio.AioRpcError):
            await worker.call.read()
    client = connect_etcd(etcd_config)
    try:
        assert await client.get((CHECKPOINT_STORES_PREFIX + store.store_id).encode()) is None  # revoked, not left to expire
    finally:
        await client.close()
    assert not any(store.spill_dir.iterdir())  # spilled KV deleted
