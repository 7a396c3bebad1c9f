"""The client SDK's surface and logic without a network: names, RPC coverage, error mapping, retries."""

from __future__ import annotations

import inspect
import json
import random
import re
import time

import grpc
import pytest
from google.rpc import status_pb2
from grpc_status import rpc_status

import phalanx.client
from phalanx._proto import router_pb2
from phalanx.client import (
    AuthenticationError,
    Client,
    Completion,
    DeadlineExceededError,
    FinishReason,
    GenerateOptions,
    InternalError,
    InvalidArgumentError,
    Media,
    NotFoundError,
    OverloadedError,
    PhalanxClientError,
    RequestCancelledError,
    RequestQuarantinedError,
    RetryPolicy,
    StreamGapError,
    SyncClient,
    Tier,
    TlsConfig,
    UnavailableError,
    _channel,
)
from phalanx.client._client import build_request
from phalanx.client._errors import from_rpc_error
from phalanx.client._options import GenerateParams
from phalanx.client._stream import GenerateStream, is_retryable
from phalanx.client._transport import REOPEN_INTERVAL_S
from phalanx.common import errors as domain
from phalanx.common.grpc_status import to_status

pytestmark = pytest.mark.unit
C = grpc.StatusCode


def test_public_names_are_pinned():
    assert phalanx.client.__all__ == [
        "AuthenticationError",
        "Chunk",
        "Client",
        "Completion",
        "DeadlineExceededError",
        "FinishReason",
        "GenerateOptions",
        "GenerateStream",
        "InternalError",
        "InvalidArgumentError",
        "Media",
        "NotFoundError",
        "OverloadedError",
        "PhalanxClientError",
        "PositionLogprobs",
        "RequestCancelledError",
        "RequestQuarantinedError",
        "RetryPolicy",
        "StreamGapError",
        "SyncClient",
        "SyncGenerateStream",
        "Tier",
        "TlsConfig",
        "TokenLogprob",
        "UnavailableError",
        "WorkerHealth",
        "WorkerInfo",
    ]
    assert all(hasattr(phalanx.client, name) for name in phalanx.client.__all__)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


RPC_METHODS = [_snake(m.name) for m in router_pb2.DESCRIPTOR.services_by_name["RouterService"].methods]


def test_both_clients_have_a_method_for_every_router_rpc():
    assert RPC_METHODS == ["generate", "resume", "cancel", "list_workers"]
    for method in RPC_METHODS:
        assert callable(getattr(Client, method)), method
        assert callable(getattr(SyncClient, method)), method


