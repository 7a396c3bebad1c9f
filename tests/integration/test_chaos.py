"""Fault injection on real worker processes, the quarantine drain, degradation, and `phalanx chaos`."""

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from phalanx._proto import chaos_pb2, chaos_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import WorkerDirectory, encode_json
from phalanx.common.events import EventBus
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import DEGRADATION_KEY, load_subject
from phalanx.launch.services import start_worker
from phalanx.launch.stack import unique_id
from phalanx.model.tokenizer import ByteTokenizer
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

TOKEN = "chaos-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CHAOS_ENV = {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": TOKEN}
CANARY = worker_pb2.CanaryRequest(text="canary prompt", max_tokens=8)
CLI = [sys.executable, "-m", "phalanx.cli"]


@pytest.fixture(scope="module")
def worker(nats_server, etcd_server):
    # One chaos-enabled worker for every test that leaves it alive (each clears its faults).
    config = EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)
    handle = asyncio.run(start_worker(unique_id("w-chaos"), nats_server.url, config, "--deterministic", env=CHAOS_ENV, model="phalanx-tiny-moe"))
    yield handle
    assert handle.terminate() == 0


@pytest.fixture
async def stubs(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        chaos, stub = chaos_pb2_grpc.ChaosServiceStub(channel), worker_pb2_grpc.WorkerServiceStub(channel)
        try:
            yield chaos, stub
        finally:
            await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(), metadata=AUTH)
            await stub.Undrain(worker_pb2.UndrainRequest())


def inject(kind, **options) -> chaos_pb2.InjectFaultRequest:
    return chaos_pb2.InjectFaultRequest(kind=kind, **options)


def generate(max_tokens: int = 4) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def phalanx(*args: str, token: str = TOKEN) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PHALANX_ETCD_ENDPOINT", "PHALANX_CHAOS_TOKEN")}
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, env={**env, "PHALANX_CHAOS_TOKEN": token}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, out.decode(), err.decode()


async def test_chaos_service_is_unimplemented_unless_enabled(nats_server, etcd_config):
    handle = await start_worker(unique_id("w-plain"), nats_server.url, etcd_config, "--chaos-token", TOKEN, model="phalanx-tiny-moe")
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await chaos_pb2_grpc.ChaosServiceStub(channel).ListFaults(chaos_pb2.ListFaultsRequest(), metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        code, _, err = await phalanx("chaos", "inject", "hang", "--address", handle.address)
        assert code == 1 and "chaos is not enabled on this worker" in err
    finally:
        handle.kill()


async def test_calls_need_the_token_and_valid_arguments(stubs):
    chaos, _ = stubs
    for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),), (("authorization", f"Basic {TOKEN}"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_HANG), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization" in info.value.details() or "token" in info.value.details()
    for request, field in ((inject(0), "kind"), (inject(99), "kind"), (inject(chaos_pb2.FAULT_KIND_HANG, duration_s=-1), "duration_s"),
                           (inject(chaos_pb2.FAULT_KIND_SLOW, slow_step_s=-0.1), "slow_step_s"),
                           (inject(chaos_pb2.FAULT_KIND_CORRUPT, corrupt_target=7), "corrupt_target")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await chaos.InjectFault(request, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    assert not (await chaos.ListFaults(chaos_pb2.ListFaultsRequest(), metadata=AUTH)).active


async def test_crash_kills_the_worker_by_sigkill_and_its_registration_lapses(nats_server, etcd_config):
    worker_id = unique_id("w-crash")
    handle = await start_worker(worker_id, nats_server.url, etcd_config, env=CHAOS_ENV, model="phalanx-tiny-moe")
    directory = WorkerDirectory(etcd_config)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            await chaos_pb2_grpc.ChaosServiceStub(channel).InjectFault(inject(chaos_pb2.FAULT_KIND_CRASH), metadata=AUTH)
        assert await asyncio.to_thread(handle.process.wait, 10) == -signal.SIGKILL

        async def gone():
            return worker_id not in await directory.list()

        await assert_eventually(gone, timeout=etcd_config.lease_ttl_s + 2, interval=0.05)
    finally:
        handle.kill()
        await directory.close()


async def test_a_marked_prompt_kills_a_worker_whose_engine_runs_in_a_process_of_its_own(nats_server, etcd_config):
    """chaos_crash_on_prompt with the engine in a child process (engine_core.py): the child's step that schedules the
    marked prompt kills the worker by SIGKILL, as the engine thread's does, and the child goes with it."""
    marker = "<<poison-in-the-child>>"
    env = {**CHAOS_ENV, "PHALANX_WORKER_CHAOS_CRASH_ON_PROMPT": marker, "PHALANX_ENGINE_ENGINE_PROCESS": "true"}
    handle = await start_worker(unique_id("w-poison"), nats_server.url, etcd_config, env=env, model="phalanx-tiny-moe")
    try:
        children = handle.engine_process_pids()
        assert len(children) == 1
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            assert len([r async for r in stub.Generate(generate(max_tokens=4), timeout=30)]) > 0  # a plain prompt is served
            poison = worker_pb2.GenerateRequest(text=f"a note {marker} to summarise",
                                                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in stub.Generate(poison, timeout=30)]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(handle.process.wait, 10) == -signal.SIGKILL

        def child_gone():
            stat = Path(f"/proc/{children[0]}/stat")
            with contextlib.suppress(FileNotFoundError):
                assert " Z " in stat.read_text()  # a zombie at most
            return True

        await assert_eventually(child_gone, timeout=5, interval=0.05)
    finally:
        handle.kill()


async def test_canary_reports_margins_and_model_version_and_its_work_is_counted(worker, stubs):
    _, stub = stubs
    before = await stub.Stats(worker_pb2.StatsRequest())
    canary = await stub.Canary(CANARY)
    assert len(canary.top_margins) == len(canary.token_ids) == 8
    assert all(m >= 0 for m in canary.top_margins)
    assert canary.text == ByteTokenizer().decode(list(canary.token_ids))
    assert canary.model_version == before.model_version == "phalanx-tiny-moe@seed=0"
    after = await stub.Stats(worker_pb2.StatsRequest())
    assert after.canaries_total == before.canaries_total + 1
    assert after.canary_tokens_total - before.canary_tokens_total >= 8  # at least one token per step
    assert after.computed_tokens_total - before.computed_tokens_total >= after.canary_tokens_total - before.canary_tokens_total
    registration = (await _registrations(worker))[worker.worker_id]
    assert registration.model_version == "phalanx-tiny-moe@seed=0"
    assert worker.metric("phalanx_worker_serving", worker=worker.worker_id) == 1
    await assert_eventually(lambda: (worker.metric("phalanx_worker_canaries_total", worker=worker.worker_id) or 0) >= 1)


async def test_hang_stops_progress_but_not_grpc_and_ends_when_cleared_or_expired(worker, stubs):
    chaos, stub = stubs
    healthy = await stub.Canary(CANARY)
    await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_HANG), metadata=AUTH)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Canary(CANARY, timeout=1)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    async with grpc.aio.insecure_channel(worker.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert worker.metric("phalanx_worker_faults_active", worker=worker.worker_id, kind="hang") == 1
    await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(kind=chaos_pb2.FAULT_KIND_HANG), metadata=AUTH)
    assert (await stub.Canary(CANARY, timeout=10)).token_ids == healthy.token_ids

    listed = await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_HANG, duration_s=1), metadata=AUTH)
    assert listed.active[0].expires_at == pytest.approx(listed.active[0].injected_at + 1)
    start = time.monotonic()
    assert (await stub.Canary(CANARY, timeout=10)).token_ids == healthy.token_ids
    assert time.monotonic() - start >= 0.5, "the canary waited for the hang to expire"
    assert not (await chaos.ListFaults(chaos_pb2.ListFaultsRequest(), metadata=AUTH)).active


