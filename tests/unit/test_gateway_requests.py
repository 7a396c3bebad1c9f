"""The gateway's pure logic: OpenAI bodies parsed and mapped to SDK calls, keys and tiers, errors and response shapes."""

from __future__ import annotations

import base64
import json

import grpc
import pytest

from phalanx.client import (
    AuthenticationError as ClientAuthenticationError,
    FinishReason,
    GenerateOptions,
    InvalidArgumentError,
    OverloadedError,
    RequestQuarantinedError,
    UnavailableError,
)
from phalanx.client._errors import wrong_peer_error
from phalanx.gateway.auth import Caller, KeyRing
from phalanx.gateway.config import GatewayConfig
from phalanx.gateway.errors import GatewayError, from_client_error
from phalanx.gateway.responses import CHAT, COMPLETIONS, finish_reason
from phalanx.gateway.schema import MEDIA_MARKER, ChatCompletionRequest, CompletionRequest, chat_text, parse_body
from phalanx.gateway.server import GatewayServer
from phalanx.model.chat import ChatPrompts
from phalanx.router.admission import Tier
from phalanx.router.config import TenantPolicy

pytestmark = pytest.mark.unit


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "Hello", **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


def refused(model, body: bytes, **kwargs) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        parsed = parse_body(model, body)
        parsed.generate_args(**kwargs) if model is CompletionRequest else parsed.generate_args("p", default_max_tokens=10)
    return caught.value


# -- parsing and mapping -----------------------------------------------------------------------
def test_a_completion_maps_onto_the_sdk_call_with_openai_defaults():
    args = parse_body(CompletionRequest, completion()).generate_args()
    # OpenAI: 16 tokens and temperature 1 unless the request says otherwise.
    assert args.options == GenerateOptions(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, stop=(), seed=None, ignore_eos=False)
    assert args.media == ()
    assert args.prompt == "Hello"


def test_sampling_parameters_pass_through():
    args = parse_body(CompletionRequest, completion(max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n", top_k=4)).generate_args()
    options = args.options
    assert (options.max_tokens, options.temperature, options.top_p, options.seed, options.stop, options.top_k) == (7, 0.0, 0.5, 3, ("\n",), 4)
    assert parse_body(CompletionRequest, completion(stop=["a", "b"])).generate_args().options.stop == ("a", "b")


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("text", "text"), (["text"], "text"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_one_prompt_as_text_or_token_ids(prompt, expected):
    assert parse_body(CompletionRequest, completion(prompt=prompt)).generate_args().prompt == expected


def test_several_prompts_are_refused_naming_prompt():
    error = refused(CompletionRequest, completion(prompt=["a", "b"]))
    assert (error.status, error.param) == (400, "prompt")
    assert "one prompt per request" in error.message


def test_chat_takes_max_completion_tokens_and_a_configured_default():
    assert parse_body(ChatCompletionRequest, chat(max_completion_tokens=5)).generate_args("p", default_max_tokens=99).options.max_tokens == 5
    assert parse_body(ChatCompletionRequest, chat(max_tokens=6)).generate_args("p", default_max_tokens=99).options.max_tokens == 6
    assert parse_body(ChatCompletionRequest, chat()).generate_args("p", default_max_tokens=99).options.max_tokens == 99


def test_chat_text_parts_are_joined_and_other_parts_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parsed = parse_body(ChatCompletionRequest, chat(messages=[{"role": "user", "content": parts}]))
    assert parsed.template_messages() == [{"role": "user", "content": "ab"}]
    parsed = parse_body(ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "file", "file": {}}]}]))
    with pytest.raises(GatewayError) as caught:
        parsed.template_messages()
    assert caught.value.param == "messages[0].content[0]"


def test_chat_image_and_audio_parts_become_media_at_their_place():
    png, wav = b"\x89PNG fake", b"RIFF fake"
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": " with "},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
    ]
    parsed = parse_body(ChatCompletionRequest, chat(messages=[{"role": "user", "content": parts}]))
    assert parsed.template_messages() == [{"role": "user", "content": f"Compare {MEDIA_MARKER} with {MEDIA_MARKER}"}]
    args = parsed.generate_args("rendered", default_max_tokens=8)
    assert [(m.kind, m.data) for m in args.media] == [("image", png), ("audio", wav)]
    client = RecordingClient()
    GatewayServer(GatewayConfig(), clients=None, metrics=None)._open(client, Caller("acme", None, None), args, "r-1")
    assert client.calls == [("rendered", {"options": args.options, "media": args.media, "tier": None, "tenant": "acme", "request_id": "r-1"})]


