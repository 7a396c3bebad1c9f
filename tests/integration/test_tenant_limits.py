"""Per-tenant limits at the public doors, end to end: SDK and openai client -> (gateway ->) router -> simulated workers.

Two routers share two simulated workers (no torch): one holds per-tenant limits (streams, tokens per minute, prompt
size) with a keyed gateway in front of it; the other is full at 4 streams and shares them fairly between tenants.
Each refusal must name its limit and carry a retry hint while another tenant keeps being served.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import grpc
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from phalanx.client import Client, InvalidArgumentError, OverloadedError
from phalanx.common.config import EtcdConfig
from phalanx.launch.services import GatewayHandle, RouterHandle, start_gateway
from phalanx.launch.stack import Stack
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
# 30 ms a decode step whatever the batch: a 40-token stream lasts over a second, long enough to be held open.
ITL_S = 0.03
LIMITED_TENANTS = {
    "default": {},
    "capped": {"max_streams": 2},
    "metered": {"tokens_per_minute": 60},
    "short": {"max_prompt_tokens": 32},
    "gw": {"max_streams": 1},
    "solo": {"max_streams": 1},
}
GATEWAY_KEYS = {"sk-gw-tenant": "gw", "sk-default-tenant": "default"}
FAIR_CAPACITY = 4
GREEDY_USERS = 28


def _profile(path: Path) -> Path:
    prefill = [PrefillSample(isl=float(n), ttft_s=0.002 + n * 2e-6) for n in (16, 512, 2048)]
    decode = [DecodeSample(context=float(c), concurrency=float(k), itl_s=ITL_S) for c in (64, 2048) for k in (1, 16)]
    save_profile(build_profile(prefill, decode, model=MODEL), path)
    return path


class Deployment:
    def __init__(self, stack: Stack, limited: RouterHandle, fair: RouterHandle, gateway: GatewayHandle) -> None:
        self.stack = stack
        self.limited = limited
        self.fair = fair
        self.gateway = gateway


@pytest.fixture(scope="module")
def deployment(nats_server, etcd_server, tmp_path_factory):
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model=MODEL)
    profile = _profile(tmp_path_factory.mktemp("tenants") / "sim.npz")
    gateways: list[GatewayHandle] = []

    async def start() -> Deployment:
        await stack.add_workers(2, "--engine", "sim", "--profile", str(profile), env={"PHALANX_ENGINE_MAX_NUM_SEQS": "32"})
        limited = await stack.add_router(env={"PHALANX_ROUTER_TENANTS": json.dumps(LIMITED_TENANTS)})
        fair = await stack.add_router(env={
            "PHALANX_ROUTER_TENANTS": json.dumps({"default": {}, "greedy": {}, "polite": {}}),
            "PHALANX_ROUTER_MAX_STREAMS": str(FAIR_CAPACITY), "PHALANX_ROUTER_QUEUE_TIMEOUT_S": "120",
        })
        gateway = await start_gateway(limited.address, env={
            "PHALANX_GATEWAY_TENANTS": json.dumps(LIMITED_TENANTS), "PHALANX_GATEWAY_API_KEYS": json.dumps(GATEWAY_KEYS),
        })
        gateways.append(gateway)
        return Deployment(stack, limited, fair, gateway)

    try:
        yield asyncio.run(start())
    finally:
        for gateway in gateways:
            gateway.terminate()
        stack.stop()


async def _first_chunk(stream):
    chunk = await anext(stream)
    assert chunk.index == 0
    return chunk


async def _unless_refused(call):
    """The call's result; a TENANT_LIMIT refusal as an AssertionError, for assert_eventually to try again."""
    try:
        return await call
    except OverloadedError as error:
        raise AssertionError(error.message) from None


def _details(error: grpc.aio.AioRpcError):
    status = rpc_status.from_call(error)
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    found_info = found_retry = False
    for detail in status.details if status else ():
        found_info = found_info or detail.Unpack(info)
        found_retry = found_retry or detail.Unpack(retry)
    return (info if found_info else None), (retry.retry_delay.ToTimedelta().total_seconds() if found_retry else None)