@pytest.mark.parametrize("method", [*RPC_METHODS, "complete", "connect"])
def test_sync_client_takes_the_same_arguments_as_the_async_one(method):
    def parameters(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(getattr(SyncClient, method)) == parameters(getattr(Client, method))


def test_complete_takes_the_same_arguments_as_generate():
    assert inspect.signature(Client.complete).parameters == inspect.signature(Client.generate).parameters


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


def from_router(error: domain.PhalanxError) -> grpc.aio.AioRpcError:
    """What the client receives when the router aborts with the shared table's status."""
    status = to_status(error)
    return rpc_error(status.code, status.details, status.trailing_metadata)


def test_bad_request_becomes_invalid_argument_with_violations():
    error = from_rpc_error(from_router(domain.InvalidRequestError("sampling.top_p", "must be in (0, 1]")), request_id="r-1")
    assert type(error) is InvalidArgumentError and isinstance(error, ValueError)
    assert error.violations == [("sampling.top_p", "must be in (0, 1]")]
    assert (error.code, error.reason, error.request_id, error.retryable) == (C.INVALID_ARGUMENT, "INVALID_REQUEST", "r-1", False)
    assert "r-1" in str(error) and "sampling.top_p" in error.message


@pytest.mark.parametrize(
    ("error", "kind", "reason", "retry_after_s"),
    [
        (domain.ResourceExhaustedError("queue full", retry_after_s=1.5), OverloadedError, "RESOURCE_EXHAUSTED", 1.5),
        (domain.UnavailableError("draining", retry_after_s=0.25), UnavailableError, "UNAVAILABLE", 0.25),
        (domain.EngineDeadError("engine died"), UnavailableError, "ENGINE_DEAD", None),
        (domain.PhalanxError("bug"), InternalError, "PHALANX_ERROR", None),
    ],
)
def test_router_statuses_map_back_to_typed_errors_with_retry_after(error, kind, reason, retry_after_s):
    mapped = from_rpc_error(from_router(error))
    assert type(mapped) is kind and mapped.reason == reason and mapped.message == str(error)
    assert mapped.retry_after_s == (pytest.approx(retry_after_s) if retry_after_s is not None else None)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (C.NOT_FOUND, NotFoundError),
        (C.UNAUTHENTICATED, AuthenticationError),
        (C.PERMISSION_DENIED, AuthenticationError),
        (C.DEADLINE_EXCEEDED, DeadlineExceededError),
        (C.CANCELLED, RequestCancelledError),
        (C.UNAVAILABLE, UnavailableError),
        (C.INTERNAL, InternalError),
        (C.UNKNOWN, InternalError),
        (C.UNIMPLEMENTED, InternalError),
    ],
)
def test_bare_statuses_map_to_typed_errors(code, kind):
    mapped = from_rpc_error(rpc_error(code, "boom"), request_id="r-2")
    assert type(mapped) is kind and isinstance(mapped, PhalanxClientError)
    assert (mapped.code, mapped.message, mapped.reason, mapped.request_id, mapped.retry_after_s) == (code, "boom", None, "r-2", None)


def test_a_quarantined_request_becomes_its_typed_error_with_the_fingerprint():
    error = domain.RequestQuarantinedError("it crashed 2 workers", fingerprint="ab" * 16, crashes=2, expires_in_s=599.6)
    mapped = from_rpc_error(from_router(error), request_id="r-3")
    assert type(mapped) is RequestQuarantinedError and not mapped.retryable
    assert (mapped.code, mapped.reason, mapped.fingerprint, mapped.expires_in_s) == (
        C.FAILED_PRECONDITION, "REQUEST_QUARANTINED", "ab" * 16, 600.0,
    )


def test_details_that_contradict_the_status_are_ignored():
    status = status_pb2.Status(code=C.NOT_FOUND.value[0], message="other")
    trailing = rpc_status.to_status(status).trailing_metadata
    assert type(from_rpc_error(rpc_error(C.UNAVAILABLE, "down", trailing))) is UnavailableError


def test_stream_gap_error_is_an_internal_error_with_both_indexes():
    error = StreamGapError(expected_index=3, received_index=5, request_id="r-3")
    assert isinstance(error, InternalError) and (error.expected_index, error.received_index, error.code) == (3, 5, C.DATA_LOSS)


POLICY = RetryPolicy()
OPT_IN = RetryPolicy(retry_overloaded=True)


@pytest.mark.parametrize(
    ("error", "policy", "before_first_token", "retry"),
    [
        (rpc_error(C.UNAVAILABLE, "Socket closed"), POLICY, False, True),
        (rpc_error(C.CANCELLED, "Cancelled on the server side"), POLICY, False, True),
        (rpc_error(C.INTERNAL, "Received RST_STREAM with error code 2"), POLICY, False, True),
        (rpc_error(C.UNKNOWN, "Stream removed"), POLICY, True, True),
        (from_router(domain.PhalanxError("bug")), POLICY, True, False),
        (rpc_error(C.INTERNAL, "division by zero"), POLICY, True, False),
        (rpc_error(C.RESOURCE_EXHAUSTED, "shed"), POLICY, True, False),
        (rpc_error(C.RESOURCE_EXHAUSTED, "shed"), OPT_IN, True, True),
        (rpc_error(C.RESOURCE_EXHAUSTED, "shed"), OPT_IN, False, False),
        (rpc_error(C.INVALID_ARGUMENT, "bad"), OPT_IN, True, False),
        (rpc_error(C.NOT_FOUND, "gone"), OPT_IN, False, False),
        (rpc_error(C.UNAUTHENTICATED, "who"), OPT_IN, True, False),
        (rpc_error(C.PERMISSION_DENIED, "no"), OPT_IN, True, False),
        (rpc_error(C.DEADLINE_EXCEEDED, "late"), OPT_IN, True, False),
    ],
)
def test_which_broken_calls_are_retried(error, policy, before_first_token, retry):
    assert is_retryable(error, policy, before_first_token=before_first_token) is retry


