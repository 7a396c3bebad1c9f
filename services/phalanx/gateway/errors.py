"""Errors in OpenAI's JSON shape with their HTTP status, and the SDK's typed errors mapped onto them. Pure logic, no I/O.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}

429 (shed under load, or over the tenant's limits at the router: code
``rate_limit_exceeded``) and 503 (no router or worker) carry ``Retry-After``
(whole seconds) and ``retry-after-ms``, which OpenAI's own clients honour.
"""

from __future__ import annotations

import math
from typing import Any

from phalanx.client import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    OverloadedError,
    PhalanxClientError,
    RequestCancelledError,
    RequestQuarantinedError,
    UnavailableError,
)
from phalanx.common.errors import TenantLimitError

__all__ = ["GatewayError", "bad_request", "from_client_error", "router_field_to_param"]

# The router's field names (phalanx.router.v1 / SamplingParams) as OpenAI request parameters.
_ROUTER_FIELDS = {
    "sampling.temperature": "temperature",
    "sampling.top_k": "top_k",
    "sampling.top_p": "top_p",
    "sampling.max_tokens": "max_tokens",
    "sampling.stop_strings": "stop",
    "sampling.stop_token_ids": "stop",
    "sampling.seed": "seed",
    "tier": "x-phalanx-tier",
}
_UNAVAILABLE_RETRY_AFTER_S = 1.0
MAX_MESSAGE_CHARS = 1024


class GatewayError(Exception):
    """An HTTP error answer: ``status``, and the fields of OpenAI's error object."""

    def __init__(
        self, status: int, message: str, *, kind: str, param: str | None = None, code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _bounded(self.message), "type": self.kind, "param": _bounded(self.param), "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After takes whole seconds: round up, so that a client never comes back too early.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s))), "retry-after-ms": str(max(1, round(self.retry_after_s * 1000)))}


def _bounded(text: str | None) -> str | None:
    """A message or param quoting a client's value (a model name of a megabyte) cut to MAX_MESSAGE_CHARS."""
    if text is None or len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS]}... ({len(text)} characters)"


def bad_request(param: str | None, description: str, *, code: str = "invalid_value") -> GatewayError:
    """400 naming the parameter and what is wrong with it."""
    message = f"{param}: {description}" if param else description
    return GatewayError(400, message, kind="invalid_request_error", param=param, code=code)


def router_field_to_param(field: str, *, prompt_param: str) -> str:
    """The request parameter a router field violation is about ("prompt.tokens" -> "prompt", or "messages" for chat)."""
    if field == "prompt" or field.startswith("prompt."):
        return prompt_param
    return _ROUTER_FIELDS.get(field, field)


def from_client_error(error: PhalanxClientError, *, prompt_param: str = "prompt") -> GatewayError:
    """The HTTP answer for an SDK error (the router's status, turned back into a typed error by the SDK)."""
    if isinstance(error, InvalidArgumentError):
        field, description = error.violations[0] if error.violations else ("", error.message)
        param = router_field_to_param(field, prompt_param=prompt_param) if field else None
        return bad_request(param, description)
    if isinstance(error, RequestQuarantinedError):
        # Not retryable: the same request (its fingerprint) is refused fleet-wide until the quarantine ends.
        return GatewayError(422, error.message, kind="invalid_request_error", code="request_quarantined")
    if isinstance(error, AuthenticationError):
        return GatewayError(401, f"the router refused the API key: {error.message}", kind="authentication_error", code="invalid_api_key")
    if isinstance(error, OverloadedError):
        # The router names the limit in its message; TENANT_LIMIT is the caller's own quota, not the system's load.
        code = "rate_limit_exceeded" if error.reason == TenantLimitError.reason else "overloaded"
        return GatewayError(429, error.message, kind="rate_limit_error", code=code, retry_after_s=error.retry_after_s or 1.0)
    if isinstance(error, UnavailableError):
        return GatewayError(
            503, f"no router or worker can serve the request now: {error.message}", kind="server_error", code="unavailable",
            retry_after_s=error.retry_after_s or _UNAVAILABLE_RETRY_AFTER_S,
        )
    if isinstance(error, DeadlineExceededError):
        return GatewayError(504, f"the request timed out: {error.message}", kind="server_error", code="timeout")
    if isinstance(error, NotFoundError):
        return GatewayError(404, error.message, kind="not_found_error", code="not_found")
    if isinstance(error, RequestCancelledError):
        return GatewayError(503, f"the request was cancelled: {error.message}", kind="server_error", code="cancelled", retry_after_s=1.0)
    return GatewayError(500, f"the router failed: {error}", kind="server_error", code="internal_error")
