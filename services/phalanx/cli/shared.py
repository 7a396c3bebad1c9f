"""What the `phalanx` commands share: option declarations, the one logging setup, the options given."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import typer

T = TypeVar("T")

__all__ = [
    "ApiKey",
    "AsJson",
    "ClientStateFile",
    "EtcdEndpoint",
    "LogLevel",
    "NatsUrl",
    "StateFile",
    "Target",
    "given",
    "setup_logging",
]

# A service's connection to the shared infrastructure; unset, its env var or default (pydantic-settings) holds.
EtcdEndpoint = Annotated[
    str | None, typer.Option(help="etcd host:port, or a cluster's members as host:port,host:port,... [env PHALANX_ETCD_ENDPOINT]")
]
NatsUrl = Annotated[str | None, typer.Option(help="NATS URL [env PHALANX_NATS_URL]")]
LogLevel = Annotated[str, typer.Option()]

# The client commands: which router, as whom, and the local stack's state file that names its router.
Target = Annotated[
    str | None,
    typer.Option(envvar="PHALANX_TARGET", help="Router host:port [default: the running `phalanx up`'s router, else 127.0.0.1:50051]"),
]
ApiKey = Annotated[str | None, typer.Option(envvar="PHALANX_API_KEY", help="API key, if the router requires one")]
ClientStateFile = Annotated[str | None, typer.Option(envvar="PHALANX_STATE_FILE", help="State file to find the router in")]
StateFile = Annotated[str | None, typer.Option(envvar="PHALANX_STATE_FILE", help="State file [default: ~/.phalanx/up.json]")]

AsJson = Annotated[bool, typer.Option("--json", help="Print JSON only")]


def setup_logging(level: str) -> None:
    """A service process's logging: records at `level` and above to stderr, with their time, level and logger."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def given(**values: Any) -> dict[str, Any]:
    """Options given on the command line; the rest come from env vars or defaults."""
    return {k: v for k, v in values.items() if v not in (None, "")}


async def with_etcd(endpoint: str | None, action: Callable[[Any], Awaitable[T]]) -> T:
    """`action(client)` with an etcd client of the endpoint given (else PHALANX_ETCD_ENDPOINT), closed after."""
    from phalanx.common.config import EtcdConfig
    from phalanx.common.lease import connect_etcd

    client = connect_etcd(EtcdConfig(**given(endpoint=endpoint)))
    try:
        return await action(client)
    finally:
        await client.close()
