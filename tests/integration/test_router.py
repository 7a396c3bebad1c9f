"""End to end: SDK -> router process -> worker processes, over real NATS and etcd."""

import asyncio
import uuid

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.client import Client, InvalidArgumentError, UnavailableError
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer
from phalanx.launch.ports import free_port
from phalanx.launch.stack import Stack
from phalanx.planner.observations import observe_scrapes, parse_scrape
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

# A prompt of many full KV blocks (16 tokens each, ~63 here) so that prefix reuse is visible: the prefill it saves must
# outweigh the noise in the workers' measured step times, which the cost model weighs against it.
LONG = "The quick brown fox jumps over the lazy dog while the router watches every block. " * 12


@pytest.fixture(scope="module")
def shared(nats_server, etcd_server):
    """Two workers and a router for the tests that break nothing (a start costs seconds)."""
    s = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model="phalanx-tiny-moe")

    async def start():
        await s.add_workers(2)
        await s.add_router()

    try:
        asyncio.run(start())
        yield s
    finally:
        s.stop()


async def tokens_of(client: Client, prompt, max_tokens: int = 16, **kwargs) -> list[int]:
    completion = await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return list(completion.token_ids)


async def first_chunk_and_tokens(client: Client, prompt, max_tokens: int = 8):
    chunks = [c async for c in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True)]
    return chunks[0], [c.token_id for c in chunks]


async def test_32_concurrent_streams_complete_and_match_single_requests(shared):
    prompts = [f"request {i}: tell me about resilient inference" for i in range(32)]
    async with await Client.connect(shared.routers[0].address, timeout=60) as client:
        singles = [await tokens_of(client, p, 12) for p in prompts]
        together = await asyncio.gather(*(tokens_of(client, p, 12) for p in prompts))
    assert all(len(t) == 12 for t in together)
    assert together == singles


async def test_a_repeated_prompt_goes_to_the_worker_that_holds_its_blocks(shared):
    async with await Client.connect(shared.routers[0].address, timeout=30) as client:
        for n in range(4):
            prompt = f"{n}: {LONG}"
            indexed_before = {w.worker_id: w.indexed_blocks for w in await client.list_workers()}
            first, tokens = await first_chunk_and_tokens(client, prompt)
            holder = first.worker_id

            # Earlier prompts' blocks are indexed already; wait for this prompt's sixty or more
            # full blocks, whose KV events reach the router asynchronously over NATS.
            wanted = indexed_before.get(holder, 0) + 60

            async def indexed(holder=holder, wanted=wanted):
                workers = {w.worker_id: w for w in await client.list_workers()}
                return workers[holder].indexed_blocks >= wanted

            await assert_eventually(indexed, timeout=5)
            again, again_tokens = await first_chunk_and_tokens(client, prompt)
            assert again.worker_id == holder
            assert again.cached_prompt_tokens >= 16 * 60
            assert again_tokens == tokens


async def test_any_grpc_client_can_call_generate_through_server_reflection(shared):
    async with grpc.aio.insecure_channel(shared.routers[0].address) as channel:
        # Reflection is a sync API over a sync channel; run it off the loop.
        def describe():
            with grpc.insecure_channel(shared.routers[0].address) as sync_channel:
                pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(sync_channel))
                service = pool.FindServiceByName("phalanx.router.v1.RouterService")
                method = service.methods_by_name["Generate"]
                return (
                    message_factory.GetMessageClass(method.input_type),
                    message_factory.GetMessageClass(method.output_type),
                    pool.FindMessageTypeByName("phalanx.common.v1.SamplingParams"),
                )

        request_type, response_type, _ = await asyncio.to_thread(describe)
        request = request_type(text="reflection works", request_id=uuid.uuid4().hex)
        request.sampling.max_tokens = 5
        request.sampling.ignore_eos = True
        call = channel.unary_stream(
            "/phalanx.router.v1.RouterService/Generate",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        chunks = [c async for c in call(request)]
    assert [c.index for c in chunks] == list(range(5))
    assert type(chunks[0]).DESCRIPTOR.full_name == "phalanx.router.v1.GenerateResponse"


def _details(error: grpc.aio.AioRpcError, kind):
    status = rpc_status.from_call(error)
    found = []
    for detail in status.details if status else ():
        message = kind()
        if detail.Unpack(message):
            found.append(message)
    return found


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"text": "hi", "tier": 7}, "tier"),
        ({"text": "hi", "tenant": "nobody"}, "tenant"),
        ({"text": ""}, "prompt"),
        ({"tokens": common_pb2.PromptTokens(ids=[1, 99999])}, "prompt.tokens"),
        ({"text": "hi", "request_id": "has/slash"}, "request_id"),
        ({"text": "hi", "media": [router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=b"x")]}, "media"),
    ],
)
async def test_bad_requests_get_invalid_argument_naming_the_field(shared, request_kwargs, field):
    async with grpc.aio.insecure_channel(shared.routers[0].address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4), **request_kwargs)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [c async for c in stub.Generate(request)]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = _details(error.value, error_details_pb2.BadRequest)
    assert violations and violations[0].field_violations[0].field == field