async def test_slow_adds_its_step_time_to_every_step(stubs):
    chaos, stub = stubs
    await stub.Canary(CANARY)
    # The fastest of a few: on a busy box one canary can take a step's worth longer than the next, and a baseline
    # caught high would make 8 slowed steps look like fewer (0.391 -> 1.029 s seen at load 15).
    baseline = min([(await stub.Canary(CANARY)).latency_s for _ in range(3)])
    await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_SLOW, slow_step_s=0.1), metadata=AUTH)
    slow = (await stub.Canary(CANARY)).latency_s
    assert baseline + 0.7 <= slow <= baseline + 0.8 + 1.0, f"8 steps of +0.1 s: {baseline:.3f} -> {slow:.3f}"
    await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(), metadata=AUTH)
    assert (await stub.Canary(CANARY)).latency_s < baseline + 0.4


@pytest.mark.parametrize("target", [chaos_pb2.CORRUPT_TARGET_LOGITS, chaos_pb2.CORRUPT_TARGET_WEIGHTS])
async def test_corruption_silently_changes_tokens_until_cleared(stubs, target):
    chaos, stub = stubs
    healthy = await stub.Canary(CANARY)
    await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_CORRUPT, corrupt_target=target), metadata=AUTH)
    corrupted = await stub.Canary(CANARY)
    assert corrupted.token_ids != healthy.token_ids
    assert corrupted.model_version == healthy.model_version, "nothing tells the outputs are wrong"
    await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(kind=chaos_pb2.FAULT_KIND_CORRUPT), metadata=AUTH)
    restored = await stub.Canary(CANARY)
    assert restored.token_ids == healthy.token_ids
    assert restored.top_logits == healthy.top_logits


async def _registrations(worker) -> dict:
    directory = WorkerDirectory(EtcdConfig(endpoint=_etcd_endpoint(worker)))
    try:
        return await directory.list()
    finally:
        await directory.close()


def _etcd_endpoint(worker) -> str:
    args = worker.process.args
    return args[args.index("--etcd-endpoint") + 1]