def test_backoff_grows_exponentially_to_the_cap_with_bounded_jitter():
    policy = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=2.0, multiplier=2.0, jitter=0.0)
    assert [policy.backoff_s(n) for n in range(1, 9)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    jittered = RetryPolicy(jitter=0.2)
    rng = random.Random(7)
    delays = [jittered.backoff_s(3, rng=rng) for _ in range(200)]
    assert all(0.16 <= d <= 0.2 for d in delays) and len(set(delays)) > 100


@pytest.mark.parametrize(
    "kwargs", [{"max_attempts": 0}, {"initial_backoff_s": 0}, {"initial_backoff_s": 3.0}, {"multiplier": 0.5}, {"jitter": 1.0}]
)
def test_retry_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def request(prompt="hi", *, media=(), **overrides):
    args = dict(max_tokens=4, temperature=0.0, top_k=0, top_p=1.0, stop=(), stop_token_ids=(), seed=None, ignore_eos=False, tier=None, tenant=None)
    return build_request(prompt, GenerateOptions(**{**args, **overrides}), request_id="r", media=media)


def test_requests_carry_text_or_token_prompts_and_sampling():
    assert request("hi").text == "hi" and not request("hi").sampling.HasField("seed")
    tokens = request([1, 2, 3], seed=0, stop="END", stop_token_ids=[7], tier=Tier.BEST_EFFORT, tenant="acme")
    assert list(tokens.tokens.ids) == [1, 2, 3] and tokens.sampling.HasField("seed") and tokens.sampling.seed == 0
    assert list(tokens.sampling.stop_strings) == ["END"] and list(tokens.sampling.stop_token_ids) == [7]
    assert (tokens.tier, tokens.tenant) == (router_pb2.TIER_BEST_EFFORT, "acme")
    assert request(tier="premium").tier == router_pb2.TIER_PREMIUM and request().tier == router_pb2.TIER_UNSPECIFIED


def test_requests_carry_media_in_order_with_their_kind(tmp_path):
    (tmp_path / "cat.PNG").write_bytes(b"png bytes")
    (tmp_path / "clip.wav").write_bytes(b"wav bytes")
    media = [Media.from_file(tmp_path / "cat.PNG"), Media.from_file(tmp_path / "clip.wav"), Media("video", b"avi bytes")]
    built = request("a <media> b <media> c <media>", media=media)
    assert [(m.kind, m.data) for m in built.media] == [
        (router_pb2.MEDIA_KIND_IMAGE, b"png bytes"), (router_pb2.MEDIA_KIND_AUDIO, b"wav bytes"), (router_pb2.MEDIA_KIND_VIDEO, b"avi bytes"),
    ]
    assert not request("no media").media
    with pytest.raises(ValueError, match="kind"):
        Media("gif", b"")
    (tmp_path / "notes.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="pass kind"):
        Media.from_file(tmp_path / "notes.txt")
    assert Media.from_file(tmp_path / "notes.txt", kind="image").kind == "image"


@pytest.mark.parametrize(("prompt", "tier", "field"), [("hi", "gold", "tier"), ([1, "2"], None, "prompt"), (b"hi", None, "prompt")])
def test_malformed_requests_are_refused_before_any_call(prompt, tier, field):
    with pytest.raises(InvalidArgumentError) as caught:
        request(prompt, tier=tier)
    assert [f for f, _ in caught.value.violations] == [field]


def test_generate_options_take_every_generate_keyword_and_normalise_stop_and_tier():
    assert set(GenerateParams.__annotations__) == {f for f in GenerateOptions.__dataclass_fields__}
    options = GenerateOptions(stop="END", stop_token_ids=[7], tier="premium")
    assert (options.stop, options.stop_token_ids, options.tier) == (("END",), (7,), Tier.PREMIUM)
    assert options == GenerateOptions(stop=["END"], stop_token_ids=(7,), tier=Tier.PREMIUM) and hash(options) == hash(options)
    with pytest.raises(TypeError):
        GenerateOptions(64)  # keyword-only: a bare number could be any of the fields


@pytest.mark.parametrize(
    ("field", "value", "violation"),
    [
        ("max_tokens", 0, "sampling.max_tokens"),
        ("max_tokens", 2**31, "sampling.max_tokens"),
        ("temperature", -0.5, "sampling.temperature"),
        ("temperature", float("nan"), "sampling.temperature"),
        ("top_k", -1, "sampling.top_k"),
        ("top_p", 1.5, "sampling.top_p"),
        ("stop_token_ids", [3, -1], "sampling.stop_token_ids"),
        ("seed", -1, "sampling.seed"),
        ("tier", "gold", "tier"),
        ("top_logprobs", 21, "sampling.top_logprobs"),
        ("top_logprobs", -1, "sampling.top_logprobs"),
        ("top_logprobs", 3, "sampling.top_logprobs"),  # without logprobs=True
        ("prompt_logprobs", True, "sampling.prompt_logprobs"),  # without logprobs=True
    ],
)
def test_generate_options_refuse_what_cannot_be_sent_naming_the_routers_field(field, value, violation):
    with pytest.raises(InvalidArgumentError) as caught:
        GenerateOptions(**{field: value})
    assert [f for f, _ in caught.value.violations] == [violation]


def test_generate_options_leave_the_deployments_limits_to_the_router():
    options = GenerateOptions(max_tokens=2**31 - 1, temperature=250.0, top_p=0.0, seed=2**64 - 1, stop_token_ids=[2**31 - 1])
    sampling = build_request("hi", options, request_id="r").sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (2**31 - 1, 250.0, 0.0, 2**64 - 1)


async def test_generate_takes_options_and_keyword_arguments_override_them():
    calls = [ScriptedCall([0], last=0) for _ in range(3)]
    client = scripted_client(*calls)
    options = GenerateOptions(max_tokens=9, temperature=0.5, stop="x", tier="premium", tenant="acme")
    await client.complete("hi", options=options)
    await client.complete("hi", options=options, max_tokens=3, tier=None)
    await client.complete("hi", max_tokens=9, temperature=0.5, stop="x", tier="premium", tenant="acme")
    sent = client._stub.requests
    assert sent[0].sampling == sent[2].sampling and (sent[0].tier, sent[0].tenant) == (sent[2].tier, sent[2].tenant)
    assert (sent[1].sampling.max_tokens, sent[1].sampling.temperature, sent[1].tier) == (3, 0.5, router_pb2.TIER_UNSPECIFIED)
    assert (sent[0].sampling.max_tokens, list(sent[0].sampling.stop_strings), sent[0].tier) == (9, ["x"], router_pb2.TIER_PREMIUM)
    assert options.max_tokens == 9  # the caller's value is left as it was


def test_generate_refuses_unknown_keywords_before_any_call():
    client = scripted_client()
    with pytest.raises(TypeError):
        client.generate("hi", max_token=4)
    assert client._stub.sent == []


def test_channel_config_round_robins_and_retries_only_idempotent_unary_calls():
    tls = TlsConfig(server_name_override="r.test")
    options = dict(_channel.channel_options(RetryPolicy(max_attempts=8), tls, [("grpc.max_receive_message_length", 1)]))
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    [method_config] = config["methodConfig"]
    assert {n["method"] for n in method_config["name"]} == {"Cancel", "ListWorkers"}
    assert method_config["retryPolicy"]["maxAttempts"] == 5 and method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert options["grpc.initial_reconnect_backoff_ms"] <= 100 and options["grpc.max_reconnect_backoff_ms"] <= 2000
    assert options["grpc.keepalive_time_ms"] > 0 and options["grpc.ssl_target_name_override"] == "r.test"
    assert options["grpc.max_receive_message_length"] == 1  # the caller's options win
    assert "methodConfig" not in json.loads(_channel.service_config(RetryPolicy(max_attempts=1)))


def test_call_metadata_carries_the_api_key(monkeypatch):
    monkeypatch.setattr(_channel, "_inject", False)  # as without opentelemetry installed
    assert _channel.call_metadata("sekrit") == (("authorization", "Bearer sekrit"),)
    assert _channel.call_metadata(None) == ()


# The stream's exactly-once logic against a scripted stub: no network.


def response(index, *, last=False, worker_id=""):
    return router_pb2.GenerateResponse(
        request_id="r", token_id=100 + index, text=f"<{index}>", index=index, finish_reason=1 if last else 0, worker_id=worker_id
    )


class ScriptedCall:
    def __init__(self, indexes, *, last=None, error=None):
        self.responses = [response(i, last=i == last, worker_id="w-a" if n == 0 else "") for n, i in enumerate(indexes)]
        self.error = error
        self.cancelled = False

    async def __aiter__(self):
        for item in self.responses:
            yield item
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class ScriptedStub:
    def __init__(self, *calls):
        self.calls = list(calls)
        self.sent = []
        self.requests = []
        self.cancels = []

    def Generate(self, request, *, timeout, metadata):
        self.sent.append(("Generate", request.request_id, 0, dict(metadata)))
        self.requests.append(request)
        return self.calls.pop(0)

    def Resume(self, request, *, timeout, metadata):
        self.sent.append(("Resume", request.request_id, request.tokens_received, dict(metadata)))
        return self.calls.pop(0)

    async def Cancel(self, request, *, timeout, metadata):
        self.cancels.append(request.request_id)
        return router_pb2.CancelResponse(cancelled=True)


def scripted_client(*calls, retry=RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.001)):  # noqa: B008 - RetryPolicy is frozen, so one shared default is safe
    return Client(None, ScriptedStub(*calls), api_key="k", timeout=None, retry=retry)


BROKEN = rpc_error(C.UNAVAILABLE, "Socket closed")


async def test_stream_drops_repeated_indexes_and_resumes_where_it_stopped():
    calls = [ScriptedCall([0, 1], error=BROKEN), ScriptedCall([0, 1, 2, 3], error=BROKEN), ScriptedCall([3, 4], last=4)]
    client = scripted_client(*calls)
    completion = await client.complete("hi", request_id="r")
    assert completion == Completion("r", "<0><1><2><3><4>", (100, 101, 102, 103, 104), FinishReason.LENGTH, 0, 0, 0, resumes=2)
    assert [(rpc, start) for rpc, _, start, _ in client._stub.sent] == [("Generate", 0), ("Resume", 2), ("Resume", 4)]
    assert all(md["authorization"] == "Bearer k" for *_, md in client._stub.sent)
    assert all(call.cancelled for call in calls)  # each call released; the request finished, so no Cancel
    assert client._stub.cancels == []


async def test_stream_raises_on_a_gap_instead_of_skipping_and_cancels_the_request():
    client = scripted_client(ScriptedCall([0, 1], error=BROKEN), ScriptedCall([3, 4], last=4))
    got = []
    with pytest.raises(StreamGapError) as caught:
        async for chunk in client.generate("hi", request_id="r"):
            got.append(chunk.index)
    assert got == [0, 1] and (caught.value.expected_index, caught.value.received_index) == (2, 3)
    await client.close()  # waits for the background Cancel
    assert client._stub.cancels == ["r"]


async def test_worker_id_is_carried_forward_to_every_chunk():
    client = scripted_client(ScriptedCall([0, 1, 2], last=2))
    assert [c.worker_id for c in [chunk async for chunk in client.generate("hi")]] == ["w-a"] * 3


async def test_a_stream_ending_without_a_final_token_is_resumed():
    client = scripted_client(ScriptedCall([0]), ScriptedCall([1], last=1))
    assert (await client.complete("hi")).resumes == 1


async def test_retry_info_longer_than_the_deadline_ends_the_stream_at_once():
    slow = from_router(domain.UnavailableError("draining", retry_after_s=30.0))
    client = scripted_client(ScriptedCall([], error=slow))
    with pytest.raises(UnavailableError) as caught:
        await client.complete("hi", timeout=1.0)
    assert caught.value.retry_after_s == 30.0 and len(client._stub.sent) == 1


async def test_a_request_this_client_cancelled_is_not_resumed():
    client = scripted_client(ScriptedCall([0], error=rpc_error(C.CANCELLED, "cancelled")))
    stream = client.generate("hi", request_id="r")
    await anext(stream)
    assert await client.cancel("r") is True
    with pytest.raises(RequestCancelledError):
        await anext(stream)
    assert client._stub.cancels == ["r"]  # the caller's own; none added on the way out


class RecordingTransport:
    """A GenerateStream's whole view of its client (StreamTransport), scripted."""

    def __init__(self, *calls, cancelled=()):
        self.calls = list(calls)
        self.opened = []
        self.log = []
        self.cancelled = set(cancelled)

    def generate(self, request, *, timeout):
        self.opened.append(("generate", request.request_id, 0))
        return self.calls.pop(0)

    def resume(self, request_id, tokens_received, *, timeout):
        self.opened.append(("resume", request_id, tokens_received))
        return self.calls.pop(0)

    def cancelled_by_caller(self, request_id):
        return request_id in self.cancelled

    def stream_opened(self, stream):
        self.log.append(("opened", stream.request_id))

    def stream_closed(self, stream, *, finished):
        self.log.append(("closed", stream.request_id, finished))

    def drop_wrong_peer(self, error):
        self.log.append(("wrong peer", error.code()))


FAST = RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.001)