async def test_a_tenant_over_its_streams_gets_resource_exhausted_with_a_retry_hint_while_others_are_served(deployment):
    router = deployment.limited
    async with await Client.connect(router.address, timeout=60) as client:
        held = [client.generate(list(range(10, 30)), max_tokens=400, ignore_eos=True, tenant="capped") for _ in range(2)]
        try:
            for stream in held:
                await _first_chunk(stream)
            async with grpc.aio.insecure_channel(router.address) as channel:
                request = router_pb2.GenerateRequest(
                    text="one more", tenant="capped", sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [c async for c in router_pb2_grpc.RouterServiceStub(channel).Generate(request)]
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info, retry_after = _details(refused.value)
            assert info is not None and info.reason == "TENANT_LIMIT" and dict(info.metadata) == {"tenant": "capped", "limit": "max_streams"}
            assert retry_after is not None and retry_after > 0
            assert "max_streams 2" in (refused.value.details() or "")
            # The SDK raises it typed, without retrying (RESOURCE_EXHAUSTED is retried only when asked).
            with pytest.raises(OverloadedError) as typed:
                await client.complete("again", max_tokens=4, tenant="capped")
            assert typed.value.reason == "TENANT_LIMIT" and typed.value.retry_after_s
            # Another tenant is served meanwhile.
            other = await client.complete("someone else", max_tokens=6, ignore_eos=True)
            assert len(other.token_ids) == 6
        finally:
            for stream in held:
                await stream.aclose()

        # The held streams' ends free their slots (the router sees the cancels a moment later).
        again = await assert_eventually(
            lambda: _unless_refused(client.complete("after the others ended", max_tokens=4, ignore_eos=True, tenant="capped")), timeout=10
        )
        assert len(again.token_ids) == 4

    def counted():
        return (router.metric("phalanx_router_tenant_rejections_total", tenant="capped", limit="max_streams") or 0) >= 2

    await assert_eventually(counted, timeout=5)


async def test_a_stream_moved_to_another_worker_counts_once_and_is_released_once(deployment):
    """A drained worker hands the stream back and the router continues it on the other worker: still one of the tenant's
    streams (a second is refused, max_streams 1), and none once it ends (the tenant is served again)."""
    workers = {w.worker_id: w for w in deployment.stack.workers}
    async with await Client.connect(deployment.limited.address, timeout=60) as client:
        stream = client.generate(list(range(200, 230)), max_tokens=60, ignore_eos=True, tenant="solo")
        first = await _first_chunk(stream)
        source = workers[first.worker_id]
        try:
            async with grpc.aio.insecure_channel(source.address) as channel:
                drained = await worker_pb2_grpc.WorkerServiceStub(channel).Drain(worker_pb2.DrainRequest(grace_s=0, keep_running=True))
            assert drained.handed_back == 1
            chunks = [first]
            async for chunk in stream:
                chunks.append(chunk)
                if chunk.worker_id and chunk.worker_id != source.worker_id:
                    break  # the first token from the other worker: the stream moved
            with pytest.raises(OverloadedError, match="max_streams 1"):
                await client.complete("a second stream", max_tokens=2, tenant="solo")
            chunks += [chunk async for chunk in stream]
        finally:
            async with grpc.aio.insecure_channel(source.address) as channel:
                await worker_pb2_grpc.WorkerServiceStub(channel).Undrain(worker_pb2.UndrainRequest())
    assert [c.index for c in chunks] == list(range(60))
    assert {c.worker_id for c in chunks if c.worker_id} - {source.worker_id}, "the stream moved to the other worker"

    async with await Client.connect(deployment.limited.address, timeout=60) as client:
        again = await assert_eventually(lambda: _unless_refused(client.complete("after", max_tokens=3, ignore_eos=True, tenant="solo")), timeout=10)
    assert len(again.token_ids) == 3


async def test_a_tenant_over_its_tokens_per_minute_is_told_when_it_fits_again(deployment):
    async with await Client.connect(deployment.limited.address, timeout=60) as client:
        # 60 tokens a minute: a 20-token prompt and 38 generated leave 2; the next 20-token prompt fits in ~18 s.
        first = await client.complete(list(range(40, 60)), max_tokens=38, ignore_eos=True, tenant="metered")
        assert len(first.token_ids) == 38
        with pytest.raises(OverloadedError) as refused:
            await client.complete(list(range(40, 60)), max_tokens=4, tenant="metered")
        assert refused.value.reason == "TENANT_LIMIT" and "tokens_per_minute of 60" in refused.value.message
        assert refused.value.retry_after_s is not None and 5 < refused.value.retry_after_s <= 20
        assert len((await client.complete("not metered", max_tokens=5, ignore_eos=True)).token_ids) == 5
    assert deployment.limited.metric("phalanx_router_tenant_rejections_total", tenant="metered", limit="tokens_per_minute") == 1


async def test_a_prompt_over_the_tenants_size_is_invalid_naming_the_limit(deployment):
    async with await Client.connect(deployment.limited.address, timeout=60) as client:
        with pytest.raises(InvalidArgumentError) as refused:
            await client.complete(list(range(10, 50)), max_tokens=4, tenant="short")
        field, description = refused.value.violations[0]
        assert field == "prompt" and "40 tokens exceed the limit of tenant 'short' (max_prompt_tokens 32)" in description
        assert len((await client.complete(list(range(10, 42)), max_tokens=3, ignore_eos=True, tenant="short")).token_ids) == 3


async def test_openai_client_gets_429_with_retry_after_from_the_gateway(deployment):
    async with await Client.connect(deployment.limited.address, timeout=60) as client:
        held = client.generate(list(range(70, 90)), max_tokens=400, ignore_eos=True, tenant="gw")
        try:
            await _first_chunk(held)
            async with openai.AsyncOpenAI(
                base_url=f"{deployment.gateway.url}/v1", api_key="sk-gw-tenant", max_retries=0, timeout=30
            ) as oai:
                with pytest.raises(openai.RateLimitError) as refused:
                    await oai.completions.create(model=f"sim:{MODEL}", prompt="over the limit", max_tokens=4)
            assert refused.value.status_code == 429
            assert int(refused.value.response.headers["retry-after"]) >= 1
            assert refused.value.code == "rate_limit_exceeded" and "max_streams 1" in refused.value.message
            async with openai.AsyncOpenAI(
                base_url=f"{deployment.gateway.url}/v1", api_key="sk-default-tenant", max_retries=0, timeout=30
            ) as oai:
                served = await oai.completions.create(model=f"sim:{MODEL}", prompt="another tenant", max_tokens=4, temperature=0)
            assert served.usage is not None and served.usage.completion_tokens == 4
        finally:
            await held.aclose()


async def test_a_greedy_tenant_flooding_a_full_router_cannot_keep_another_tenant_waiting_behind_its_backlog(deployment):
    """The router holds 4 streams; the greedy tenant keeps 28 requests in flight, so ~24 of them wait. Another tenant's
    request must get one of the next free slots, not wait behind that backlog: while it waits, only greedy requests that
    had their slot as it arrived start (their first tokens may come after it), where a first-come queue would start ~24."""
    router = deployment.fair
    events: list[str] = []
    stop = asyncio.Event()

    async def greedy_user(client: Client, user: int) -> int:
        done = 0
        while not stop.is_set():
            stream = client.generate(list(range(100 + user, 120 + user)), max_tokens=20, ignore_eos=True, tenant="greedy")
            async with stream:
                async for chunk in stream:
                    if chunk.index == 0:
                        events.append("greedy_started")
            done += 1
        return done

    async with await Client.connect(router.address, timeout=120) as client:
        greedy = [asyncio.create_task(greedy_user(client, user)) for user in range(GREEDY_USERS)]
        try:
            def saturated():
                return (router.metric("phalanx_router_queued_requests") or 0) >= GREEDY_USERS - FAIR_CAPACITY - 4

            await assert_eventually(saturated, timeout=30)
            overtaken = []
            for i in range(4):
                events.append("polite_waiting")
                seen = len(events)
                got = 0
                stream = client.generate(f"polite request {i}", max_tokens=10, ignore_eos=True, tenant="polite")
                async with stream:
                    async for chunk in stream:
                        if chunk.index == 0:
                            overtaken.append(events[seen:].count("greedy_started"))
                        got += 1
                assert got == 10
            greedy_done = len([e for e in events if e == "greedy_started"])
        finally:
            stop.set()
            results = await asyncio.gather(*greedy, return_exceptions=True)
    assert not [r for r in results if isinstance(r, BaseException)], results
    print(f"greedy requests started while each polite request ran: {overtaken}; greedy started {greedy_done}")
    assert max(overtaken) <= 2 * FAIR_CAPACITY, overtaken


async def test_another_tenant_cannot_read_a_stream_by_sending_its_request_id(deployment):
    request_id = uuid.uuid4().hex
    async with await Client.connect(deployment.limited.address, timeout=60) as client:
        mine = await client.complete(list(range(150, 170)), max_tokens=5, ignore_eos=True, request_id=request_id)
        with pytest.raises(InvalidArgumentError) as refused:
            await client.complete(list(range(150, 170)), max_tokens=5, ignore_eos=True, request_id=request_id, tenant="capped")
        assert refused.value.violations[0][0] == "request_id"
        # Its own tenant's retry of the same request id still streams it again.
        again = await client.complete(list(range(150, 170)), max_tokens=5, ignore_eos=True, request_id=request_id)
    assert list(again.token_ids) == list(mine.token_ids)