async def test_sampling_errors_reach_the_sdk_as_typed_errors(shared):
    async with await Client.connect(shared.routers[0].address) as client:
        with pytest.raises(InvalidArgumentError) as error:
            await client.complete("hi", max_tokens=100_000)
    assert error.value.violations[0][0] == "sampling.max_tokens"


async def test_oversized_message_is_resource_exhausted(shared):
    async with grpc.aio.insecure_channel(shared.routers[0].address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(text="x" * (5 << 20), sampling=common_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [c async for c in stub.Generate(request)]
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_router_serves_metrics_and_health(shared):
    router = shared.routers[0]
    async with await Client.connect(router.address) as client:
        await tokens_of(client, "metrics please", 4, tier="premium")

    async def scraped():
        body = await asyncio.to_thread(router.metrics)
        # The request is counted when the router's handler returns, just after the client saw the last token.
        assert 'phalanx_router_requests_total{status="ok",tier="premium"}' in body
        return body

    body = await assert_eventually(scraped, timeout=5)
    for name in ("phalanx_router_ttft_seconds_bucket", "phalanx_router_itl_seconds_bucket", "phalanx_router_routing_seconds_bucket"):
        assert name in body
    async with grpc.aio.insecure_channel(router.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="phalanx.router.v1.RouterService"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_router_counts_arrivals_and_token_lengths_once_per_request_for_the_planner(shared):
    router = shared.routers[0]
    before = parse_scrape(await asyncio.to_thread(router.metrics), at=0.0)
    request_id = uuid.uuid4().hex
    async with await Client.connect(router.address) as client:
        prompt = list(range(40, 40 + 37))
        first = await client.complete(prompt, max_tokens=5, ignore_eos=True, request_id=request_id, tier="premium")
        # The client's retry of the same request id streams the finished request again: not a second request.
        again = await client.complete(prompt, max_tokens=5, ignore_eos=True, request_id=request_id, tier="premium")
    assert list(again.token_ids) == list(first.token_ids)

    async def counted():
        after = parse_scrape(await asyncio.to_thread(router.metrics), at=1.0)
        observation = observe_scrapes({"r": before}, {"r": after})
        assert observation is not None and observation.isl is not None and observation.osl is not None
        assert observation.arrival_rate == 1.0
        assert (observation.isl.count, observation.isl.mean) == (1.0, 37.0)
        assert (observation.osl.count, observation.osl.mean) == (1.0, 5.0)
        return observation

    await assert_eventually(counted, timeout=5)


async def test_no_worker_means_unavailable_with_a_retry_hint(nats_config):
    with EtcdServer() as etcd:  # an empty cluster of its own
        config = EtcdConfig(endpoint=etcd.endpoint, lease_ttl_s=1)
        s = Stack(nats_config.url, config, model="phalanx-tiny-moe")
        try:
            router = await s.add_router("--model", "phalanx-tiny-moe")
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                request = router_pb2.GenerateRequest(text="anyone?", sampling=common_pb2.SamplingParams(max_tokens=4))
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    [c async for c in stub.Generate(request)]
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            retry = _details(error.value, error_details_pb2.RetryInfo)
            assert retry and retry[0].retry_delay.ToTimedelta().total_seconds() > 0
        finally:
            await asyncio.to_thread(s.stop)


async def test_unavailable_sdk_error_when_nothing_listens():
    async with await Client.connect(f"127.0.0.1:{free_port()}", timeout=1.5) as client:
        with pytest.raises((UnavailableError,)):
            await client.complete("nobody home", max_tokens=2)