async def test_a_stream_opens_resumes_and_closes_through_its_transport_alone():
    transport = RecordingTransport(ScriptedCall([0, 1], error=BROKEN), ScriptedCall([2], last=2))
    stream = GenerateStream(transport, retry=FAST, request_id="r", request=request(), start_index=0, timeout=None)
    assert [chunk.index async for chunk in stream] == [0, 1, 2]
    assert transport.opened == [("generate", "r", 0), ("resume", "r", 2)]
    assert transport.log == [("opened", "r"), ("closed", "r", True)]


async def test_a_stream_left_unfinished_or_cancelled_by_its_caller_tells_its_transport():
    transport = RecordingTransport(ScriptedCall([5, 6, 7], last=7))
    stream = GenerateStream(transport, retry=FAST, request_id="r", request=None, start_index=5, timeout=None)
    assert (await anext(stream)).index == 5
    await stream.aclose()
    assert transport.opened == [("resume", "r", 5)] and transport.log == [("opened", "r"), ("closed", "r", False)]
    cancelled = RecordingTransport(ScriptedCall([0], error=rpc_error(C.CANCELLED, "cancelled")), cancelled={"r"})
    with pytest.raises(RequestCancelledError):
        [chunk async for chunk in GenerateStream(cancelled, retry=FAST, request_id="r", request=request(), start_index=0, timeout=None)]
    assert cancelled.opened == [("generate", "r", 0)]  # not resumed


