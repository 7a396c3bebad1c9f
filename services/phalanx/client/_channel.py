"""The gRPC channel to the router replicas, and the metadata every call carries."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from phalanx.client._config import RetryPolicy, TlsConfig

SERVICE = "phalanx.router.v1.RouterService"
MAX_RECEIVE_BYTES = 16 * 1024 * 1024


def service_config(retry: RetryPolicy) -> str:
    """round_robin over the router replicas; gRPC retries the idempotent unary calls.

    round_robin keeps a connection to every replica a target names, so when one
    dies the resume goes to a live one at once (pick_first would first have to
    notice the loss and walk the address list) and load is spread. Generate and
    Resume are left out of gRPC's retryPolicy: their retries are the SDK's own,
    explicit and exactly-once.
    """
    policy = {
        "maxAttempts": min(5, retry.max_attempts),  # gRPC caps maxAttempts at 5
        "initialBackoff": f"{retry.initial_backoff_s}s",
        "maxBackoff": f"{retry.max_backoff_s}s",
        "backoffMultiplier": retry.multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    unary = [{"service": SERVICE, "method": name} for name in ("Cancel", "ListWorkers")]
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if retry.max_attempts > 1:
        config["methodConfig"] = [{"name": unary, "retryPolicy": policy}]
    return json.dumps(config)


def channel_options(retry: RetryPolicy, tls: TlsConfig | None, extra: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """Defaults for a client of a service that restarts: reconnect fast, notice dead peers."""
    options: dict[str, Any] = {
        "grpc.service_config": service_config(retry),
        "grpc.enable_retries": 1,
        # A restarted router is back in well under a second; the default 1 s .. 120 s is far too slow.
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 2000,
        # Pings while a call is open find a router whose host vanished without a FIN/RST.
        # Routers must allow pings this often (grpc.http2.min_recv_ping_interval_without_data_ms).
        "grpc.keepalive_time_ms": 20_000,
        "grpc.keepalive_timeout_ms": 10_000,
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.max_receive_message_length": MAX_RECEIVE_BYTES,
        "grpc.primary_user_agent": "phalanx-client",
    }
    if tls is not None and tls.server_name_override:
        options["grpc.ssl_target_name_override"] = tls.server_name_override
    options.update(dict(extra or ()))
    return list(options.items())


def open_channel(
    target: str, *, tls: bool | TlsConfig | None, retry: RetryPolicy, extra_options: Sequence[tuple[str, Any]] | None
) -> grpc.aio.Channel:
    """A grpc.aio channel bound to the running event loop."""
    config = TlsConfig() if tls is True else (tls or None)
    options = channel_options(retry, config, extra_options)
    if config is None:
        return grpc.aio.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=config.root_certificates,
        private_key=config.private_key,
        certificate_chain=config.certificate_chain,
    )
    return grpc.aio.secure_channel(target, credentials, options=options)


_inject: Any = None


def _trace_injector():
    # Imported on first use: opentelemetry is optional and its import scans entry points.
    global _inject
    if _inject is None:
        try:
            from opentelemetry.propagate import inject
        except ImportError:
            _inject = False
        else:
            _inject = inject
    return _inject


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The API key and, when OpenTelemetry is installed, the caller's W3C trace context."""
    metadata: dict[str, str] = {}
    inject = _trace_injector()
    if inject:
        inject(metadata)
    if api_key:
        metadata["authorization"] = f"Bearer {api_key}"
    return tuple((key.lower(), value) for key, value in metadata.items())
