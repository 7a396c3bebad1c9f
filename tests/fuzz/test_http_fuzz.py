"""The OpenAI-compatible gateway's HTTP API fed hostile bodies, headers, routes and methods.

Every answer must have a status of docs/gateway.md's table (never 500, never
no answer), an error must be OpenAI's JSON shape with a readable, bounded
``error.message``, and after each test's examples the gateway is alive, its
/health says ok and a normal completion still gets its tokens.
"""

from __future__ import annotations

import json
import math
import random

import httpx
import pytest
from fuzzing import MODEL, FuzzStack
from hypothesis import given, settings, strategies as st

pytestmark = pytest.mark.integration

# docs/gateway.md, "Errors" (405: a known route with another method). 200 for what is a valid request after all.
DOCUMENTED = {200, 400, 401, 404, 405, 413, 429, 503}
# Longer than any refusal takes; a valid request draws max_tokens of 1-2 (or reads a stream's first events only).
TIMEOUT_S = 30.0
MAX_ERROR_BODY = 4096
BODY_LIMIT = 4 * 1024 * 1024
STREAM_READ_LIMIT = 4096  # bytes of a 200 stream read before the client leaves

_big = "a" * 70_000
_scalars = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**32, 2**63, -(2**63), 10**30, -(10**30)]),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.5, 1e308, -1e-308, 3.0]),
    st.sampled_from(["", "phalanx-tiny-moe", "gpt-4", "\x00", "🦀" * 50, _big, "true", "1", "<media>", "{{ raise_exception('x') }}"]),
    st.text(max_size=12),
)
_hostile = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=8)
_models = st.sampled_from([MODEL, MODEL, "", "bogus-model", MODEL.upper(), f"{MODEL}\x00", "m" * 100_000]) | _hostile
_max_tokens = st.sampled_from([1, 2]) | _hostile.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and 2 < v < 2**31))
_png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
_image_urls = st.sampled_from([
    "data:image/png;base64," + _png, "data:image/png;base64,!!!not base64", "data:image/png," + _png, "data:;base64,",
    "data:image/png;base64," + "A" * 1001, "https://example.com/cat.png", "file:///etc/passwd", "", "data:", "data:image/png;base64,=",
    "data:image/png;base64," + _png[:-3],
]) | _hostile
_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | _hostile}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _image_urls}) | _hostile}),
    st.fixed_dictionaries({"type": st.just("input_audio"),
                           "input_audio": st.fixed_dictionaries({"data": st.just("UklGRg==") | _hostile, "format": st.just("wav") | _hostile})
                           | _hostile}),
    st.dictionaries(st.text(max_size=6), _hostile, max_size=3),
    _hostile,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "", "ROOT"]) | _hostile},
        optional={"content": st.text(max_size=30) | st.lists(_parts, max_size=3) | _hostile, "name": _hostile},
    ) | _hostile,
    max_size=4,
) | _hostile
_stream = st.sampled_from([True, False, "true", 1, 0, None, "yes"]) | _hostile
_prompts = st.sampled_from(["hello", "", [1, 2, 3], [[1, 2]], ["a", "b"], [], [-1], [2**31], [10**30], [[]], [["x"]]]) | _hostile

_COMMON = {
    "temperature": _hostile | st.sampled_from([0, 0.0, 2, 2.0001]), "top_p": _hostile, "top_k": _hostile, "seed": _hostile,
    "stop": _hostile | st.lists(st.text(max_size=3), max_size=20), "n": _hostile, "stream_options": _hostile | st.just({"include_usage": True}),
    "presence_penalty": _hostile, "frequency_penalty": _hostile, "logit_bias": _hostile, "user": _hostile,
    "metadata": _hostile | st.fixed_dictionaries({"tier": st.sampled_from(["premium", "standard", "best_effort", "gold", ""]) | _hostile}),
    "ignore_eos": _hostile, "logprobs": _hostile, "response_format": _hostile, "unknown_field": _hostile,
}


def _body(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    """Objects with every required field present (each plausible or hostile) and any of the optional ones."""
    return st.fixed_dictionaries(required, optional={**_COMMON, **optional})


_DROP = object()  # a near-valid body's field removed
_numbers = st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1,
                            math.nan, math.inf, -math.inf, 1e308, 0.5, 2.5, True, "1"])
_NUMERIC = ["max_tokens", "max_completion_tokens", "top_k", "temperature", "top_p", "seed", "n", "best_of", "presence_penalty",
            "frequency_penalty", "logprobs", "top_logprobs"]


