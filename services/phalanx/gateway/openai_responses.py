"""OpenAI's Responses API: the request body, the stored response, its object and its stream of events. Pure logic, no I/O.

A response's whole life is one ``StoredResponse`` (in etcd, where any
gateway replica reads it). Its events are a function of it: the header
events (sequence numbers 0-3), one ``response.output_text.delta`` per
generated token (4 + the token's index, empty text included, so that a
number names the same event at every replica), then the closing events.
A stored response only grows (tokens appended, then one final status), so
the events of an earlier state are a prefix of a later state's: a reader
that resumes ``starting_after`` N gets every later event once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from phalanx.gateway.errors import bad_request
from phalanx.gateway.schema import INT32_MAX

__all__ = [
    "FIRST_DELTA",
    "ResponseStatus",
    "ResponsesRequest",
    "StoredResponse",
    "events_after",
    "response_object",
]

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
FINAL: frozenset[str] = frozenset({"completed", "incomplete", "cancelled", "failed"})
# Sequence numbers: created, in_progress, output_item.added, content_part.added, then the deltas.
FIRST_DELTA = 4
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class InputMessage(BaseModel):
    """One item of ``input``: a message with text content (string or text parts)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]

    def text(self, index: int) -> str:
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            kind = part.get("type")
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad_request(f"input[{index}].content", f"only text parts are supported, got {kind!r}", code="unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Tools, reasoning and conversation state are refused by name, never ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    background: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    ignore_eos: bool = False  # an extension, as vLLM's (and this gateway's other endpoints)

    def check(self) -> None:
        if self.tools:
            raise bad_request("tools", "tools are not supported by this gateway", code="unsupported_parameter")
        for name in ("previous_response_id", "conversation", "reasoning"):
            if getattr(self, name):
                raise bad_request(name, "is not supported by this gateway; send the whole conversation as input", code="unsupported_parameter")
        if self.store is False:
            raise bad_request("store", "responses are always stored (for their time to live): any gateway replica may serve them")
        if isinstance(self.input, str) and not self.input:
            raise bad_request("input", "must not be empty")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input", "must hold at least one message")

    def messages(self) -> list[dict[str, str]]:
        """The conversation for the chat template: instructions first (as the system message), then the input."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        return [*messages, *({"role": _ROLES[m.role], "content": m.text(i)} for i, m in enumerate(self.input))]


@dataclass(frozen=True)
class StoredResponse:
    """Everything any gateway needs to answer for a response, run it on, or replay its events."""

    id: str
    request_id: str
    model: str
    created_at: int
    prompt: str
    lease_id: int
    max_tokens: int  # what the router is asked for: max_output_tokens, else the gateway's default
    tenant: str = ""
    tier: str | None = None
    background: bool = False
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    ignore_eos: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    status: ResponseStatus = "in_progress"
    pieces: tuple[str, ...] = ()  # each generated token's text, in order
    prompt_tokens: int = 0
    error: dict[str, str] | None = None
    completed_at: int | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def grown(self, pieces: list[str], *, prompt_tokens: int) -> StoredResponse:
        return replace(self, pieces=self.pieces + tuple(pieces), prompt_tokens=prompt_tokens or self.prompt_tokens)

    def ended(self, status: ResponseStatus, at: int, error: dict[str, str] | None = None) -> StoredResponse:
        return replace(self, status=status, completed_at=at, error=error)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> StoredResponse:
        fields = json.loads(data)
        fields["pieces"] = tuple(fields.get("pieces", ()))
        return cls(**fields)


def _message(r: StoredResponse, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": "msg_" + r.request_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_status(r: StoredResponse) -> str:
    return {"completed": "completed", "in_progress": "in_progress", "queued": "in_progress"}.get(r.status, "incomplete")


def response_object(r: StoredResponse, *, snapshot: bool = False) -> dict[str, Any]:
    """The response as GET answers it; ``snapshot``: as it was when it started (the created and in_progress events)."""
    status = "in_progress" if snapshot else r.status
    output = [] if snapshot or (not r.pieces and not r.final) else [_message(r, _item_status(r), r.text)]
    body: dict[str, Any] = {
        "id": r.id, "object": "response", "created_at": r.created_at, "status": status, "background": r.background,
        "error": None if snapshot else r.error, "incomplete_details": None, "instructions": r.instructions,
        "max_output_tokens": r.max_output_tokens, "model": r.model, "output": output, "parallel_tool_calls": False,
        "temperature": r.temperature, "top_p": r.top_p, "tool_choice": "none", "tools": [], "metadata": r.metadata,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None, "completed_at": None,
    }
    if not snapshot and r.final:
        body["completed_at"] = r.completed_at
        body["usage"] = {
            "input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": len(r.pieces),
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": r.prompt_tokens + len(r.pieces),
        }
        if r.status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def last_sequence_number(r: StoredResponse) -> int:
    """The sequence number of the last event the response's state implies now."""
    deltas_end = FIRST_DELTA + len(r.pieces) - 1
    if r.status in ("completed", "incomplete"):
        return deltas_end + 4  # text done, part done, item done, completed / incomplete
    if r.final:
        return deltas_end + 1  # failed, or cancelled
    return deltas_end


def events_after(r: StoredResponse, after: int) -> list[dict[str, Any]]:
    """The events with sequence numbers above ``after`` that the state implies, in order."""
    return [_event(r, seq) for seq in range(max(after + 1, 0), last_sequence_number(r) + 1)]


def _event(r: StoredResponse, seq: int) -> dict[str, Any]:
    item_id = "msg_" + r.request_id
    n = len(r.pieces)
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    if seq == 0:
        return {"type": "response.created", "sequence_number": seq, "response": response_object(r, snapshot=True)}
    if seq == 1:
        return {"type": "response.in_progress", "sequence_number": seq, "response": response_object(r, snapshot=True)}
    if seq == 2:
        return {"type": "response.output_item.added", "sequence_number": seq, "output_index": 0, "item": _message(r, "in_progress", None)}
    if seq == 3:
        return {"type": "response.content_part.added", "sequence_number": seq, **where, "part": _text_part("")}
    if seq < FIRST_DELTA + n:
        return {"type": "response.output_text.delta", "sequence_number": seq, **where, "delta": r.pieces[seq - FIRST_DELTA], "logprobs": []}
    step = seq - FIRST_DELTA - n
    if r.status == "failed":
        return {"type": "response.failed", "sequence_number": seq, "response": response_object(r)}
    if r.status == "cancelled":
        # The Responses stream has no event of its own for a cancellation: an error event, which OpenAI's clients raise.
        return {"type": "error", "sequence_number": seq, "code": "response_cancelled", "message": f"the response {r.id} was cancelled",
                "param": None}
    item = _message(r, _item_status(r), r.text)
    closing: list[dict[str, Any]] = [
        {"type": "response.output_text.done", **where, "text": r.text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": _text_part(r.text)},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": f"response.{r.status}", "response": response_object(r)},
    ]
    return {**closing[step], "sequence_number": seq}