class RecordingClient:
    def __init__(self):
        self.calls = []

    def generate(self, prompt, **kwargs):
        self.calls.append((prompt, kwargs))


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "messages[0].content[0].image_url.url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "messages[0].content[0].image_url.url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "messages[0].content[0].image_url.url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, "messages[0].content[0].input_audio"),
    ],
    ids=["http-url", "not-base64-url", "bad-base64", "mp3"],
)
def test_chat_media_parts_the_gateway_cannot_take_are_refused_by_name(part, param):
    parsed = parse_body(ChatCompletionRequest, chat(messages=[{"role": "user", "content": [part]}]))
    with pytest.raises(GatewayError) as caught:
        parsed.template_messages()
    assert (caught.value.status, caught.value.param) == (400, param)


def test_stream_options_include_usage_only_with_stream():
    assert parse_body(CompletionRequest, completion(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse_body(CompletionRequest, completion(stream=True)).include_usage
    assert refused(CompletionRequest, completion(stream_options={"include_usage": True})).param == "stream_options"


# -- what is refused, by name ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"model": ""}, "model"),
    ],
)
def test_a_bad_completion_parameter_is_a_400_naming_it(fields, param):
    error = refused(CompletionRequest, completion(**fields))
    assert (error.status, error.param, error.kind) == (400, param, "invalid_request_error")
    assert error.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ],
)
def test_a_bad_chat_parameter_is_a_400_naming_it(fields, param):
    error = refused(ChatCompletionRequest, chat(**fields))
    assert (error.status, error.param) == (400, param)


def test_top_logprobs_without_logprobs_is_refused_saying_why():
    assert "needs logprobs: true" in refused(ChatCompletionRequest, chat(top_logprobs=1)).message


def test_a_missing_parameter_says_it_is_required():
    error = refused(CompletionRequest, json.dumps({"model": "m"}).encode())
    assert (error.param, error.code, error.message) == ("prompt", "missing_required_parameter", "prompt: is required")


def test_a_union_parameter_lists_the_shapes_it_takes():
    error = refused(CompletionRequest, completion(prompt={"x": 1}))
    assert error.message == "prompt: has the wrong type; expected one of: str, list[str], list[int], list[list[int]]"


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]"])
def test_a_body_that_is_not_a_json_object_is_a_400(body):
    error = refused(CompletionRequest, body)
    assert (error.status, error.param, error.code) == (400, None, "invalid_json")


def test_unknown_fields_are_ignored():
    assert parse_body(CompletionRequest, completion(store=False, service_tier="auto")).generate_args().prompt == "Hello"


# -- chat prompts -------------------------------------------------------------------------------------
def test_a_templates_leading_bos_text_is_left_to_the_routers_tokenizer():
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    assert chat_text(messages, ChatPrompts(template, bos_token="<s>", eos_token="</s>", adds_bos=True)) == "[user] hi</s>"
    assert chat_text(messages, ChatPrompts(template, bos_token="<s>", eos_token="</s>", adds_bos=False)) == "<s>[user] hi</s>"


def test_a_bad_role_is_a_400_naming_the_message():
    with pytest.raises(GatewayError) as caught:
        chat_text([{"role": "wizard", "content": "x"}], ChatPrompts(None))
    assert (caught.value.status, caught.value.param) == (400, "messages[0].role")


# -- keys and tiers ------------------------------------------------------------------------------------------
TENANTS = {
    "default": TenantPolicy(),
    "batch": TenantPolicy(default_tier="best_effort", max_tier="standard"),
}


def test_an_open_gateway_leaves_tenant_and_tier_to_the_router_and_forwards_its_router_key():
    caller = KeyRing(TENANTS, {}, router_api_key="svc").admit(None)
    assert (caller.tenant, caller.tier, caller.api_key) == (None, None, "svc")
    with pytest.raises(GatewayError):
        KeyRing({"default": TenantPolicy(max_tier="standard")}, {}).admit(None, header_tier="premium")  # the default tenant's policy


