"""The OpenAI-compatible gateway end to end: the official openai client -> gateway -> SDK -> routers -> worker, real processes.

One worker and two routers (with API keys) serve the whole module; the
gateways in front of them are open (forwarding a service key) or keyed
(forwarding each caller's key). Every service exports its spans to an OTLP
collector in this process, so one test follows a request's trace through all.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures

import grpc
import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import encode_json
from phalanx.common.lease import connect_etcd
from phalanx.common.subjects import DEGRADATION_KEY, health_key
from phalanx.launch.ports import free_port
from phalanx.launch.services import GatewayHandle, start_gateway
from phalanx.launch.stack import Stack
from phalanx.model.chat import render_chat
from phalanx.model.tokenizer import ByteTokenizer
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

TENANTS = json.dumps({"default": {}, "batch": {"default_tier": "best_effort", "max_tier": "standard"}})
ROUTER_KEYS = json.dumps({"k-std": "default", "k-batch": "batch", "svc": "default"})
GATEWAY_KEYS = json.dumps({"k-std": "default", "k-batch": "batch"})
PROMPT = "Resilient inference keeps every token"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC endpoint that keeps (service name, span name, trace id) of what it receives."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span.name, span.trace_id) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def in_trace(self, trace_id: bytes) -> list[tuple[str, str]]:
        with self._lock:
            return [(service, name) for service, name, tid in self.spans if tid == trace_id]


class Deployment:
    def __init__(
        self, stack: Stack, collector: Collector, open_gateway: GatewayHandle, keyed_gateway: GatewayHandle, router_env: dict[str, str]
    ) -> None:
        self.stack = stack
        self.router_env = router_env
        self.collector = collector
        self.open = open_gateway
        self.keyed = keyed_gateway

    @property
    def target(self) -> str:
        return "ipv4:" + ",".join(r.address for r in self.stack.routers)


@pytest.fixture(scope="module")
def deployment(nats_server, etcd_server):
    collector = Collector()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    telemetry = {"PHALANX_TELEMETRY_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    stack = Stack(nats_server.url, EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1), model="phalanx-tiny-moe")
    gateways: list[GatewayHandle] = []
    router_env = {"PHALANX_ROUTER_TENANTS": TENANTS, "PHALANX_ROUTER_API_KEYS": ROUTER_KEYS, **telemetry}

    async def start() -> Deployment:
        await stack.add_workers(1, env=telemetry)
        for _ in range(2):
            await stack.add_router(port=free_port(), env=router_env)
        target = "ipv4:" + ",".join(r.address for r in stack.routers)
        open_gateway, keyed_gateway = await asyncio.gather(
            start_gateway(target, name="gateway-open", env={"PHALANX_GATEWAY_ROUTER_API_KEY": "svc", **telemetry}),
            start_gateway(
                target, name="gateway-keyed",
                env={"PHALANX_GATEWAY_TENANTS": TENANTS, "PHALANX_GATEWAY_API_KEYS": GATEWAY_KEYS, "PHALANX_GATEWAY_RETRY_MAX_ATTEMPTS": "2",
                     **telemetry},
            ),
        )
        gateways.extend((open_gateway, keyed_gateway))
        return Deployment(stack, collector, open_gateway, keyed_gateway, router_env)

    try:
        yield asyncio.run(start())
    finally:
        for gateway in gateways:
            gateway.terminate()
        stack.stop()
        otlp.stop(0)


@pytest.fixture(scope="module")
def model(deployment) -> str:
    with openai.OpenAI(base_url=f"{deployment.open.url}/v1", api_key="unused", max_retries=0) as client:
        (card,) = client.models.list().data
    return card.id


def async_client(gateway: GatewayHandle, key: str = "unused", **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60, **options)


async def greedy_completion(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> openai.types.Completion:
    return await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )


# -- the happy paths ------------------------------------------------------------------------------------------
def test_models_lists_the_workers_model_and_the_sync_client_completes(deployment, model):
    assert model == "phalanx-tiny-moe"  # what Stack's workers serve; nobody configured it on the gateway
    with openai.OpenAI(base_url=f"{deployment.open.url}/v1", api_key="unused", max_retries=0) as client:
        assert client.models.retrieve(model).id == model
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    (choice,) = completion.choices
    assert (choice.finish_reason, completion.object, completion.model) == ("length", "text_completion", model)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == len(ByteTokenizer().encode(PROMPT))
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12


async def test_a_streamed_completion_is_the_non_streamed_one_with_usage_last(deployment, model):
    async with async_client(deployment.open) as client:
        whole = await greedy_completion(client, model, PROMPT, 40)
        stream = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    *pieces, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert (usage_chunk.usage.completion_tokens, usage_chunk.usage.prompt_tokens) == (40, whole.usage.prompt_tokens)


async def test_chat_renders_the_template_and_streams_what_it_answers_whole(deployment, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What keeps serving?"}]
    async with async_client(deployment.open) as client:
        whole = await client.chat.completions.create(model=model, messages=messages, max_completion_tokens=24, temperature=0)
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage is not None
    # The built-in model has no template of its own: ChatML, tokenized by the router with its BOS.
    assert whole.usage.prompt_tokens == len(ByteTokenizer().encode(render_chat(messages, template=None)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


async def test_a_stop_sequence_ends_the_text_before_it_with_finish_reason_stop(deployment, model):
    async with async_client(deployment.open) as client:
        reference = (await greedy_completion(client, model, PROMPT, 48)).choices[0].text
        # Two characters the greedy answer holds after its first few (skipping undecodable bytes).
        start = next(i for i in range(4, len(reference) - 2) if "\ufffd" not in reference[i : i + 2])
        stop = reference[start : start + 2]
        stopped = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=48, temperature=0, stop=[stop, "never appears"], extra_body={"ignore_eos": True}
        )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == reference[: reference.find(stop)]


async def test_a_seed_makes_sampling_repeatable(deployment, model):
    async with async_client(deployment.open) as client:
        runs = [
            await client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
            for _ in range(2)
        ]
    assert runs[0].choices[0].text == runs[1].choices[0].text


async def test_chat_logprobs_whole_and_streamed_are_the_same_and_rank_the_greedy_token_first(deployment, model):
    args = dict(
        model=model, messages=[{"role": "user", "content": "Which token comes next?"}], max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )
    async with async_client(deployment.open) as client:
        whole = await client.chat.completions.create(**args)
        streamed = [c async for c in await client.chat.completions.create(**args, stream=True)]
    assert whole.choices[0].logprobs is not None
    content = whole.choices[0].logprobs.content
    assert content is not None and len(content) == 8  # one per generated token
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert (entry.token, entry.bytes) == (entry.top_logprobs[0].token, entry.top_logprobs[0].bytes)  # greedy: the likeliest
        assert entry.logprob == entry.top_logprobs[0].logprob
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.bytes) for e in pieces] == [(e.token, e.bytes) for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(pieces, content, strict=True)) < 1e-3


async def test_completions_logprobs_and_echo_score_the_prompt_then_the_same_completion(deployment, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    async with async_client(deployment.open) as client:
        plain = await client.completions.create(**args)
        echoed = await client.completions.create(**args, echo=True)
        streamed = [c async for c in await client.completions.create(**args, echo=True, stream=True)]
    scored = plain.choices[0].logprobs
    assert scored is not None and scored.tokens is not None and scored.token_logprobs is not None and scored.top_logprobs is not None
    assert len(scored.tokens) == 6 and all(lp is not None and lp <= 0 for lp in scored.token_logprobs)
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-6 for top, lp in zip(scored.top_logprobs, scored.token_logprobs, strict=True))
    assert scored.text_offset is not None and scored.text_offset[0] == 0 and scored.text_offset == sorted(scored.text_offset)
    prompt_tokens = len(ByteTokenizer().encode(PROMPT))
    whole = echoed.choices[0]
    assert whole.text == PROMPT + plain.choices[0].text
    lp = whole.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == prompt_tokens + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # BOS: nothing before it
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[prompt_tokens:] == scored.tokens  # the same greedy completion after the scored prompt
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[prompt_tokens:], scored.token_logprobs, strict=True)) < 0.05  # type: ignore[operator]
    parts = [c.choices[0] for c in streamed if c.choices]
    assert "".join(p.text for p in parts) == whole.text
    assert [t for p in parts if p.logprobs for t in p.logprobs.tokens or []] == lp.tokens
    assert [o for p in parts if p.logprobs for o in p.logprobs.text_offset or []] == lp.text_offset


# -- errors --------------------------------------------------------------------------------------------------
async def test_bad_parameters_are_400_naming_the_parameter(deployment, model):
    async with async_client(deployment.open) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=model, prompt=PROMPT, temperature=3)
        assert caught.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)
        assert caught.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21)
        assert caught.value.body["param"] == "top_logprobs" and "20" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
        assert caught.value.body["param"] == "top_logprobs" and "logprobs: true" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=model, prompt=PROMPT, logprobs=6)
        assert caught.value.body["param"] == "logprobs" and "5" in caught.value.body["message"]
        # Checked by the router (prompt + max_tokens beyond the workers' context), named as OpenAI names it.
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=model, prompt=PROMPT, max_tokens=100_000, stream=True)
        assert caught.value.body["param"] == "max_tokens" and "context" in caught.value.body["message"]
    async with httpx.AsyncClient(base_url=deployment.open.url) as http:
        reply = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error" and reply.json()["error"]["code"] == "invalid_json"


async def test_an_unknown_model_is_404(deployment):
    async with async_client(deployment.open) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.completions.create(model="gpt-4o", prompt=PROMPT)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


async def test_keys_are_checked_and_forwarded_and_a_tier_can_only_be_lowered(deployment, model):
    async with async_client(deployment.keyed, key="wrong") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert caught.value.body["code"] == "invalid_api_key"
    async with httpx.AsyncClient(base_url=deployment.keyed.url) as http:  # openai's client insists on a key
        reply = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "missing_api_key"
    async with async_client(deployment.keyed, key="k-std") as client:
        lowered = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=2, extra_headers={"X-Phalanx-Tier": "best_effort"}
        )
        assert lowered.usage is not None and lowered.usage.completion_tokens >= 1
    async with async_client(deployment.keyed, key="k-batch") as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_headers={"X-Phalanx-Tier": "premium"})
        assert caught.value.body["param"] == "x-phalanx-tier"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2, metadata={"tier": "premium"}
            )
        assert caught.value.body["param"] == "metadata.tier"


async def test_shed_requests_are_429_and_no_worker_is_503_both_with_retry_after(deployment, model):
    etcd = connect_etcd(deployment.stack.etcd_config)
    worker = deployment.stack.workers[0]
    try:
        # Level 2 sheds best_effort, the batch tenant's default tier; standard requests still pass.
        await etcd.put(DEGRADATION_KEY.encode(), encode_json(common_pb2.DegradationState(level=2, reason="test")))
        async with async_client(deployment.keyed, key="k-batch") as batch, async_client(deployment.keyed, key="k-std") as standard:

            async def shed():  # pytest.raises would fail at the first try, before the router saw the level
                try:
                    await batch.completions.create(model=model, prompt=PROMPT, max_tokens=2)
                except openai.RateLimitError as error:
                    return error.response
                raise AssertionError("a best_effort request was served at degradation level 2")

            response = await assert_eventually(shed, timeout=10)
            assert int(response.headers["retry-after"]) >= 1 and response.json()["error"]["type"] == "rate_limit_error"
            assert (await standard.completions.create(model=model, prompt=PROMPT, max_tokens=2)).usage.completion_tokens >= 1
        await etcd.delete(DEGRADATION_KEY.encode())

        # The health service takes the only worker out of routing: no worker can take a request.
        record = common_pb2.WorkerHealthRecord(worker_id=worker.worker_id, health=common_pb2.WORKER_HEALTH_UNHEALTHY)
        await etcd.put(health_key(worker.worker_id).encode(), encode_json(record))
        async with async_client(deployment.keyed, key="k-std") as client:

            async def unavailable():
                try:
                    await client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True)
                except openai.InternalServerError as error:
                    return error.response
                raise AssertionError("a request was taken with the only worker out of routing")

            response = await assert_eventually(unavailable, timeout=15)
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        assert "no worker can take the request" in response.json()["error"]["message"]
    finally:
        await etcd.delete(DEGRADATION_KEY.encode())
        await etcd.delete(health_key(worker.worker_id).encode())
        await etcd.close()
    async with async_client(deployment.keyed, key="k-std") as client:

        async def served_again():
            return (await client.completions.create(model=model, prompt=PROMPT, max_tokens=2)).usage.completion_tokens

        await assert_eventually(served_again, timeout=10)


# -- cancellation, failover, tracing, shutdown -------------------------------------------------------------------------
def cancels(worker) -> float:
    return worker.metric("phalanx_worker_cancels_total") or 0.0


async def test_a_client_that_goes_away_cancels_its_request(deployment, model):
    worker = deployment.stack.workers[0]
    before = await asyncio.to_thread(cancels, worker)
    # Streaming: the openai client closes its stream after three chunks.
    async with async_client(deployment.open) as client:
        stream = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.close()
    await assert_eventually(lambda: cancels(worker) >= before + 1, timeout=10, message="the streamed request was not cancelled")
    # Not streaming: the client hangs up (a read timeout) while the completion is still generating.
    async with httpx.AsyncClient(base_url=deployment.open.url, timeout=httpx.Timeout(10, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                "/v1/completions",
                json={"model": model, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True},
            )
    await assert_eventually(lambda: cancels(worker) >= before + 2, timeout=10, message="the whole request was not cancelled")

    def running_and_closed():
        running = worker.metric("phalanx_worker_running_seqs")
        closed = deployment.open.metric("phalanx_gateway_requests_total", endpoint="completions", status="client_closed")
        assert (running, closed) == (0, 2)
        return True

    await assert_eventually(running_and_closed, timeout=10)


def serving_router(deployment: Deployment):
    busy = [r for r in deployment.stack.routers if r.process.poll() is None and (r.metric("phalanx_router_active_streams") or 0) > 0]
    return busy[0] if len(busy) == 1 else None


async def test_a_router_sigkilled_mid_stream_is_invisible_to_the_openai_streaming_client(deployment, model):
    async with async_client(deployment.open) as client:
        reference = await greedy_completion(client, model, PROMPT, 150)
        resumes_before = await asyncio.to_thread(deployment.open.metric, "phalanx_gateway_stream_resumes_total")
        stream = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=150, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts: list[str] = []
        killed = None
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            texts.append(chunk.choices[0].text)
            if len(texts) == 5:
                killed = await assert_eventually(lambda: serving_router(deployment), timeout=5)
                killed.kill()
    assert killed is not None
    assert "".join(texts) == reference.choices[0].text  # nothing lost, nothing repeated
    assert usage is not None and usage.completion_tokens == 150
    resumes = await asyncio.to_thread(deployment.open.metric, "phalanx_gateway_stream_resumes_total")
    assert resumes >= (resumes_before or 0) + 1  # the stream did break under the SDK
    # Back to two routers for whatever runs next, on the same address (the gateways' target names it).
    port = int(killed.address.rsplit(":", 1)[1])
    deployment.stack.routers.remove(killed)
    await deployment.stack.add_router(port=port, router_id=killed.router_id, env=deployment.router_env)


async def test_gateway_router_and_worker_spans_share_the_callers_trace(deployment, model):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    traceparent = f"00-{trace_id}-b7ad6b7169203331-01"
    async with async_client(deployment.open) as client:
        await client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_headers={"traceparent": traceparent})

    def joined():
        spans = set(deployment.collector.in_trace(bytes.fromhex(trace_id)))
        # Each service exports on its own schedule: wait for the span of each hop.
        assert {("phalanx-gateway", "gateway.completions"), ("phalanx-router", "router.route")} <= spans, spans
        assert any(service == "phalanx-worker" and "WorkerService/Generate" in name for service, name in spans), spans
        return True

    await assert_eventually(joined, timeout=10)


async def test_a_configured_model_name_health_metrics_and_a_clean_exit_on_sigterm_with_a_stream_in_flight(deployment, model):
    gateway = await start_gateway(
        deployment.target, "--model", model, name="gateway-sigterm",
        env={"PHALANX_GATEWAY_ROUTER_API_KEY": "svc", "PHALANX_GATEWAY_SERVED_MODEL_NAME": "tiny"},
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
        async with async_client(gateway) as client:
            assert [m.id for m in (await client.models.list()).data] == ["tiny"]
            answer = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert answer.model == "tiny" and answer.usage is not None and answer.usage.completion_tokens >= 1
            stream = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            first = await anext(aiter(stream))
            gateway.process.terminate()  # SIGTERM: the stream in flight still finishes within the grace period
            rest = [chunk async for chunk in stream]
        assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason == "length"
        assert await asyncio.to_thread(gateway.process.wait, 30) == 0
    finally:
        gateway.kill()
    # The stopped gateway's metrics went with it: the module's long-lived one is read, after requests of its own
    # (run alone, with -k, nothing else has called it).
    async with async_client(deployment.open) as client:
        await greedy_completion(client, model, "metrics", 2)
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = await asyncio.to_thread(deployment.open.metrics)
    assert 'phalanx_gateway_requests_total{endpoint="completions",status="200"}' in text
    assert 'phalanx_gateway_request_seconds_bucket{endpoint="completions"' in text
    assert 'phalanx_gateway_tokens_total{endpoint="chat_completions"}' in text