def _near_valid(valid: dict, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """``valid`` with 1-3 fields set to a hostile value (or removed): every other check passes, so the one broken field
    reaches as far into the gateway (and the SDK, and the router) as it can."""
    return st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] | st.just(_DROP) for name in names})
    ).map(lambda changed: {k: v for k, v in {**valid, **changed}.items() if v is not _DROP})


def _fields(own: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    fields = {**_COMMON, **own}
    return {name: (_numbers | strategy) if name in _NUMERIC else strategy for name, strategy in fields.items()}


_COMPLETION_FIELDS = {"model": _models, "prompt": _prompts, "max_tokens": _max_tokens, "stream": _stream,
                      "best_of": _hostile, "echo": _hostile, "suffix": _hostile}
_CHAT_FIELDS = {"model": _models, "messages": _messages, "max_tokens": _max_tokens, "stream": _stream, "max_completion_tokens": _hostile,
                "top_logprobs": _hostile, "tools": _hostile, "tool_choice": _hostile}
_completion_bodies = _body(
    {k: _COMPLETION_FIELDS[k] for k in ("model", "prompt", "max_tokens", "stream")},
    {k: v for k, v in _COMPLETION_FIELDS.items() if k not in ("model", "prompt", "max_tokens", "stream")},
) | _near_valid({"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}, _fields(_COMPLETION_FIELDS))
_chat_bodies = _body(
    {k: _CHAT_FIELDS[k] for k in ("model", "messages", "max_tokens", "stream")},
    {k: v for k, v in _CHAT_FIELDS.items() if k not in ("model", "messages", "max_tokens", "stream")},
) | _near_valid({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0},
                _fields(_CHAT_FIELDS))
_content_types = st.sampled_from([
    "application/json", "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", "", None,
])
_tiers = st.sampled_from([None, "premium", "standard", "best_effort", "gold", "", "x" * 4000])


def _encoded(value: object) -> bytes:
    # allow_nan: the NaN and Infinity tokens JSON does not have but Python's json (and pydantic's parser) take.
    return json.dumps(value, allow_nan=True).encode()


def _mangled(body: bytes, how: str, seed: int) -> bytes:
    """``body`` broken one way: truncated, a byte flipped to invalid UTF-8, wrapped in deep nesting, and so on."""
    rng = random.Random(seed)
    if how == "truncate":
        return body[: rng.randrange(len(body) + 1)]
    if how == "invalid_utf8":
        at = rng.randrange(len(body) + 1)
        return body[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]) + body[at:]
    if how == "nest":
        return b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    if how == "empty":
        return b""
    if how == "duplicate_keys":
        return body[:-1] + b', "model": 7, "stream": true}' if body.endswith(b"}") else body
    return body


_raw_bodies = st.one_of(
    st.binary(max_size=400),
    st.tuples(_completion_bodies.map(_encoded), st.sampled_from(["truncate", "invalid_utf8", "nest", "empty", "duplicate_keys"]),
              st.integers(0, 2**32)).map(lambda t: _mangled(*t)),
    st.sampled_from([b"null", b"[]", b"1", b'"a"', b"NaN", b"{}", b'{"model": NaN}', b"\xef\xbb\xbf{}", b"{" * 10 + b"}" * 10]),
)


def _send(client: httpx.Client, method: str, path: str, content: bytes | None = None, headers: dict[str, str] | None = None) -> None:
    """One request; asserts its status is documented and an error is a readable OpenAI error."""
    with client.stream(method, path, content=content, headers=headers) as response:
        received = b""
        for chunk in response.iter_bytes():
            received += chunk
            if len(received) > max(STREAM_READ_LIMIT, MAX_ERROR_BODY) and response.status_code == 200:
                break  # a stream (or a long answer) that was a valid request: enough of it
        status = response.status_code
        where = f"{method} {path[:100]} {content[:200] if content else content!r}"
        assert status in DOCUMENTED, f"{where}: {status} {received[:500]!r}"
        if status >= 400 and method != "HEAD":  # a HEAD answer has no body
            assert len(received) <= MAX_ERROR_BODY, f"{where}: a {len(received)}-byte error body"
            assert response.headers.get("content-type", "").startswith("application/json"), f"{where}: {response.headers}"
            error = json.loads(received)["error"]
            assert isinstance(error["message"], str) and error["message"].strip(), f"{where}: {error}"
            assert "Traceback" not in error["message"] and "object at 0x" not in error["message"], f"{where}: {error}"
            assert isinstance(error["type"], str), error


def _headers(content_type: str | None, tier: str | None) -> dict[str, str]:
    headers = {}
    if content_type is not None:
        headers["content-type"] = content_type
    if tier is not None:
        headers["x-phalanx-tier"] = tier
    return headers


def _assert_still_serving(fuzz_stack: FuzzStack, client: httpx.Client) -> None:
    fuzz_stack.assert_all_alive()
    health = client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
    answer = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "a normal request after the fuzzing", "max_tokens": 3, "ignore_eos": True, "temperature": 0,
    })
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3, answer.text