async def test_a_detached_stream_closes_unfinished_without_cancelling_its_request():
    transport = RecordingTransport(ScriptedCall([5, 6, 7], last=7))
    stream = GenerateStream(transport, retry=FAST, request_id="r", request=None, start_index=5, timeout=None)
    assert (await anext(stream)).index == 5
    stream.detach()  # another process resumes the request
    await stream.aclose()
    assert transport.log == [("opened", "r"), ("closed", "r", True)]  # "finished": nothing to cancel


# A call that reached another service at a router's address (a checkpoint store given the router's old IP).
WRONG_PEER = rpc_error(C.UNIMPLEMENTED, "Method not found!")


async def test_a_wrong_peer_is_dropped_then_the_generate_is_sent_again_or_the_stream_resumed():
    transport = RecordingTransport(
        ScriptedCall([], error=WRONG_PEER), ScriptedCall([0, 1], error=BROKEN), ScriptedCall([], error=WRONG_PEER),
        ScriptedCall([2], last=2),
    )
    stream = GenerateStream(transport, retry=FAST, request_id="r", request=request(), start_index=0, timeout=None)
    started = time.monotonic()
    assert [chunk.index async for chunk in stream] == [0, 1, 2]
    assert time.monotonic() - started < 0.5  # paced by the backoff, not by the retry hint meant for the caller
    assert transport.opened == [("generate", "r", 0), ("generate", "r", 0), ("resume", "r", 2), ("resume", "r", 2)]
    assert transport.log == [("opened", "r"), ("wrong peer", C.UNIMPLEMENTED), ("wrong peer", C.UNIMPLEMENTED), ("closed", "r", True)]


