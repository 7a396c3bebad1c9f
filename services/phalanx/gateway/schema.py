"""OpenAI request bodies: parsed, checked, and turned into the SDK's ``generate`` arguments. Pure logic, no I/O.

Parameters the engine has no equivalent for are refused by name when set to
anything but their neutral value (``n`` > 1, penalties, ``logit_bias``,
tools ...), never silently ignored. Unknown fields are ignored,
as OpenAI-compatible servers do, so that newer clients keep working.
Extensions (as vLLM's): ``top_k`` and ``ignore_eos``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from phalanx.client import GenerateOptions, InvalidArgumentError, Media
from phalanx.common.errors import InvalidRequestError
from phalanx.gateway.errors import GatewayError, bad_request, from_client_error
from phalanx.model.chat import ChatPrompts
from phalanx.model.params import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS

# Where an image or audio part stood in a message: the router's default media marker (PHALANX_ROUTER_MEDIA_MARKER).
MEDIA_MARKER = "<media>"

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateArgs",
    "chat_text",
    "parse_body",
]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The router's SamplingParams and token ids are int32: a larger number could not even be sent to it.
INT32_MAX = 2**31 - 1
# The legacy completions API's bound on logprobs (the number of alternatives per token).
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Extensions, as vLLM's.
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False

    def _refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise bad_request("n", f"only n=1 is supported, got {self.n}; send one request per completion")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise bad_request(name, "penalties are not supported by this engine; leave it unset or 0", code="unsupported_parameter")
        if self.logit_bias:
            raise bad_request("logit_bias", "is not supported by this engine", code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "is only allowed with stream: true")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request("stop", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise bad_request("stop", "stop sequences must not be empty")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    @property
    def metadata_tier(self) -> str | None:
        return (self.metadata or {}).get("tier")

    def _args(
        self, prompt: str | list[int], max_tokens: int, media: tuple[Media, ...] = (), *, top_logprobs: int | None = None,
        echo: bool = False,
    ) -> GenerateArgs:
        # Echoing a prompt of token ids needs its text: its log-probabilities bring each token's bytes.
        prompt_logprobs = echo and (top_logprobs is not None or not isinstance(prompt, str))
        try:
            options = GenerateOptions(
                max_tokens=max_tokens,
                # OpenAI samples at temperature 1 unless told otherwise; 0 is greedy.
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                stop=self.stop_strings(),
                seed=self.seed,
                ignore_eos=self.ignore_eos,
                logprobs=top_logprobs is not None or prompt_logprobs,
                top_logprobs=top_logprobs or 0,
                prompt_logprobs=prompt_logprobs,
            )
        except InvalidArgumentError as error:  # the fields' bounds above are within the SDK's, so this is a safety net
            raise from_client_error(error) from None
        return GenerateArgs(prompt=prompt, options=options, media=media, top_logprobs=top_logprobs, echo=echo)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def generate_args(self) -> GenerateArgs:
        """The SDK call; raises a 400 GatewayError naming what cannot be served."""
        self._refuse_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(
                "logprobs", f"must be from 0 to {MAX_COMPLETION_LOGPROBS} (the number of most likely tokens per position), got {self.logprobs}"
            )
        if self.best_of not in (None, 1):
            raise bad_request("best_of", f"only best_of=1 is supported, got {self.best_of}")
        if self.suffix:
            raise bad_request("suffix", "is not supported (no fill-in-the-middle)", code="unsupported_parameter")
        return self._args(
            self._one_prompt(), self.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, top_logprobs=self.logprobs, echo=bool(self.echo)
        )

    def _one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; a list of one prompt is that prompt, more are refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise bad_request("prompt", "must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return _token_ids(cast(list[int], prompt))  # token ids (pydantic made the list all of one kind)
        if len(prompt) != 1:
            raise bad_request("prompt", f"one prompt per request, got {len(prompt)} (batched prompts are not supported)")
        only = prompt[0]
        return only if isinstance(only, str) else _token_ids(cast(list[int], only))


def _token_ids(ids: list[int]) -> list[int]:
    """Token ids the router can be sent (int32; whether the vocabulary has them is the router's to say)."""
    if not all(0 <= i <= INT32_MAX for i in ids):
        raise bad_request("prompt", f"token ids must be from 0 to {INT32_MAX}")
    return list(ids)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def generate_args(self, prompt: str, *, default_max_tokens: int) -> GenerateArgs:
        """The SDK call for the rendered ``prompt``; raises a 400 GatewayError naming what cannot be served."""
        self._refuse_unsupported()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request("top_logprobs", f"must be from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
        if self.tools:
            raise bad_request("tools", "tool calls are not supported", code="unsupported_parameter")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice", "tool calls are not supported", code="unsupported_parameter")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format", "only {\"type\": \"text\"} is supported", code="unsupported_parameter")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_completion_tokens", "differs from max_tokens; send one of them")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        media: list[Media] = []
        for i, m in enumerate(self.messages):
            _text_of(m.content, i, media)
        return self._args(prompt, max_tokens, tuple(media), top_logprobs=(self.top_logprobs or 0) if self.logprobs else None)

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template takes it: role and text content ("" for none); each image or audio part
        becomes the router's media marker where it stood."""
        return [{"role": m.role, "content": _text_of(m.content, i, [])} for i, m in enumerate(self.messages)]


def _text_of(content: str | list[dict[str, Any]] | None, index: int, media: list[Media]) -> str:
    """A message's text: a string, or its parts joined, an image_url (data URL) or input_audio part as MEDIA_MARKER
    (its bytes appended to `media`); other parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        field = f"messages[{index}].content[{j}]"
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            media.append(Media("image", _data_url(part.get("image_url"), f"{field}.image_url")))
            texts.append(MEDIA_MARKER)
        elif kind == "input_audio":
            media.append(Media("audio", _input_audio(part.get("input_audio"), f"{field}.input_audio")))
            texts.append(MEDIA_MARKER)
        else:
            raise bad_request(field, f"only text, image_url and input_audio parts are supported, got type {kind!r}")
    return "".join(texts)


def _data_url(value: Any, field: str) -> bytes:
    """The bytes of ``{"url": "data:<mime>;base64,<data>"}``; the gateway fetches no URLs."""
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str) or not url.startswith("data:"):
        raise bad_request(f"{field}.url", "only data: URLs (data:image/png;base64,...) are supported; the gateway fetches nothing")
    header, _, data = url.partition(",")
    if not header.endswith(";base64"):
        raise bad_request(f"{field}.url", "the data URL must be base64")
    return _base64(data, f"{field}.url")


def _input_audio(value: Any, field: str) -> bytes:
    if not isinstance(value, dict) or value.get("format") != "wav" or not isinstance(value.get("data"), str):
        raise bad_request(field, 'expected {"data": <base64 WAV>, "format": "wav"}')
    return _base64(value["data"], f"{field}.data")


def _base64(data: str, field: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise bad_request(field, "is not valid base64") from None


@dataclass(frozen=True)
class GenerateArgs:
    """The arguments of ``phalanx.client.Client.generate``: the prompt, its media and how to generate
    (the tier and tenant come from the caller, not the body)."""

    prompt: str | list[int]
    options: GenerateOptions
    media: tuple[Media, ...] = ()
    # Log-probabilities in the answer (None: none; else how many alternatives per token), and the prompt echoed
    # before the completion (/v1/completions' echo).
    top_logprobs: int | None = None
    echo: bool = False


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The request model of a JSON body; 400 naming the first wrong parameter (or the JSON) otherwise."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise _bad_body(error.errors(include_url=False)) from None


def _bad_body(errors: Sequence[Mapping[str, Any]]) -> GatewayError:
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(None, f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        return bad_request(None, "the body must be a JSON object", code="invalid_json")
    param, member = _param(first["loc"])
    if first["type"] == "missing":
        return bad_request(param, "is required", code="missing_required_parameter")
    if member is None:
        return bad_request(param, str(first["msg"]))
    # A union (prompt, stop, content): say which shapes it takes, not why the first one failed.
    members = []
    for e in errors:
        name, tag = _param(e["loc"])
        if name == param and tag is not None and tag not in members:
            members.append(tag)
    return bad_request(param, f"has the wrong type; expected one of: {', '.join(members)}")


def _param(loc: Sequence[int | str]) -> tuple[str, str | None]:
    """A pydantic location as the parameter path clients know, and the union member tried, if any.

    ("messages", 0, "content", "str") -> ("messages[0].content", "str").
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _SCALAR_TAGS:
            return out, part
        else:
            out += f".{part}" if out else part
    return out, None


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool"})


def chat_text(messages: list[dict[str, str]], prompts: ChatPrompts) -> str:
    """The prompt text of a conversation (ChatPrompts.render), its errors as the gateway's."""
    try:
        return prompts.render(messages)
    except InvalidRequestError as error:  # the conversation (a role, or the template's raise_exception)
        violation = error.violations[0]
        raise bad_request(violation.field, violation.description) from None
    except ValueError as error:  # the template does not compile: the deployment's fault, not the caller's
        raise GatewayError(500, str(error), kind="server_error", code="chat_template") from None
