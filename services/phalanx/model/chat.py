"""Chat prompts: a model's own Jinja chat template, rendered as transformers renders it; ChatML when it has none.

The template runs in Jinja's immutable sandbox (a model file is data, not
code we trust), with the names transformers gives it: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``raise_exception``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from phalanx.common.errors import InvalidRequestError

# ChatML, for models (the built-in tiny ones) whose files carry no template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 1024


class ChatTemplateError(InvalidRequestError):
    """The template refused the conversation (``raise_exception``) or failed on it."""

    def __init__(self, description: str) -> None:
        super().__init__("messages", description)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    template: str | None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": str}, ...]).

    Raises InvalidRequestError naming what is wrong with the messages.
    """
    _validate(messages)
    compiled = _compile(template or DEFAULT_CHAT_TEMPLATE)
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise ChatTemplateError(f"the model's chat template failed on these messages: {error}") from None


def _validate(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile(template: str):
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = _raise_exception
    try:
        return environment.from_string(template)
    except TemplateError as error:
        raise ValueError(f"the model's chat template does not compile: {error}") from None


@dataclass(frozen=True)
class ChatPrompts:
    """A served model's chat template and special-token texts: conversations to prompt text, as the router should tokenize it."""

    template: str | None
    bos_token: str = ""
    eos_token: str = ""
    # Whether the router's tokenizer puts the BOS id in front of a text prompt itself.
    adds_bos: bool = False

    @classmethod
    def for_model(cls, model: str) -> ChatPrompts:
        """Torch-free (the gateway and `phalanx chat` use it); ValueError for a model whose tokenizer cannot be read."""
        from phalanx.model.config import model_tokenizer

        tokenizer = model_tokenizer(model)
        bos_token, eos_token = special_token_texts(model)
        adds_bos = tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", True)
        return cls(tokenizer.chat_template, bos_token, eos_token, adds_bos)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text (InvalidRequestError for a bad conversation, ValueError for a template that does not compile).

        A template's leading ``bos_token`` text is dropped when the router adds
        the BOS id itself, rather than tokenized into a second BOS.
        """
        text = render_chat(messages, template=self.template, bos_token=self.bos_token, eos_token=self.eos_token)
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def special_token_texts(model: str) -> tuple[str, str]:
    """bos_token and eos_token of a checkpoint's tokenizer_config.json (what transformers passes its templates); "" otherwise."""
    config = Path(model) / "tokenizer_config.json"
    if not config.is_file():
        return "", ""
    data = json.loads(config.read_text())

    def text(value: Any) -> str:
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else ""

    return text(data.get("bos_token")), text(data.get("eos_token"))
