"""A Generate request's prompt as the router checks it: placeholders for media, limits of the router and the workers."""

import pytest

from phalanx._proto import common_pb2, router_pb2
from phalanx.common.errors import InvalidRequestError
from phalanx.model.tokenizer import ByteTokenizer
from phalanx.router.config import RouterConfig
from phalanx.router.prompts import context_limit, prompt_with_placeholders, request_prompt

pytestmark = pytest.mark.unit


class _Words:
    """A tokenizer of one id per word (BOS is 1)."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([1] if add_bos else []) + [len(w) + 10 for w in text.split()]


def test_each_media_marker_becomes_a_placeholder_and_without_markers_the_media_go_first():
    tokenizer = _Words()
    marked = prompt_with_placeholders("a <m> bb <m>", 2, tokenizer, marker="<m>", placeholder=7)
    assert marked == [1, 11, 7, 12, 7]
    assert prompt_with_placeholders("a bb", 2, tokenizer, marker="<m>", placeholder=7) == [1, 7, 7, 11, 12]


def test_markers_that_do_not_match_the_media_are_the_caller_s_error():
    with pytest.raises(InvalidRequestError, match="2 media markers for 1 media items"):
        prompt_with_placeholders("<m> a <m>", 1, _Words(), marker="<m>", placeholder=7)


def test_the_context_limit_is_the_smallest_any_worker_states():
    registrations = {
        "w1": common_pb2.WorkerRegistration(max_model_len=4096), "w2": common_pb2.WorkerRegistration(max_model_len=2048),
        "w3": common_pb2.WorkerRegistration(),
    }
    assert context_limit(registrations) == 2048
    assert context_limit({}) == 0


def _request(**prompt) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=8), **prompt)


def test_a_text_prompt_is_tokenized_and_token_ids_are_taken_as_they_are():
    tokenizer, config = ByteTokenizer(), RouterConfig()
    ids, params = request_prompt(_request(text="hi"), tokenizer, config, context=0)
    assert ids == tokenizer.encode("hi") and params.max_tokens == 8
    assert request_prompt(_request(tokens=common_pb2.PromptTokens(ids=[5, 6])), tokenizer, config, context=0)[0] == [5, 6]


@pytest.mark.parametrize(("request_", "field"), [
    (router_pb2.GenerateRequest(), "prompt"),
    (router_pb2.GenerateRequest(text=""), "prompt"),
    (router_pb2.GenerateRequest(tokens=common_pb2.PromptTokens(ids=[1, 10**6])), "prompt.tokens"),
])
def test_an_empty_prompt_or_ids_outside_the_vocabulary_are_refused(request_, field):
    with pytest.raises(InvalidRequestError) as refused:
        request_prompt(request_, ByteTokenizer(), RouterConfig(), context=0)
    assert refused.value.violations[0].field == field


def test_a_prompt_over_the_router_s_limit_is_refused():
    config = RouterConfig(max_prompt_tokens=4)
    with pytest.raises(InvalidRequestError, match="5 tokens exceed the limit of 4"):
        request_prompt(_request(tokens=common_pb2.PromptTokens(ids=[1, 2, 3, 4, 5])), ByteTokenizer(), config, context=0)


def test_a_prompt_and_max_tokens_must_fit_the_smallest_worker_context():
    prompt = _request(tokens=common_pb2.PromptTokens(ids=[1, 2, 3]))
    assert request_prompt(prompt, ByteTokenizer(), RouterConfig(), context=11)[0] == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match=r"prompt \(3 tokens\) \+ max_tokens \(8\) exceeds the context of 10 tokens"):
        request_prompt(prompt, ByteTokenizer(), RouterConfig(), context=10)
