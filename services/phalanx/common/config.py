"""Settings shared by every service, one pydantic-settings model per concern.

Every field reads one environment variable: ``PHALANX_NATS_URL``,
``PHALANX_ETCD_LEASE_TTL_S``, ``PHALANX_TELEMETRY_OTLP_ENDPOINT`` and so on.
Models are frozen so that a config passed down whole cannot drift between
the components that share it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from phalanx.common.tls import ClientTls

__all__ = ["EtcdConfig", "NatsConfig", "TelemetryConfig"]

_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


class _ServerTlsClient(BaseSettings):
    """TLS settings of a connection to a server of our own (NATS, etcd), shared by their configs.

    ``server_kind`` names the server in messages, and ``model_config``'s env_prefix its variables.
    """

    server_kind: ClassVar[str] = ""

    tls_dir: str = Field(
        "",
        description=(
            "Directory with ca.crt, tls.crt and tls.key (a cert-manager secret) for TLS to the server: the CA that signs "
            "its certificate and this process's client certificate. Any TLS setting turns TLS on."
        ),
    )
    ca_file: str = Field(
        "", description="PEM CA bundle that signs the server's certificate (instead of <tls_dir>/ca.crt; neither: the system's roots)."
    )
    cert_file: str = Field("", description="PEM client certificate presented to the server (mTLS), instead of <tls_dir>/tls.crt.")
    key_file: str = Field("", description="PEM private key of cert_file, instead of <tls_dir>/tls.key.")
    tls_server_name: str = Field(
        "",
        description=(
            "Name the server's certificate is checked against instead of the host dialled (default: that host; etcd with "
            "several members: the first one's, which every member's certificate must carry)."
        ),
    )

    @model_validator(mode="after")
    def _check_tls(self) -> _ServerTlsClient:
        self.tls()  # a certificate without its key (or the reverse) is refused at once
        return self

    def tls(self) -> ClientTls | None:
        """The TLS files of the connection; None: no TLS setting."""
        from phalanx.common.tls import resolve_client_tls

        return resolve_client_tls(
            self.server_kind, tls_dir=self.tls_dir, ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file,
            server_name=self.tls_server_name,
        )

    def tls_env(self) -> dict[str, str]:
        """This config's TLS variables, for a child process to reach the same server."""
        prefix = self.model_config.get("env_prefix", "")
        values = {"TLS_DIR": self.tls_dir, "CA_FILE": self.ca_file, "CERT_FILE": self.cert_file, "KEY_FILE": self.key_file,
                  "TLS_SERVER_NAME": self.tls_server_name}
        return {f"{prefix}{name}": value for name, value in values.items() if value}


class NatsConfig(_ServerTlsClient):
    """How a service reaches NATS (env prefix ``PHALANX_NATS_``)."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_NATS_", extra="forbid", frozen=True)
    server_kind: ClassVar[str] = "NATS"

    url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL; several may be given comma-separated for a cluster.",
    )
    connect_timeout_s: float = Field(2.0, gt=0, le=60, description="Timeout of one TCP connect + handshake attempt.")
    startup_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="How long EventBus.connect keeps retrying before it raises ConnectionError.",
    )
    initial_reconnect_wait_s: float = Field(
        0.05, gt=0, le=10, description="First delay of the exponential reconnect backoff."
    )
    max_reconnect_wait_s: float = Field(
        2.0, gt=0, le=60, description="Cap of the exponential reconnect backoff (jittered)."
    )
    pending_buffer_bytes: int = Field(
        2 * 1024 * 1024,
        ge=0,
        le=1024 * 1024 * 1024,
        description="Bytes buffered while disconnected; a publish beyond it is dropped and counted.",
    )
    publish_timeout_s: float = Field(
        0.25, gt=0, le=30, description="Longest a publish may block its caller before it is dropped."
    )
    drain_timeout_s: float = Field(2.0, gt=0, le=300, description="Longest close() waits for subscriptions to drain.")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        for part in value.split(","):
            if not re.match(r"^(nats|tls|ws|wss)://[^/\s]+", part.strip()):
                raise ValueError(f"not a NATS URL: {part!r} (expected nats://host:port)")
        return value

    @model_validator(mode="after")
    def _check_backoff(self) -> NatsConfig:
        if self.initial_reconnect_wait_s > self.max_reconnect_wait_s:
            raise ValueError("initial_reconnect_wait_s must not exceed max_reconnect_wait_s")
        return self

    @property
    def tls_enabled(self) -> bool:
        """Whether the connection must be TLS: a TLS setting or a ``tls://`` URL (which alone uses the system's roots)."""
        return bool(self.tls_dir or self.ca_file or self.cert_file or self.key_file) or any(
            part.strip().startswith("tls://") for part in self.url.split(",")
        )