def test_keys_map_to_tenants_and_missing_or_unknown_keys_are_401():
    ring = KeyRing(TENANTS, {"k1": "default", "k2": "batch"})
    assert ring.admit("Bearer k2").tenant == "batch"
    assert ring.admit("bearer  k1 ").api_key == "k1"
    for header in (None, "", "Bearer", "Basic k1", "Bearer nope"):
        with pytest.raises(GatewayError) as caught:
            ring.admit(header)
        assert (caught.value.status, caught.value.kind) == (401, "authentication_error")


def test_a_request_may_lower_its_tier_but_never_raise_it():
    ring = KeyRing(TENANTS, {"k": "batch"})
    assert ring.admit("Bearer k").tier is None  # the router applies the tenant's default
    assert ring.admit("Bearer k", header_tier="standard").tier == Tier.STANDARD
    assert ring.admit("Bearer k", metadata_tier="best_effort").tier == Tier.BEST_EFFORT
    with pytest.raises(GatewayError) as caught:
        ring.admit("Bearer k", header_tier="premium")
    assert (caught.value.status, caught.value.param) == (400, "x-phalanx-tier")
    with pytest.raises(GatewayError) as caught:
        ring.admit("Bearer k", metadata_tier="gold")
    assert (caught.value.status, caught.value.param) == (400, "metadata.tier")


def test_the_header_tier_wins_over_metadata():
    assert KeyRing(TENANTS, {}).admit(None, header_tier="best_effort", metadata_tier="premium").tier == Tier.BEST_EFFORT


def test_config_refuses_keys_of_unknown_tenants_and_inverted_policies():
    with pytest.raises(ValueError, match="unknown tenants"):
        GatewayConfig(api_keys={"k": "ghost"})
    with pytest.raises(ValueError, match="default_tier is above max_tier"):
        GatewayConfig(tenants={"t": TenantPolicy(default_tier="premium", max_tier="standard")})
    with pytest.raises(ValueError, match="router_api_key"):
        GatewayConfig(api_keys={"k": "default"}, router_api_key="svc")


# -- SDK errors -> HTTP ----------------------------------------------------------------------------------------
def test_router_field_violations_name_the_openai_parameter():
    error = from_client_error(InvalidArgumentError("too long", violations=[("sampling.max_tokens", "exceeds the context")]))
    assert (error.status, error.param, error.message) == (400, "max_tokens", "max_tokens: exceeds the context")
    chat_error = from_client_error(InvalidArgumentError("bad", violations=[("prompt", "must not be empty")]), prompt_param="messages")
    assert chat_error.param == "messages"


def test_shed_and_unavailable_carry_retry_after():
    shed = from_client_error(OverloadedError("shed", code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_s=1.5))
    assert (shed.status, shed.headers()) == (429, {"Retry-After": "2", "retry-after-ms": "1500"})
    down = from_client_error(UnavailableError("no worker", code=grpc.StatusCode.UNAVAILABLE, retry_after_s=0.2))
    assert (down.status, down.headers()["Retry-After"]) == (503, "1")
    wrong_peer = from_client_error(wrong_peer_error(grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, None, None, "Method not found!")))
    assert (wrong_peer.status, wrong_peer.code, wrong_peer.headers()["Retry-After"]) == (503, "unavailable", "1")
    unauthenticated = from_client_error(ClientAuthenticationError("bad key", code=grpc.StatusCode.UNAUTHENTICATED))
    assert unauthenticated.status == 401


def test_a_quarantined_request_is_a_422_with_its_own_code_and_no_retry_after():
    error = from_client_error(
        RequestQuarantinedError("crashed 2 workers", code=grpc.StatusCode.FAILED_PRECONDITION, fingerprint="f" * 32, expires_in_s=600.0)
    )
    assert (error.status, error.body()["error"]["code"], error.body()["error"]["type"]) == (422, "request_quarantined", "invalid_request_error")
    assert "Retry-After" not in error.headers()