async def test_a_stream_that_only_meets_wrong_peers_fails_unavailable_with_a_retry_hint():
    transport = RecordingTransport(*(ScriptedCall([], error=WRONG_PEER) for _ in range(3)))
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.001)
    with pytest.raises(UnavailableError) as caught:
        [chunk async for chunk in GenerateStream(transport, retry=retry, request_id="r", request=request(), start_index=0, timeout=None)]
    assert (caught.value.code, caught.value.reason, caught.value.retry_after_s) == (C.UNAVAILABLE, "WRONG_PEER", 1.0)
    assert len(transport.opened) == 3 and transport.log.count(("wrong peer", C.UNIMPLEMENTED)) == 3


class FakeChannel:
    def __init__(self):
        self.closed = False

    async def close(self, grace=None):
        self.closed = True


class UnaryStub:
    def __init__(self, error=None):
        self.error = error
        self.calls = 0

    async def ListWorkers(self, request, *, timeout, metadata):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return router_pb2.ListWorkersResponse()


async def test_a_wrong_peer_reopens_the_channel_once_a_burst_and_unary_calls_retry_on_the_fresh_one():
    first, second, wrong, right = FakeChannel(), FakeChannel(), UnaryStub(error=WRONG_PEER), UnaryStub()
    fresh = [(second, right)]
    client = Client(first, wrong, api_key=None, timeout=None, retry=FAST, reopen=lambda: fresh.pop(0))
    assert await client.list_workers() == []
    assert (wrong.calls, right.calls, client.wrong_peers) == (1, 1, 1)
    client._transport.drop_wrong_peer(WRONG_PEER)  # a second call of the same burst: no channel opened (none is left to open)
    assert client.wrong_peers == 2 and not first.closed  # calls still on the old channel get their grace
    started = time.monotonic()
    await client.close()
    assert first.closed and second.closed and time.monotonic() - started < REOPEN_INTERVAL_S


async def test_unary_calls_that_only_meet_wrong_peers_fail_unavailable_with_a_retry_hint():
    wrong = UnaryStub(error=WRONG_PEER)
    client = Client(None, wrong, api_key=None, timeout=None, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.001))
    with pytest.raises(UnavailableError) as caught:
        await client.list_workers()
    assert (caught.value.reason, caught.value.retry_after_s, wrong.calls, client.wrong_peers) == ("WRONG_PEER", 1.0, 2, 2)
