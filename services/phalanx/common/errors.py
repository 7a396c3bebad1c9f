"""Domain errors shared by every service, and their one mapping to gRPC status.

Recoverable errors (the request may be retried or fixed) are named apart
from fatal ones (the engine itself is gone), as vLLM does with
EngineGenerateError vs EngineDeadError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class PhalanxError(Exception):
    """Root of every error Phalanx raises on purpose."""

    reason = "PHALANX_ERROR"


@dataclass
class FieldViolation:
    field: str
    description: str


class InvalidRequestError(PhalanxError):
    """The caller sent something we cannot serve; retrying it unchanged will fail again."""

    reason = "INVALID_REQUEST"

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.violations = [FieldViolation(field, description)]


class ResourceExhaustedError(PhalanxError):
    """Deliberate backpressure: too much queued or too large; retry after `retry_after_s`."""

    reason = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantLimitError(ResourceExhaustedError):
    """A tenant is over one of its limits (streams in flight, tokens per minute), or waited too long for a full router.

    ``limit`` names the setting (``max_streams``, ``tokens_per_minute``, ``queue``); both go into the status's ErrorInfo.
    """

    reason = "TENANT_LIMIT"

    def __init__(self, message: str, *, tenant: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.tenant = tenant
        self.limit = limit
        self.metadata = {"tenant": tenant, "limit": limit}


class UnavailableError(PhalanxError):
    """Temporarily unable to serve (draining, no worker); retry elsewhere or later."""

    reason = "UNAVAILABLE"

    def __init__(self, message: str, *, retry_after_s: float = 0.5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(PhalanxError):
    """The engine loop died; nothing on this worker can be served any more."""

    reason = "ENGINE_DEAD"


class NotFoundError(PhalanxError):
    """The named thing (a request to resume, a worker) is not known, or no longer."""

    reason = "NOT_FOUND"


class FailedPreconditionError(PhalanxError):
    """The system is not in the state the call needs (e.g. KV asked beyond what is committed) until something else changes it.

    ``subject`` names what is not ready; ``metadata`` goes into the status's ErrorInfo.
    """

    reason = "FAILED_PRECONDITION"

    def __init__(self, message: str, *, subject: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.subject = subject
        self.metadata = dict(metadata or {})


# FailedPreconditionError subject of a worker that could not fetch a request's media embeddings from the encoder holding
# them (direct delivery): the router encodes them again and resends the request.
MEDIA_SOURCE_SUBJECT = "media.source"


# The ErrorInfo reason of a request the router quarantined (it killed the workers that ran it), mid-stream or at the gate.
REQUEST_QUARANTINED = "REQUEST_QUARANTINED"


class RequestQuarantinedError(FailedPreconditionError):
    """The request crashed the workers that ran it, or is the same as one that did: it is not served again until its
    fingerprint's quarantine ends (``expires_in_s``) or an operator releases it (``phalanx quarantine release``)."""

    reason = REQUEST_QUARANTINED

    def __init__(self, message: str, *, fingerprint: str, crashes: int, expires_in_s: float) -> None:
        super().__init__(
            message, subject="request.fingerprint",
            metadata={"fingerprint": fingerprint, "crashes": str(crashes), "expires_in_s": f"{max(expires_in_s, 0.0):.0f}"},
        )
        self.fingerprint = fingerprint
        self.crashes = crashes
        self.expires_in_s = expires_in_s


class AuthenticationError(PhalanxError):
    """Missing or unknown credentials."""

    reason = "UNAUTHENTICATED"


class RequestShedError(ResourceExhaustedError):
    """Refused by graceful degradation (its tier is shed at the current level); retry later."""

    reason = "REQUEST_SHED"


class OverCapacityError(ResourceExhaustedError):
    """SLO-aware admission refused a new request: it could not start within its tier's TTFT SLO (phalanx.router.overload);
    ``retry_after_s`` is how long the queue ahead of it takes to drain."""

    reason = "OVER_CAPACITY"


class PermissionDeniedError(PhalanxError):
    """The caller's identity (from its client certificate) may not make this call; see phalanx.common.authz."""

    reason = "PERMISSION_DENIED"

    def __init__(self, *, method: str, identity: str | None) -> None:
        who = f"identity {identity!r}" if identity else "a caller without a Phalanx certificate identity"
        super().__init__(f"{method} is not allowed for {who}: it is internal to Phalanx (services or an admin certificate only)")
        self.method = method
        self.identity = identity
