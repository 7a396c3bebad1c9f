"""The table at every servicer boundary: domain errors -> gRPC status with google.rpc details."""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from phalanx.common.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidRequestError,
    NotFoundError,
    PhalanxError,
    ResourceExhaustedError,
    UnavailableError,
)

DOMAIN = "phalanx.dev"

_CODES: list[tuple[type[PhalanxError], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
]


def to_status(error: PhalanxError) -> grpc.Status:
    code = next((c for kind, c in _CODES if isinstance(error, kind)), grpc.StatusCode.INTERNAL)
    details = [error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN)]
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
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=str(error))
    for detail in details:
        status.details.add().Pack(detail)
    return rpc_status.to_status(status)


async def abort_with(context: grpc.aio.ServicerContext, error: PhalanxError) -> None:
    """Ends the RPC with the status for `error` (raises, as context.abort does)."""
    await context.abort_with_status(to_status(error))