async def test_drop_etcd_lets_the_registration_lapse_and_clear_registers_again(worker, stubs):
    chaos, stub = stubs
    assert worker.worker_id in await _registrations(worker)
    await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_DROP_ETCD), metadata=AUTH)

    async def registered():
        return worker.worker_id in await _registrations(worker)

    async def lapsed():
        return not await registered()

    await assert_eventually(lapsed, timeout=4, interval=0.1, message="the registration lapses at its TTL")
    assert len((await stub.Canary(CANARY)).token_ids) == 8, "the worker itself still serves"
    await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(kind=chaos_pb2.FAULT_KIND_DROP_ETCD), metadata=AUTH)
    await assert_eventually(registered, timeout=5, interval=0.1, message="registered again under a new lease")


async def test_drop_nats_stops_load_reports_until_cleared(worker, stubs, nats_config):
    chaos, _ = stubs
    bus = await EventBus.connect(nats_config, name="chaos-observer")
    reports: list[common_pb2.LoadReport] = []

    async def on_load(message, subject, context):
        reports.append(message)

    await bus.subscribe(load_subject(worker.worker_id), common_pb2.LoadReport, on_load)
    try:
        await assert_eventually(lambda: reports, timeout=5)
        await chaos.InjectFault(inject(chaos_pb2.FAULT_KIND_DROP_NATS), metadata=AUTH)
        dropped_at = time.time()
        await asyncio.sleep(0.6)  # six load intervals: none may be published meanwhile
        assert not [r for r in reports if r.timestamp > dropped_at]
        await chaos.ClearFaults(chaos_pb2.ClearFaultsRequest(kind=chaos_pb2.FAULT_KIND_DROP_NATS), metadata=AUTH)
        cleared_at = time.time()
        await assert_eventually(lambda: [r for r in reports if r.timestamp > cleared_at], timeout=10, message="load reports resume")
    finally:
        await bus.close()


async def test_quarantine_admits_canaries_only_until_undrain(worker, stubs):
    _, stub = stubs
    long = stub.Generate(generate(max_tokens=1500))
    assert (await long.read()).index == 0
    drained = await stub.Drain(worker_pb2.DrainRequest(grace_s=0, keep_running=True))
    assert drained.handed_back == 1
    chunks = []
    while (chunk := await long.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_HANDED_BACK
    assert len((await stub.Canary(CANARY)).token_ids) == 8, "canaries still run"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [c async for c in stub.Generate(generate())]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (await stub.Stats(worker_pb2.StatsRequest())).draining
    assert worker.metric("phalanx_worker_serving", worker=worker.worker_id) == 0.5
    assert (await stub.Undrain(worker_pb2.UndrainRequest())).undrained
    assert len([c async for c in stub.Generate(generate())]) == 4
    assert not (await stub.Undrain(worker_pb2.UndrainRequest())).undrained, "not quarantined any more"
    assert worker.metric("phalanx_worker_serving", worker=worker.worker_id) == 1
    assert worker.process.poll() is None


async def test_degradation_batch_scale_is_applied_and_clamped(worker, etcd_config):
    client = connect_etcd(etcd_config)

    def scale():
        return worker.metric("phalanx_worker_batch_scale", worker=worker.worker_id)

    try:
        for given, applied in ((0.5, 0.5), (0.01, 0.1), (0.0, 1.0), (0.75, 0.75)):
            await client.put(DEGRADATION_KEY.encode(), encode_json(common_pb2.DegradationState(level=1, batch_scale=given)))
            await assert_eventually(lambda applied=applied: scale() == applied, timeout=5, message=f"batch_scale {given}")
    finally:
        await client.delete(DEGRADATION_KEY.encode())
        await client.close()
    await assert_eventually(lambda: scale() == 1.0, timeout=5, message="no degradation state: full batch")


async def test_cli_injects_lists_and_clears_faults(worker):
    code, out, err = await phalanx(
        "chaos", "inject", "slow", "--address", worker.address, "--slow-step-s", "0.05", "--duration-s", "60", "--json"
    )
    assert code == 0, err
    (fault,) = json.loads(out)["active"]
    assert fault["kind"] == "slow" and fault["slow_step_s"] == 0.05 and fault["expires_at"] > time.time() + 50
    code, out, err = await phalanx("chaos", "list", "--worker", worker.worker_id, "--etcd-endpoint", _etcd_endpoint(worker), "--json")
    assert code == 0, err
    assert [f["kind"] for f in json.loads(out)["active"]] == ["slow"]
    code, out, err = await phalanx("chaos", "list", "--address", worker.address)
    assert code == 0 and "slow" in out and "1 fault" in out, err
    code, _, err = await phalanx("chaos", "clear", "slow", "--address", worker.address, token="not-the-token-0123456789")
    assert code == 1 and "refused the token" in err
    code, out, err = await phalanx("chaos", "clear", "--address", worker.address, "--json")
    assert code == 0 and json.loads(out)["active"] == [], err