class EtcdConfig(_ServerTlsClient):
    """How a service reaches etcd and keeps its leases (env prefix ``PHALANX_ETCD_``)."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_ETCD_", extra="forbid", frozen=True)
    server_kind: ClassVar[str] = "etcd"

    endpoint: str = Field(
        "127.0.0.1:2379",
        description=(
            "etcd client endpoint as host:port, or the members of a cluster as host:port,host:port,... "
            "(requests spread over the members that answer; a member that dies is skipped)."
        ),
    )
    lease_ttl_s: int = Field(
        2,
        ge=1,
        le=3600,
        description=(
            "Lease TTL: how long a dead owner's keys outlive it. 1 s needs etcd started "
            "with --election-timeout 500 --heartbeat-interval 50; default etcd rounds it up to 2 s."
        ),
    )
    keepalive_interval_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Seconds between keepalives on the lease stream; unset = lease_ttl_s / 4.",
    )
    request_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Deadline of one unary etcd request (grant, put, get, revoke)."
    )
    max_retry_wait_s: float = Field(
        1.0, gt=0, le=60, description="Cap of the backoff between attempts to re-register a lost lease."
    )
    startup_timeout_s: float = Field(
        15.0,
        ge=0,
        le=600,
        description=(
            "How long a starting service keeps trying to register in etcd (an etcd still starting, or too busy to "
            "answer in time); past it, an unreachable etcd is taken for a wrong endpoint and the service exits."
        ),
    )

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        for part in value.split(","):
            match = _HOST_PORT.match(part.strip())
            if match is None or not 0 < int(match.group(1)) < 65536:
                raise ValueError(f"etcd endpoint must be host:port or host:port,host:port,..., got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_interval(self) -> EtcdConfig:
        # A keepalive slower than the TTL lets the lease expire between two beats.
        if self.keepalive_interval_s is not None and self.keepalive_interval_s >= self.lease_ttl_s:
            raise ValueError("keepalive_interval_s must be shorter than lease_ttl_s")
        return self

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """Every member's (host, port), in the order given."""
        pairs = (part.strip().rsplit(":", 1) for part in self.endpoint.split(","))
        return [(host.strip("[]"), int(port)) for host, port in pairs]

    @property
    def host(self) -> str:
        """Host part of the first endpoint."""
        return self.endpoints[0][0]

    @property
    def port(self) -> int:
        """Port part of the first endpoint."""
        return self.endpoints[0][1]

    @property
    def effective_keepalive_interval_s(self) -> float:
        """The keepalive period actually used: the setting, or a quarter of the TTL."""
        return self.keepalive_interval_s or self.lease_ttl_s / 4


class TelemetryConfig(BaseSettings):
    """Tracing settings (env prefix ``PHALANX_TELEMETRY_``)."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_TELEMETRY_", extra="forbid", frozen=True)

    otlp_endpoint: str | None = Field(
        None,
        description=(
            "OTLP/gRPC collector, e.g. http://jaeger:4317. Unset: spans are still created "
            "and propagated (trace ids in logs, NATS and gRPC) but never exported."
        ),
    )
    otlp_insecure: bool = Field(True, description="Plaintext gRPC to the collector (no TLS).")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of new traces sampled; children follow their parent."
    )
