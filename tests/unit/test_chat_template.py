"""Chat templates render as transformers renders them, and bad conversations are refused by name."""

import pytest

from phalanx.common.errors import InvalidRequestError
from phalanx.model.chat import DEFAULT_CHAT_TEMPLATE, render_chat
from phalanx.model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_default_template_is_chatml_with_a_generation_prompt():
    text = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], template=None)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ByteTokenizer().chat_template is None


def test_a_models_template_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = render_chat(messages, template=SMOLLM2_TEMPLATE)
    theirs, _ = render_jinja_template(conversations=[messages], chat_template=SMOLLM2_TEMPLATE, add_generation_prompt=True)
    assert transformers and ours == theirs[0]
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ours.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_without_generation_prompt():
    assert not render_chat([{"role": "user", "content": "x"}], template=DEFAULT_CHAT_TEMPLATE, add_generation_prompt=False).endswith(
        "assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], "messages[1].content"),
    ],
)
def test_bad_conversations_name_the_field(messages, field):
    with pytest.raises(InvalidRequestError) as raised:
        render_chat(messages, template=None)
    assert raised.value.violations[0].field == field


def test_a_template_that_raises_is_an_invalid_request():
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(InvalidRequestError, match="must alternate"):
        render_chat([{"role": "user", "content": "x"}], template=template)


def test_the_sandbox_refuses_to_reach_python_internals():
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequestError):
        render_chat([{"role": "user", "content": "x"}], template=template)
