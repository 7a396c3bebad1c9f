"""Event ids of the streamed /v1/completions and /v1/chat/completions: where a reconnecting client continues. Pure logic.

An event id names the stream and how far the client got:
``<request id>/<tokens received>/<prompt tokens>/<created>``. The request id
is the router's (any router replica finds the request by it, through its
etcd record), the token count is where the stream goes on, and the last two
keep the resumed chunks and usage equal to what an unbroken stream would
have sent. A client that reconnects with ``Last-Event-ID`` (to any gateway
replica) gets exactly the events after the one it names.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.common.subjects import validate_request_id

__all__ = ["StreamCursor"]

_SEPARATOR = "/"  # not in the request ids' alphabet, so the id splits unambiguously
_PARTS = 4
_MAX_ID_CHARS = 256


@dataclass(frozen=True)
class StreamCursor:
    """The position of a client in one request's token stream."""

    request_id: str
    tokens: int
    prompt_tokens: int
    created: int

    def event_id(self) -> str:
        return _SEPARATOR.join((self.request_id, str(self.tokens), str(self.prompt_tokens), str(self.created)))

    @classmethod
    def parse(cls, event_id: str) -> StreamCursor:
        """The cursor an event id names; ValueError if it is not one this gateway wrote."""
        if len(event_id) > _MAX_ID_CHARS:
            raise ValueError(f"is longer than {_MAX_ID_CHARS} characters")
        parts = event_id.strip().split(_SEPARATOR)
        if len(parts) != _PARTS:
            raise ValueError("is not an event id of this API: want <request id>/<tokens>/<prompt tokens>/<created>")
        request_id, *numbers = parts
        validate_request_id(request_id)
        if not all(n.isascii() and n.isdigit() for n in numbers):
            raise ValueError("its counts are not non-negative integers")
        tokens, prompt_tokens, created = (int(n) for n in numbers)
        if tokens >= 2**31 or prompt_tokens >= 2**31:
            raise ValueError("its counts are out of range")
        return cls(request_id, tokens, prompt_tokens, created)

    def after(self, tokens: int) -> StreamCursor:
        """The same stream, ``tokens`` received."""
        return StreamCursor(self.request_id, tokens, self.prompt_tokens, self.created)
