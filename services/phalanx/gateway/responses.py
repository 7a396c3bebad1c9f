"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions. Pure logic, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.client import FinishReason

__all__ = ["CHAT", "COMPLETIONS", "Dialect", "finish_reason", "usage"]

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
        self, *, request_id: str, created: int, model: str, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """The whole (non-streamed) answer."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish)
        return {
            "id": self.id_prefix + request_id, "object": self.object_name, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def chunk(
        self, *, request_id: str, created: int, model: str, text: str, finish: str | None, first: bool, include_usage: bool
    ) -> dict[str, Any]:
        """One streamed piece; chat's first carries the assistant role. With include_usage, usage is null until the last chunk."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish)
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
