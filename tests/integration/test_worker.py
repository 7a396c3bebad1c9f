"""A real worker process: registration, events, gRPC API and its failure modes."""

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.block_hash import prefix_block_hashes
from phalanx.common.discovery import WorkerDirectory
from phalanx.common.events import EventBus
from phalanx.common.subjects import kv_events_subject, load_subject
from phalanx.launch.services import start_worker
from phalanx.model import ByteTokenizer
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.workers import busy_batch, shared_worker, worker_stub

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(nats_server, etcd_server):
    with shared_worker("w-main", nats_server, etcd_server) as handle:
        yield handle


@pytest.fixture
async def stub(worker):
    async with worker_stub(worker) as stub:
        yield stub


def request(text="Hello, Phalanx", max_tokens=8, **sampling):
    return worker_pb2.GenerateRequest(
        text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    )


async def collect(stub, req):
    return [chunk async for chunk in stub.Generate(req)]


async def test_generate_streams_every_index_once_and_ends_with_a_reason(stub):
    chunks = await collect(stub, request(max_tokens=12))
    assert [c.index for c in chunks] == list(range(12))
    assert chunks[0].prompt_tokens == len(ByteTokenizer().encode("Hello, Phalanx"))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])


async def test_32_concurrent_streams_equal_single_runs(stub):
    prompts = [f"concurrent request number {i}" for i in range(32)]
    singles = {p: [c.token_id for c in await collect(stub, request(p, 10))] for p in prompts[:4]}
    results = await asyncio.gather(*(collect(stub, request(p, 10)) for p in prompts))
    assert all(len(r) == 10 for r in results)
    for p, chunks in zip(prompts, results, strict=True):
        if p in singles:
            assert [c.token_id for c in chunks] == singles[p]


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (worker_pb2.GenerateRequest(text="", sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt"),
        (request(max_tokens=0), "max_tokens"),
        (request(max_tokens=-5), "max_tokens"),
        (request(max_tokens=5000), "exceeds the context"),
        (request(top_p=2.0), "top_p"),
        (request(temperature=-0.5), "temperature"),
        (worker_pb2.GenerateRequest(tokens=common_pb2.PromptTokens(ids=[1, 99999]), sampling=common_pb2.SamplingParams(max_tokens=4)), "vocabulary"),
    ],
)
async def test_bad_input_is_invalid_argument_and_the_worker_keeps_serving(stub, req, needle):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()
    status = rpc_status.from_call(info.value)
    violations = [d for d in status.details if d.Is(error_details_pb2.BadRequest.DESCRIPTOR)]
    assert violations, "BadRequest details name the field"
    assert len(await collect(stub, request(max_tokens=3))) == 3


