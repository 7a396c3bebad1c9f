"""Typed exceptions, turned back from the router's gRPC status and its google.rpc details."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = [
    "AuthenticationError",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OverloadedError",
    "PhalanxClientError",
    "RequestCancelledError",
    "RequestQuarantinedError",
    "StreamGapError",
    "UnavailableError",
    "from_rpc_error",
    "is_wrong_peer",
    "wrong_peer_error",
]


class PhalanxClientError(Exception):
    """Root of every error the SDK raises.

    ``code`` is the gRPC status code, ``reason`` the router's ErrorInfo reason
    (None when the status carried none), ``request_id`` the request concerned
    (None for calls that have none). ``retryable`` says whether the same call
    may succeed later unchanged.
    """

    retryable = False

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode,
        reason: str | None = None,
        request_id: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.request_id = request_id
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        where = f" (request {self.request_id})" if self.request_id else ""
        return f"{self.code.name}: {self.message}{where}"


class InvalidArgumentError(PhalanxClientError, ValueError):
    """The request cannot be served as sent; ``violations`` lists (field, description) pairs."""

    def __init__(self, message: str, *, violations: list[tuple[str, str]] | None = None, **kwargs) -> None:
        kwargs.setdefault("code", grpc.StatusCode.INVALID_ARGUMENT)
        super().__init__(message, **kwargs)
        self.violations = list(violations or [])


class NotFoundError(PhalanxClientError):
    """The router knows no such request (finished, cancelled or past its resume window)."""


class AuthenticationError(PhalanxClientError):
    """The API key is missing, wrong, or not allowed to do this."""


class OverloadedError(PhalanxClientError):
    """The router shed the request under load; try again after ``retry_after_s``."""

    retryable = True


class UnavailableError(PhalanxClientError):
    """No router could serve the call (down, restarting, unreachable) within the retry budget."""

    retryable = True


class DeadlineExceededError(PhalanxClientError):
    """The call's overall ``timeout`` ran out."""


class RequestCancelledError(PhalanxClientError):
    """The request was cancelled (by this client's ``cancel`` or by the server)."""


class RequestQuarantinedError(PhalanxClientError):
    """The request crashed the workers that ran it (tokens already received stay valid), or is the same as one that
    did: the router refuses it until ``expires_in_s`` passes or an operator releases ``fingerprint``. Retrying it
    unchanged fails the same way."""

    def __init__(self, message: str, *, fingerprint: str, expires_in_s: float | None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.fingerprint = fingerprint
        self.expires_in_s = expires_in_s


# The router's ErrorInfo reason for a quarantined request (phalanx.common.errors.REQUEST_QUARANTINED; the SDK imports
# nothing of the services).
_QUARANTINED = "REQUEST_QUARANTINED"
# The reason of the UnavailableError raised when every attempt reached a service that is not a router.
WRONG_PEER = "WRONG_PEER"
_WRONG_PEER_RETRY_AFTER_S = 1.0


class InternalError(PhalanxClientError):
    """The router failed in a way the caller cannot fix (INTERNAL, UNKNOWN, UNIMPLEMENTED …)."""


class StreamGapError(InternalError):
    """The router skipped token indexes; the stream cannot continue exactly once."""

    def __init__(self, *, expected_index: int, received_index: int, request_id: str) -> None:
        super().__init__(
            f"expected token index {expected_index}, received {received_index}",
            code=grpc.StatusCode.DATA_LOSS,
            reason="STREAM_GAP",
            request_id=request_id,
        )
        self.expected_index = expected_index
        self.received_index = received_index


_BY_CODE: dict[grpc.StatusCode, type[PhalanxClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
}


def rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status in the call's trailers, or None (absent or inconsistent)."""
    try:
        # AioRpcError has the sync grpc.Call accessors (code, details, trailing_metadata).
        return rpc_status.from_call(error)
    except (ValueError, TypeError, AttributeError):
        return None


def from_rpc_error(error: grpc.RpcError, *, request_id: str | None = None) -> PhalanxClientError:
    """The typed exception for a failed call (``grpc.aio.AioRpcError`` or a sync ``grpc.Call`` error)."""
    code = error.code()
    message = error.details() or code.name
    reason: str | None = None
    metadata: dict[str, str] = {}
    retry_after_s: float | None = None
    violations: list[tuple[str, str]] = []
    status = rich_status(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason or None
            metadata = dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
    kind = _BY_CODE.get(code, InternalError)
    common = {"code": code, "reason": reason, "request_id": request_id, "retry_after_s": retry_after_s}
    if reason == _QUARANTINED:
        expires = metadata.get("expires_in_s")
        return RequestQuarantinedError(
            message, fingerprint=metadata.get("fingerprint", ""), expires_in_s=float(expires) if expires else None, **common
        )
    if kind is InvalidArgumentError:
        return InvalidArgumentError(message, violations=violations, **common)
    return kind(message, **common)


def is_wrong_peer(error: grpc.RpcError) -> bool:
    """Whether a RouterService call reached a service that is not a router.

    Every router implements every RouterService method, so UNIMPLEMENTED means another service now listens at an
    address that was a router's: containers restarted together may be given each other's old IPs, and with mutual
    TLS the handshake still succeeds (every Phalanx server certificate names the same host, signed by the same CA).
    """
    return error.code() == grpc.StatusCode.UNIMPLEMENTED


def wrong_peer_error(error: grpc.RpcError, *, request_id: str | None = None) -> UnavailableError:
    """What the caller gets when the retries kept reaching services that are not routers: no router, try again."""
    return UnavailableError(
        f"the router's address is served by another service ({error.details() or 'UNIMPLEMENTED'})",
        code=grpc.StatusCode.UNAVAILABLE, reason=WRONG_PEER, request_id=request_id, retry_after_s=_WRONG_PEER_RETRY_AFTER_S,
    )
