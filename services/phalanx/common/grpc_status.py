"""The table at every servicer boundary: domain errors -> gRPC status with google.rpc details.

``DomainErrorInterceptor`` applies it to every RPC of a server, so handlers
raise ``PhalanxError`` and never abort by hand; ``phalanx.common.service``
installs it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from phalanx.common.errors import (
    AuthenticationError,
    EngineDeadError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    PhalanxError,
    ResourceExhaustedError,
    TenantLimitError,
    UnavailableError,
)

__all__ = ["DOMAIN", "DomainErrorInterceptor", "abort_with", "to_status"]

DOMAIN = "phalanx.dev"

_CODES: list[tuple[type[PhalanxError], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
]


def to_status(error: PhalanxError) -> grpc.Status:
    code = next((c for kind, c in _CODES if isinstance(error, kind)), grpc.StatusCode.INTERNAL)
    metadata = error.metadata if isinstance(error, FailedPreconditionError | TenantLimitError) else None
    details: list[Any] = [error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=metadata)]
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_after * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    if isinstance(error, InvalidRequestError):
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description) for v in error.violations
                ]
            )
        )
    if isinstance(error, FailedPreconditionError):
        details.append(
            error_details_pb2.PreconditionFailure(
                violations=[
                    error_details_pb2.PreconditionFailure.Violation(type=error.reason, subject=error.subject, description=str(error))
                ]
            )
        )
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=_clamped(str(error)))
    for detail in details:
        status.details.add().Pack(detail)
    return rpc_status.to_status(status)


# Status messages travel in a trailer (grpc-message), and metadata beyond 8 KiB fails the whole call on the client: a
# message that quotes a client's oversized value is cut, whatever raised it.
_MESSAGE_LIMIT = 1024


def _clamped(message: str) -> str:
    return message if len(message) <= _MESSAGE_LIMIT else f"{message[: _MESSAGE_LIMIT - 40]}… ({len(message)} characters, cut)"


async def abort_with(context: grpc.aio.ServicerContext, error: PhalanxError) -> None:
    """Ends the RPC with the status for `error` (raises, as context.abort does)."""
    await context.abort_with_status(to_status(error))


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """Ends an RPC whose handler raised a ``PhalanxError`` with ``to_status(error)``.

    Works for all four call kinds and both handler styles: coroutines (also
    streaming ones that write through the context, like grpc.health's Watch)
    and async generators, which may raise after some responses went out. Sync
    handlers are left as they are (no service here has any). Install it after
    the telemetry interceptor, so that the span sees the abort as it did when
    handlers aborted themselves.
    """

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        behavior_name, make_handler = _HANDLER_KINDS[handler.request_streaming, handler.response_streaming]
        behavior = getattr(handler, behavior_name)
        guarded = _guarded(behavior, request_streaming=handler.request_streaming)
        if guarded is behavior:  # a sync handler: left as it is, undecodable requests included
            return handler
        return make_handler(guarded, _lenient(handler.request_deserializer), handler.response_serializer)


class _Undecodable:
    """A request whose bytes did not parse: the handler never sees it, the caller gets INVALID_ARGUMENT.

    gRPC itself would answer such a request INTERNAL ("Exception deserializing request!") and log a
    traceback: a malformed request is the caller's fault, and says so.
    """

    def __init__(self, error: Exception) -> None:
        self.error = InvalidRequestError("request", f"does not parse as this method's protobuf message ({error})")


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # noqa: BLE001 - any parse failure (DecodeError, a UnicodeDecodeError …) is the request's
            return _Undecodable(error)

    return parse


async def _decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream that raises (into the handler's loop) at its first undecodable message."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.error
        yield request


# (request_streaming, response_streaming) -> the RpcMethodHandler attribute holding the behavior, and its constructor.
_HANDLER_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _guarded(behavior: Callable[..., Any], *, request_streaming: bool) -> Callable[..., Any]:
    """`behavior` with its PhalanxErrors turned into status; of the same kind, as gRPC picks how to run it by its kind."""

    def checked(request: Any) -> Any:
        if request_streaming:
            return _decoded(request)
        if isinstance(request, _Undecodable):
            raise request.error
        return request

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                request = checked(request)
                # aclosing: a client that leaves mid-stream closes the handler's generator now, not at its collection.
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except PhalanxError as error:
                await abort_with(context, error)

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(checked(request), context)
            except PhalanxError as error:
                await abort_with(context, error)

        return call
    return behavior