async def test_oversized_message_is_resource_exhausted(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request(text="x" * (5 * 1024 * 1024)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_canary_reports_tokens_and_top_logits_matching_generate(stub):
    canary = await stub.Canary(worker_pb2.CanaryRequest(text="canary prompt", max_tokens=6))
    assert len(canary.token_ids) == len(canary.top_logits) == 6
    greedy = await collect(stub, request("canary prompt", 6))
    assert list(canary.token_ids) == [c.token_id for c in greedy]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Canary(worker_pb2.CanaryRequest(text="x", max_tokens=1000))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_canary_says_what_load_it_ran_beside(stub):
    """Health judges a canary's latency by the load it met (health/load.py): its answer names the requests the worker
    held while it ran and the mean time of its steps."""
    alone = await stub.Canary(worker_pb2.CanaryRequest(text="canary prompt", max_tokens=6))
    assert alone.held_requests == 1  # itself
    assert alone.step_s == pytest.approx(alone.latency_s / 6)
    async with busy_batch(stub, 8) as streams:
        async def running():
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            assert stats.running_seqs + stats.queue_depth >= 8, stats
            return True

        await assert_eventually(running, timeout=20, interval=0.05)
        beside = await stub.Canary(worker_pb2.CanaryRequest(text="canary prompt", max_tokens=6))
        assert not any(s.done() for s in streams)
    assert beside.held_requests >= 9
    assert beside.step_s == pytest.approx(beside.latency_s / 6) and beside.step_s > 0


async def test_kv_events_and_load_reports_arrive_over_nats(worker, stub, nats_config):
    bus = await EventBus.connect(nats_config, name="test-observer")
    kv_events, loads = [], []

    async def on_kv(message, subject, context):
        kv_events.append(message)

    async def on_load(message, subject, context):
        loads.append(message)

    await bus.subscribe(kv_events_subject(worker.worker_id), common_pb2.KvEvent, on_kv)
    await bus.subscribe(load_subject(worker.worker_id), common_pb2.LoadReport, on_load)
    try:
        text = "A prompt long enough to fill a few KV blocks of sixteen tokens each."
        await collect(stub, request(text, 4))
        expected = prefix_block_hashes(ByteTokenizer().encode(text), 16)

        def stored_all():
            stored = {b.block_hash for e in kv_events for b in e.stored}
            assert set(expected) <= stored
            return True

        await assert_eventually(stored_all, timeout=5)
        sequences = [e.sequence for e in kv_events]
        assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
        await assert_eventually(lambda: len(loads) >= 3, timeout=5)
        assert loads[-1].total_blocks > 0 and loads[-1].free_blocks <= loads[-1].total_blocks
        snapshot = await stub.KvSnapshot(worker_pb2.KvSnapshotRequest())
        assert set(expected) <= {b.block_hash for b in snapshot.blocks}
        assert snapshot.sequence >= 1
    finally:
        await bus.close()


async def test_health_and_reflection_are_served(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="phalanx.worker.v1.WorkerService")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        services = [s.name async for r in stream for s in r.list_services_response.service]
        assert "phalanx.worker.v1.WorkerService" in services


def _huge_pages(pid: int) -> tuple[str, str, int]:
    """The kernel's THP mode, the process's environment and its anonymous memory in huge pages (kB)."""
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return (Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
            Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"), int(rollup["AnonHugePages"].split()[0]))


async def test_the_worker_s_heap_is_backed_by_huge_pages(worker, stub):
    """Launched workers ask glibc for a huge-page heap: a SIGKILLed worker's memory then unmaps in far fewer steps, and
    its sockets (closed only after that) tell its peers sooner (phalanx.launch.services)."""
    await collect(stub, request(max_tokens=4))
    mode, environ, huge_kb = await asyncio.to_thread(_huge_pages, worker.process.pid)
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off in this kernel")
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
    assert huge_kb >= 2048  # at least one 2 MiB page


async def test_the_engine_runs_in_a_process_of_its_own_by_default_and_on_a_thread_when_told(worker, nats_server, etcd_config):
    assert len(worker.engine_process_pids()) == 1  # the default (EngineConfig.engine_process)
    handle = await start_worker("w-thread", nats_server.url, etcd_config, env={"PHALANX_ENGINE_ENGINE_PROCESS": "false"},
                                model="phalanx-tiny-moe")
    try:
        assert handle.engine_process_pids() == []
        async with grpc.aio.insecure_channel(handle.address) as channel:
            assert len(await collect(worker_pb2_grpc.WorkerServiceStub(channel), request(max_tokens=4))) == 4
    finally:
        assert handle.terminate() == 0


async def test_registration_vanishes_within_the_lease_ttl_after_sigkill(nats_server, etcd_config):
    handle = await start_worker("w-doomed", nats_server.url, etcd_config, model="phalanx-tiny-moe")
    directory = WorkerDirectory(etcd_config)
    try:
        assert "w-doomed" in await directory.list()
        engine_processes = handle.engine_process_pids()
        handle.kill()
        killed = time.monotonic()

        async def gone():
            return "w-doomed" not in await directory.list()

        await assert_eventually(gone, timeout=etcd_config.lease_ttl_s + 1.5, interval=0.05)
        assert time.monotonic() - killed <= etcd_config.lease_ttl_s + 1.5

        def engine_process_gone():  # its death signal: no orphan holds the weights
            for pid in engine_processes:
                with contextlib.suppress(FileNotFoundError):
                    assert " Z " in Path(f"/proc/{pid}/stat").read_text()
            return True

        await assert_eventually(engine_process_gone, timeout=5, interval=0.05)
    finally:
        handle.kill()
        await directory.close()


async def test_sigterm_drains_hands_back_running_requests_and_deregisters(nats_server, etcd_config):
    handle = await start_worker("w-drain", nats_server.url, etcd_config, env={"PHALANX_WORKER_DRAIN_GRACE_S": "0.3"}, model="phalanx-tiny-moe")
    directory = WorkerDirectory(etcd_config)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            stream = stub.Generate(request("a long generation", 1500))
            first = await stream.read()
            assert first.index == 0
            handle.process.send_signal(15)
            chunks = [first]
            while (chunk := await stream.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        last = chunks[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_HANDED_BACK
        delivered = [c.token_id for c in chunks[:-1]]
        assert list(last.handoff.output_token_ids) == delivered
        assert last.handoff.sampling.HasField("seed")
        assert await asyncio.to_thread(handle.process.wait, 20) == 0
        assert "w-drain" not in await directory.list()
    finally:
        handle.kill()
        await directory.close()


async def test_sigterm_under_a_multiplexed_stream_writes_every_chunk_while_idle_calls_stay_open(nats_server, etcd_config):
    """A router's Multiplex carries the request; another Multiplex and health's Watch stay open, owing nothing. The
    subscription gets every chunk up to its hand-back (the stop waits for those only, then cuts the idle calls), and
    the worker exits cleanly."""
    handle = await start_worker("w-drain-mux", nats_server.url, etcd_config, env={"PHALANX_WORKER_DRAIN_GRACE_S": "0.3"},
                                model="phalanx-tiny-moe")
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            busy, idle = stub.Multiplex(), stub.Multiplex()
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await busy.write(worker_pb2.MultiplexRequest(subscription_id=1, generate=request("a long multiplexed generation", 1500)))
            chunks: list[worker_pb2.MultiplexChunk] = []
            while not chunks:
                chunks.extend((await busy.read()).chunks)
            handle.process.send_signal(15)
            while not chunks[-1].closed:
                response = await busy.read()
                assert response is not grpc.aio.EOF, "the stream ended before the subscription's last chunk"
                chunks.extend(response.chunks)
            exited = await asyncio.to_thread(handle.process.wait, 20)
            idle.cancel()
            watch.cancel()
        tokens = [c.response for c in chunks if c.HasField("response")]
        last = tokens[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_HANDED_BACK
        assert list(last.handoff.output_token_ids) == [t.token_id for t in tokens[:-1]], "no chunk lost before the hand-back"
        assert exited == 0
    finally:
        handle.kill()


@pytest.mark.slow
async def test_drain_rpc_hands_back_and_a_resumed_request_continues_identically(nats_server, etcd_config):
    draining = await start_worker("w-drain-rpc", nats_server.url, etcd_config, "--deterministic", model="phalanx-tiny-moe")
    successor = await start_worker("w-successor", nats_server.url, etcd_config, "--deterministic", model="phalanx-tiny-moe")
    try:
        async with grpc.aio.insecure_channel(draining.address) as a, grpc.aio.insecure_channel(successor.address) as b:
            first_stub, next_stub = worker_pb2_grpc.WorkerServiceStub(a), worker_pb2_grpc.WorkerServiceStub(b)
            req = request("move me mid-stream", 400, temperature=0.7, seed=5)
            reference = [c.token_id for c in await collect(next_stub, req)]
            stream = first_stub.Generate(req)
            chunks = [await stream.read() for _ in range(5)]
            drained = await first_stub.Drain(worker_pb2.DrainRequest(grace_s=0))
            while (chunk := await stream.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            assert drained.handed_back == 1
            handoff = chunks[-1].handoff
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_HANDED_BACK
            resumed = await collect(next_stub, worker_pb2.GenerateRequest(resume_from=handoff))
        delivered = [c.token_id for c in chunks[:-1]]
        assert [c.index for c in resumed] == list(range(len(delivered), 400))
        assert delivered + [c.token_id for c in resumed] == reference, "no token lost, repeated or changed"
        assert await asyncio.to_thread(draining.process.wait, 20) == 0
    finally:
        draining.kill()
        successor.kill()