def test_errors_have_openais_shape():
    body = GatewayError(400, "temperature: too hot", kind="invalid_request_error", param="temperature", code="invalid_value").body()
    assert body == {"error": {"message": "temperature: too hot", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}


# -- response shapes --------------------------------------------------------------------------------------------
def test_finish_reasons_are_stop_and_length_only():
    assert (finish_reason(FinishReason.STOP), finish_reason(FinishReason.LENGTH)) == ("stop", "length")
    assert finish_reason(FinishReason.ABORTED) is None and finish_reason(None) is None


def test_completion_and_chat_bodies():
    common = {"request_id": "r", "created": 1, "model": "m", "text": "hi", "finish": "length", "prompt_tokens": 3, "completion_tokens": 2}
    completion_body = COMPLETIONS.response(**common)
    assert completion_body["id"] == "cmpl-r" and completion_body["object"] == "text_completion"
    assert completion_body["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}]
    assert completion_body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat_body = CHAT.response(**common)
    assert chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_chat_chunks_open_with_the_role_and_usage_comes_last():
    common = {"request_id": "r", "created": 1, "model": "m"}
    first = CHAT.chunk(**common, text="a", finish=None, first=True, include_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"} and first["usage"] is None
    last = CHAT.chunk(**common, text="", finish="stop", first=False, include_usage=False)
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"} and "usage" not in last
    tail = CHAT.usage_chunk(**common, prompt_tokens=1, completion_tokens=2)
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 3


def test_logprob_parameters_map_onto_the_sdk_options():
    args = parse_body(CompletionRequest, completion(logprobs=2, echo=True)).generate_args()
    assert (args.options.logprobs, args.options.top_logprobs, args.options.prompt_logprobs, args.top_logprobs, args.echo) == (True, 2, True, 2, True)
    # Echoing a text prompt needs nothing from the engine; echoing token ids needs their bytes, hence their logprobs.
    text_echo = parse_body(CompletionRequest, completion(echo=True)).generate_args()
    assert (text_echo.options.logprobs, text_echo.options.prompt_logprobs, text_echo.top_logprobs) == (False, False, None)
    ids_echo = parse_body(CompletionRequest, completion(prompt=[1, 2, 3], echo=True)).generate_args()
    assert (ids_echo.options.prompt_logprobs, ids_echo.top_logprobs) == (True, None)
    plain = parse_body(CompletionRequest, completion(logprobs=0)).generate_args()
    assert (plain.options.logprobs, plain.options.top_logprobs, plain.options.prompt_logprobs) == (True, 0, False)
    chatted = parse_body(ChatCompletionRequest, chat(logprobs=True, top_logprobs=3)).generate_args("p", default_max_tokens=8)
    assert (chatted.options.logprobs, chatted.options.top_logprobs, chatted.options.prompt_logprobs, chatted.top_logprobs) == (True, 3, False, 3)
    assert parse_body(ChatCompletionRequest, chat(logprobs=False)).generate_args("p", default_max_tokens=8).top_logprobs is None


def test_logprobs_take_each_endpoints_shape():
    from phalanx.client import PositionLogprobs, TokenLogprob
    from phalanx.gateway.responses import LogprobsShape

    first = PositionLogprobs(TokenLogprob(1, None, b"Hi"))
    second = PositionLogprobs(TokenLogprob(2, -0.5, b" there"), (TokenLogprob(2, -0.5, b" there"), TokenLogprob(3, -1.5, b"\xe2\x80")))
    legacy = LogprobsShape(chat=False)
    assert legacy.part([first, second]) == {
        "tokens": ["Hi", " there"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {" there": -0.5, "bytes:\\xe2\\x80": -1.5}],
        "text_offset": [0, 2],
    }
    assert legacy.part([second])["text_offset"] == [8]  # carried from part to part
    (entry,) = LogprobsShape(chat=True).part([second])["content"]
    assert entry == {
        "token": " there", "logprob": -0.5, "bytes": list(b" there"),
        "top_logprobs": [
            {"token": " there", "logprob": -0.5, "bytes": list(b" there")}, {"token": "bytes:\\xe2\\x80", "logprob": -1.5, "bytes": [226, 128]},
        ],
    }
