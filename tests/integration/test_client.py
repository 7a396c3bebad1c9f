"""The SDK against a small, real RouterService that breaks on purpose.

The fake router serves a deterministic token sequence per request_id and
follows the router's contract (a known request_id on Generate streams from
index 0; Resume continues at tokens_received). Faults are queued per call.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field

import grpc
import pytest

from phalanx._proto import common_pb2, router_pb2, router_pb2_grpc
from phalanx.client import (
    Client,
    DeadlineExceededError,
    FinishReason,
    InvalidArgumentError,
    NotFoundError,
    OverloadedError,
    RetryPolicy,
    SyncClient,
    TlsConfig,
    UnavailableError,
    WorkerHealth,
)
from phalanx.common.errors import InvalidRequestError, ResourceExhaustedError, UnavailableError as RouterUnavailable
from phalanx.common.grpc_status import abort_with
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

FAST = RetryPolicy(max_attempts=20, initial_backoff_s=0.01, max_backoff_s=0.2)  # rides out about 3 s without a router
API_KEY = "k-test"


def token_id(request_id: str, index: int) -> int:
    return (zlib.crc32(request_id.encode()) + 7 * index) % 50_000


@dataclass
class Fault:
    """What the next Generate/Resume call does after sending `after` tokens."""

    kind: str  # unavailable | hold | end_early | invalid | overloaded | duplicate | gap
    after: int = 0
    retry_after_s: float | None = None


@dataclass
class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    requests: dict[str, int] = field(default_factory=dict)  # request_id -> max_tokens
    faults: list[Fault] = field(default_factory=list)
    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (rpc, request_id, start index)
    cancels: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    holding: int = 0  # calls parked by a "hold" fault

    async def Generate(self, request, context):
        fault = self._begin(context)
        if fault and fault.kind == "invalid":
            await abort_with(context, InvalidRequestError("sampling.temperature", "must be >= 0"))
        if fault and fault.kind == "overloaded":
            await abort_with(context, ResourceExhaustedError("queue full", retry_after_s=fault.retry_after_s or 1.0))
        self.requests.setdefault(request.request_id, request.sampling.max_tokens)
        self.calls.append(("Generate", request.request_id, 0))
        async for response in self._serve(request.request_id, 0, fault, context):
            yield router_pb2.GenerateResponse.FromString(response.SerializeToString())

    async def Resume(self, request, context):
        fault = self._begin(context)
        self.calls.append(("Resume", request.request_id, request.tokens_received))
        if request.request_id not in self.requests:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id}")
        async for response in self._serve(request.request_id, request.tokens_received, fault, context):
            yield response

    async def Cancel(self, request, context):
        self._begin(context, consume_fault=False)
        self.cancels.append(request.request_id)
        return router_pb2.CancelResponse(cancelled=self.requests.pop(request.request_id, None) is not None)

    async def ListWorkers(self, request, context):
        self._begin(context, consume_fault=False)
        worker = router_pb2.WorkerStatus(worker_id="w-1", address="127.0.0.1:1", health=common_pb2.WORKER_HEALTH_DRAINING, queue_depth=3)
        return router_pb2.ListWorkersResponse(router_id="r-1", workers=[worker])

    def _begin(self, context, *, consume_fault: bool = True) -> Fault | None:
        self.metadata.append(dict(context.invocation_metadata()))
        return self.faults.pop(0) if consume_fault and self.faults else None

    async def _serve(self, request_id: str, start: int, fault: Fault | None, context):
        """ResumeResponses from `start` (GenerateResponse has the same wire format), faults applied."""
        max_tokens = self.requests[request_id]
        if fault and fault.kind == "duplicate":
            start -= fault.after
        if fault and fault.kind == "gap":
            start += 1
        for sent, index in enumerate(range(start, max_tokens)):
            if fault and sent == fault.after:
                if fault.kind == "end_early":
                    return  # status OK, but no final token
                await self._fail(fault, context)
            last = index == max_tokens - 1
            yield router_pb2.ResumeResponse(
                request_id=request_id,
                token_id=token_id(request_id, index),
                text=f"<{index}>",
                index=index,
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                prompt_tokens=5 if sent == 0 else 0,
                seed=42 if sent == 0 else 0,
                worker_id="w-1" if sent == 0 else "",
            )

    async def _fail(self, fault: Fault, context) -> None:
        if fault.kind == "unavailable":
            await abort_with(context, RouterUnavailable("worker lost", retry_after_s=fault.retry_after_s or 0.0))
        if fault.kind == "hold":
            self.holding += 1
            await asyncio.Event().wait()  # until the server stops and cancels this call


class RouterHarness:
    """A grpc.aio server for the fake router that can be restarted on the same port."""

    def __init__(self, servicer: FakeRouter, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = servicer
        self.credentials = credentials
        self.port = 0
        self.server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.servicer, server)
        address = f"127.0.0.1:{self.port}"
        self.port = server.add_secure_port(address, self.credentials) if self.credentials else server.add_insecure_port(address)
        await server.start()
        self.server = server

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()


def expected_tokens(request_id: str, n: int) -> list[tuple[int, int, str]]:
    return [(i, token_id(request_id, i), f"<{i}>") for i in range(n)]


@pytest.fixture
def fake() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
async def router(fake):
    harness = RouterHarness(fake)
    await harness.start()
    yield harness
    await harness.stop()


@pytest.fixture
async def client(router):
    async with await Client.connect(router.target, api_key=API_KEY, retry=FAST) as connected:
        yield connected


async def test_generate_streams_every_token_once_with_prompt_accounting(client, fake):
    stream = client.generate("hello", max_tokens=6, request_id="r-plain")
    chunks = [chunk async for chunk in stream]
    assert [(c.index, c.token_id, c.text) for c in chunks] == expected_tokens("r-plain", 6)
    assert chunks[0].prompt_tokens == 5 and chunks[0].seed == 42
    assert all(c.worker_id == "w-1" and c.request_id == "r-plain" for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * 5 + [FinishReason.LENGTH]
    assert stream.resumes == 0 and fake.calls == [("Generate", "r-plain", 0)] and fake.cancels == []


async def test_request_id_is_made_client_side_when_not_given(client, fake):
    completion = await client.complete("hello", max_tokens=2)
    assert len(completion.request_id) == 32 and list(fake.requests) == [completion.request_id]


@pytest.mark.parametrize(
    ("faults", "resume_points", "resumes"),
    [
        ([Fault("unavailable", after=3, retry_after_s=0.01)], [3], 1),
        ([Fault("unavailable", after=0)], [], 1),  # before the first token: Generate again, same request_id
        ([Fault("unavailable", after=0), Fault("unavailable", after=4), Fault("end_early", after=2)], [4, 6], 3),
        ([Fault("unavailable", after=2), Fault("duplicate", after=2)], [2], 1),  # the Resume re-sends 0 and 1
    ],
    ids=["one-break", "before-first-token", "three-breaks", "duplicates-dropped"],
)
async def test_breaks_are_resumed_and_every_index_yielded_once_in_order(client, fake, faults, resume_points, resumes):
    fake.faults = list(faults)
    stream = client.generate("hello", max_tokens=10, request_id="r-breaks")
    chunks = [chunk async for chunk in stream]
    assert [(c.index, c.token_id, c.text) for c in chunks] == expected_tokens("r-breaks", 10)
    assert [start for rpc, _, start in fake.calls if rpc == "Resume"] == resume_points
    assert all(rpc == "Generate" for rpc, _, start in fake.calls if start == 0)
    assert stream.resumes == resumes and fake.cancels == []


async def test_router_restart_mid_stream_is_resumed_on_the_new_server(client, fake, router):
    fake.faults = [Fault("hold", after=4)]
    stream = client.generate("hello", max_tokens=8, request_id="r-restart")
    got = []
    async for chunk in stream:
        got.append(chunk)
        if chunk.index == 3:
            await assert_eventually(lambda: fake.holding == 1)
            await router.restart()
    assert [(c.index, c.token_id, c.text) for c in got] == expected_tokens("r-restart", 8)
    assert fake.calls[-1] == ("Resume", "r-restart", 4)
    assert stream.resumes >= 1


async def test_stream_waits_out_a_router_that_is_down_for_a_while(client, fake, router):
    fake.faults = [Fault("hold", after=2)]
    stream = client.generate("hello", max_tokens=5, request_id="r-down")
    assert [c.index for c in [await anext(stream), await anext(stream)]] == [0, 1]
    await assert_eventually(lambda: fake.holding == 1)
    await router.stop()
    pending = asyncio.ensure_future(anext(stream))
    await assert_eventually(lambda: stream.resumes >= 2, message="retries while no router listens")
    await router.start()
    rest = [await pending] + [chunk async for chunk in stream]
    assert [c.index for c in rest] == [2, 3, 4]
    assert ("Resume", "r-down", 2) in fake.calls


async def test_invalid_argument_is_not_retried_and_carries_violations(client, fake):
    fake.faults = [Fault("invalid")]
    with pytest.raises(InvalidArgumentError) as caught:
        await client.complete("hello", max_tokens=4, request_id="r-bad")
    assert caught.value.violations == [("sampling.temperature", "must be >= 0")]
    assert caught.value.reason == "INVALID_REQUEST" and caught.value.request_id == "r-bad"
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(fake.metadata) == 1 and fake.cancels == []


async def test_overloaded_error_carries_retry_after_and_is_not_retried_by_default(client, fake):
    fake.faults = [Fault("overloaded", retry_after_s=2.5)]
    with pytest.raises(OverloadedError) as caught:
        await client.complete("hello", max_tokens=4)
    assert caught.value.retry_after_s == pytest.approx(2.5)
    assert caught.value.retryable and len(fake.metadata) == 1 and fake.cancels == []


async def test_overloaded_is_retried_before_the_first_token_when_opted_in(router, fake):
    fake.faults = [Fault("overloaded", retry_after_s=0.01), Fault("overloaded", retry_after_s=0.01)]
    policy = RetryPolicy(initial_backoff_s=0.01, retry_overloaded=True)
    async with await Client.connect(router.target, retry=policy) as client:
        completion = await client.complete("hello", max_tokens=3)
    assert completion.token_ids == tuple(token_id(completion.request_id, i) for i in range(3))
    assert completion.resumes == 2


async def test_retries_stop_after_max_attempts_without_progress(router, fake):
    fake.faults = [Fault("unavailable", retry_after_s=0.01) for _ in range(3)]
    async with await Client.connect(router.target, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01)) as client:
        with pytest.raises(UnavailableError) as caught:
            await client.complete("hello", max_tokens=3, request_id="r-exhausted")
    assert caught.value.retry_after_s == pytest.approx(0.01) and caught.value.reason == "UNAVAILABLE"
    assert len(fake.calls) == 3


async def test_resume_of_an_unknown_request_raises_not_found(client):
    with pytest.raises(NotFoundError):
        [chunk async for chunk in client.resume("r-unknown", 3)]


async def test_public_resume_continues_a_request_at_the_given_index(client, fake):
    await client.complete("hello", max_tokens=6, request_id="r-handoff")
    fake.faults = [Fault("unavailable", after=1)]
    stream = client.resume("r-handoff", 3)
    assert [c.index for c in [chunk async for chunk in stream]] == [3, 4, 5]
    assert fake.calls[1:] == [("Resume", "r-handoff", 3), ("Resume", "r-handoff", 4)] and stream.resumes == 1


async def test_breaking_out_early_cancels_the_request_server_side(client, fake):
    async for chunk in client.generate("hello", max_tokens=50, request_id="r-break"):
        assert chunk.index == 0
        break
    await assert_eventually(lambda: fake.cancels == ["r-break"])


async def test_closing_the_client_right_after_a_break_still_cancels(router, fake):
    async with await Client.connect(router.target) as client:
        async for _ in client.generate("hello", max_tokens=50, request_id="r-close"):
            break
    assert fake.cancels == ["r-close"]


async def test_async_with_cancels_deterministically_on_exit(client, fake):
    async with client.generate("hello", max_tokens=50, request_id="r-with") as stream:
        await anext(stream)
    assert fake.cancels == ["r-with"]


async def test_breaking_after_the_final_chunk_sends_no_cancel(client, fake):
    async with client.generate("hello", max_tokens=2, request_id="r-done") as stream:
        async for chunk in stream:
            if chunk.finish_reason is not None:
                break
    assert fake.cancels == []


async def test_cancelling_the_consuming_task_cancels_the_request(client, fake):
    fake.faults = [Fault("hold", after=1)]
    got = []

    async def consume():
        async for chunk in client.generate("hello", max_tokens=50, request_id="r-task"):
            got.append(chunk)

    task = asyncio.create_task(consume())
    await assert_eventually(lambda: got and fake.holding == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_eventually(lambda: fake.cancels == ["r-task"])


async def test_timeout_bounds_the_whole_stream(client, fake):
    fake.faults = [Fault("hold", after=2)]
    started = time.monotonic()
    got = []
    with pytest.raises(DeadlineExceededError) as caught:
        async for chunk in client.generate("hello", max_tokens=10, request_id="r-slow", timeout=0.5):
            got.append(chunk.index)
    assert 0.4 <= time.monotonic() - started < 2.0
    assert got == [0, 1] and caught.value.request_id == "r-slow"
    await assert_eventually(lambda: fake.cancels == ["r-slow"])


async def test_api_key_and_trace_context_ride_on_every_call(client, fake):
    trace = pytest.importorskip("opentelemetry.sdk.trace")
    fake.faults = [Fault("unavailable", after=1)]
    tracer = trace.TracerProvider(shutdown_on_exit=False).get_tracer("test")
    with tracer.start_as_current_span("caller") as span:
        await client.complete("hello", max_tokens=3)
        await client.cancel("nothing")
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert len(fake.metadata) == 3  # Generate, Resume, Cancel
    for metadata in fake.metadata:
        assert metadata["authorization"] == f"Bearer {API_KEY}"
        assert metadata["traceparent"].split("-")[1] == trace_id


async def test_cancel_and_list_workers(client, fake):
    await client.complete("hello", max_tokens=1, request_id="r-known")
    assert await client.cancel("r-known") is True
    assert await client.cancel("r-known") is False
    [worker] = await client.list_workers()
    assert worker.worker_id == "w-1" and worker.health is WorkerHealth.DRAINING and worker.queue_depth == 3


async def test_several_router_replicas_in_one_target(fake):
    first, second = RouterHarness(fake), RouterHarness(fake)
    await first.start()
    await second.start()
    try:
        async with await Client.connect(f"ipv4:{first.target},{second.target}", retry=FAST) as client:
            fake.faults = [Fault("hold", after=2)]
            stream = client.generate("hello", max_tokens=6, request_id="r-replicas")
            got = [await anext(stream), await anext(stream)]
            await assert_eventually(lambda: fake.holding == 1)
            await first.stop()
            await second.stop()
            await second.start()  # only one replica comes back
            got += [chunk async for chunk in stream]
        assert [c.index for c in got] == list(range(6))
    finally:
        await first.stop()
        await second.stop()


def make_certificate(directory) -> tuple[bytes, bytes]:
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=router.phalanx.test", "-addext", "subjectAltName=DNS:router.phalanx.test"],
        check=True, capture_output=True,
    )
    return key.read_bytes(), cert.read_bytes()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
async def test_tls_with_a_self_signed_certificate(tmp_path, fake):
    key, cert = make_certificate(tmp_path)
    harness = RouterHarness(fake, grpc.ssl_server_credentials([(key, cert)]))
    await harness.start()
    try:
        tls = TlsConfig(root_certificates=cert, server_name_override="router.phalanx.test")
        async with await Client.connect(harness.target, tls=tls, api_key=API_KEY) as client:
            assert (await client.complete("hello", max_tokens=3)).token_ids
        untrusted = RetryPolicy(max_attempts=1)
        async with await Client.connect(harness.target, tls=TlsConfig(server_name_override="router.phalanx.test"), retry=untrusted) as client:
            with pytest.raises(UnavailableError):
                await client.complete("hello", max_tokens=3)
    finally:
        await harness.stop()


async def test_sync_client_generate_complete_and_break(router, fake):
    def use_sync_client():
        with SyncClient.connect(router.target, api_key=API_KEY, retry=FAST) as sync:
            completion = sync.complete("hello", max_tokens=4, request_id="r-sync")
            stream = sync.generate("hello", max_tokens=5, request_id="r-sync-stream")
            indexes = [chunk.index for chunk in stream]
            for chunk in sync.generate("hello", max_tokens=50, request_id="r-sync-break"):
                first = chunk
                break
            workers = sync.list_workers()
            return completion, stream.resumes, indexes, first, workers

    fake.faults = [Fault("unavailable", after=2)]
    completion, resumes, indexes, first, workers = await asyncio.to_thread(use_sync_client)
    assert completion.text == "<0><1><2><3>" and completion.resumes == 1 and completion.seed == 42
    assert completion.finish_reason is FinishReason.LENGTH and completion.prompt_tokens == 5
    assert indexes == [0, 1, 2, 3, 4] and resumes == 0 and first.index == 0 and workers[0].worker_id == "w-1"
    await assert_eventually(lambda: fake.cancels == ["r-sync-break"])


async def test_sync_client_is_safe_to_share_between_threads(router):
    def run_threads():
        with SyncClient.connect(router.target, retry=FAST) as sync:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda i: sync.complete("hi", max_tokens=3, request_id=f"r-thread-{i}").text, range(8)))

    assert await asyncio.to_thread(run_threads) == ["<0><1><2>"] * 8


def test_importing_the_sdk_pulls_in_no_service_dependencies():
    code = (
        "import sys, phalanx.client; "
        "assert not {'torch','nats','aetcd','pydantic'} & set(sys.modules), sorted(sys.modules); "
        "assert not [m for m in sys.modules if m.startswith(('phalanx.common', 'opentelemetry.sdk'))]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
