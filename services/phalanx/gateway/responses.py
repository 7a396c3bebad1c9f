"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions. Pure logic, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.client import FinishReason, PositionLogprobs, TokenLogprob

__all__ = ["CHAT", "COMPLETIONS", "Dialect", "LogprobsShape", "finish_reason", "usage"]

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's finish_reason for the SDK's (stop or length; None for an end that is neither)."""
    return _FINISH.get(reason) if reason is not None else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Dialect:
    """How one endpoint shapes its answers: object names, id prefix, and where the text goes."""

    endpoint: str
    id_prefix: str
    object_name: str
    chunk_object_name: str
    chat: bool

    def response(
        self, *, request_id: str, created: int, model: str, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The whole (non-streamed) answer."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish)
        return {
            "id": self.id_prefix + request_id, "object": self.object_name, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def chunk(
        self, *, request_id: str, created: int, model: str, text: str, finish: str | None, first: bool, include_usage: bool,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed piece; chat's first carries the assistant role. With include_usage, usage is null until the last chunk."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish)
        body: dict[str, Any] = {
            "id": self.id_prefix + request_id, "object": self.chunk_object_name, "created": created, "model": model, "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, *, request_id: str, created: int, model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The extra last chunk of stream_options.include_usage: no choices, the usage of the whole request."""
        return {
            "id": self.id_prefix + request_id, "object": self.chunk_object_name, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }


COMPLETIONS = Dialect("completions", "cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Dialect("chat_completions", "chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


class LogprobsShape:
    """Token log-probabilities as an endpoint answers them, a part at a time (a stream's chunk, or the whole answer).

    Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}``.
    Completions (the legacy API): ``{tokens, token_logprobs, top_logprobs, text_offset}``, the top ones as
    ``{token: logprob}`` and the prompt's first token's as null; ``text_offset`` counts characters of the answer's text
    (the echoed prompt's included), carried from part to part.
    """

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.offset = 0

    def part(self, entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tokens, logprobs, tops, offsets = [], [], [], []
        for e in entries:
            text = token_text(e.token)
            tokens.append(text)
            logprobs.append(e.token.logprob)
            tops.append({token_text(t): t.logprob for t in e.top} if e.token.logprob is not None else None)
            offsets.append(self.offset)
            self.offset += len(e.token.text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, e: PositionLogprobs) -> dict[str, Any]:
        return {**_chat_token(e.token), "top_logprobs": [_chat_token(t) for t in e.top]}


def _chat_token(t: TokenLogprob) -> dict[str, Any]:
    return {"token": token_text(t), "logprob": t.logprob, "bytes": list(t.token_bytes)}


def token_text(t: TokenLogprob) -> str:
    """A token as text; one that is not whole UTF-8 (part of a character) as ``bytes:\\xe2\\x80``, as OpenAI writes it,
    so that distinct tokens stay distinct keys of a completion's top_logprobs."""
    try:
        return t.token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in t.token_bytes)