@pytest.fixture
def gateway(fuzz_stack: FuzzStack):
    with httpx.Client(base_url=fuzz_stack.processes()["gateway"].url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture
def still_serving(fuzz_stack: FuzzStack, gateway: httpx.Client):
    """Called at the end of each test (not in a teardown: the stack may be closing by then)."""
    return lambda: _assert_still_serving(fuzz_stack, gateway)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "bodies"), [("/v1/completions", _completion_bodies), ("/v1/chat/completions", _chat_bodies)],
                         ids=["completions", "chat"])
def test_hostile_json_bodies_get_documented_statuses(gateway: httpx.Client, still_serving, path, bodies):
    @settings(settings.get_profile("fuzz"))
    @given(bodies, _content_types, _tiers)
    def one(body: dict, content_type: str | None, tier: str | None) -> None:
        _send(gateway, "POST", path, _encoded(body), _headers(content_type, tier))

    one()
    still_serving()


_EDGES = [-1, 0, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, math.nan, math.inf, -math.inf, 1e308]
_VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0},
}


@pytest.mark.parametrize("path", sorted(_VALID), ids=["chat", "completions"])
def test_every_number_at_its_edges_in_an_otherwise_valid_request(gateway: httpx.Client, still_serving, path):
    """Not drawn but swept: each numeric parameter (and the token ids of a prompt) at each edge of int32, int64, float,
    alone in a valid request, so that it gets past every other check to the SDK's protobuf and the router."""
    fields = [f for f in _NUMERIC if not (path == "/v1/completions" and f in ("max_completion_tokens", "top_logprobs"))
              and not (path == "/v1/chat/completions" and f == "best_of")]
    for field in fields:
        for value in _EDGES:
            _send(gateway, "POST", path, _encoded({**_VALID[path], field: value}), {"content-type": "application/json"})
    if path == "/v1/completions":
        for value in _EDGES:
            if isinstance(value, int):
                _send(gateway, "POST", path, _encoded({**_VALID[path], "prompt": [1, value]}))
                _send(gateway, "POST", path, _encoded({**_VALID[path], "prompt": [[value]]}))
    still_serving()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_bytes_that_are_not_a_request_get_documented_statuses(gateway: httpx.Client, still_serving, path):
    @settings(settings.get_profile("fuzz"))
    @given(_raw_bodies, _content_types)
    def one(body: bytes, content_type: str | None) -> None:
        _send(gateway, "POST", path, body, _headers(content_type, None))

    one()
    still_serving()


def test_a_body_over_the_limit_gets_413(gateway: httpx.Client, still_serving):
    body = b'{"model": "' + b"a" * BODY_LIMIT + b'", "prompt": "x"}'
    with gateway.stream("POST", "/v1/completions", content=body) as response:
        assert response.status_code == 413, response.status_code
        assert json.loads(response.read())["error"]["code"] == "body_too_large"
    # Without a declared length (chunked), the gateway counts what arrives.
    with gateway.stream("POST", "/v1/chat/completions", content=iter([body[:BODY_LIMIT // 2], body[BODY_LIMIT // 2:]])) as response:
        assert response.status_code == 413, response.status_code
    still_serving()


_paths = st.one_of(
    st.sampled_from(["/v1/models", "/v1/models/", f"/v1/models/{MODEL}", "/v1/models/bogus", "/health", "/metrics", "/v1/completions",
                     "/v1/chat/completions", "/v1", "/", "/v1/embeddings", "/v1/models/" + "m" * 6000, "/v1/models/%00", "/v1/models/..%2f..%2fetc",
                     "/v1/models/%ff%fe", "//v1//models", "/v1/completions/../models"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e, exclude_characters="?#%"), max_size=40).map(lambda t: "/" + t),
)


def test_hostile_routes_methods_and_headers_get_documented_statuses(gateway: httpx.Client, still_serving):
    @settings(settings.get_profile("fuzz"))
    @given(_paths, st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]), st.binary(max_size=64),
           st.sampled_from([None, "Bearer", "Basic abc", "Bearer " + "k" * 5000, "bearer x"]), _tiers)
    def one(path: str, method: str, body: bytes, authorization: str | None, tier: str | None) -> None:
        headers = _headers(None, tier)
        if authorization is not None:
            headers["authorization"] = authorization
        _send(gateway, method, path, body if method in ("POST", "PUT", "PATCH") else None, headers)

    one()
    still_serving()
