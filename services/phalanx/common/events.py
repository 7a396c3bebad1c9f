"""Protobuf events over NATS with W3C trace context in the headers.

Events (load reports, KV residency) are best-effort and periodic: a later
report supersedes a lost one. So a publisher is never blocked for long and
never fails because NATS is away; the message is buffered by nats-py while
reconnecting, or dropped and counted once that buffer is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from phalanx.common.config import NatsConfig
from phalanx.common.errors import InvalidRequestError, PhalanxError
from phalanx.common.subjects import subject_kind, validate_worker_id, worker_id_from_subject
from phalanx.common.telemetry import extract_context, inject_headers
from phalanx.common.tls import ClientTls, identity_of_certificate

__all__ = ["EventBus", "EventBusError", "Handler", "MessageTooLargeError", "check_kv_event", "check_load_report", "check_tenant_usage_report"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Handler = Callable[[Any, str, Context], Awaitable[None]]

# nats-py frames a header block as "NATS/1.0\r\n" + "key: value\r\n"... + "\r\n".
_HEADER_OVERHEAD = len(b"NATS/1.0\r\n\r\n")


class EventBusError(PhalanxError):
    """Root of the event bus errors."""


class MessageTooLargeError(EventBusError, ValueError):
    """A message (headers included) exceeds the server's max_payload: a bug, not an outage."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes for {subject!r} exceed the NATS max_payload of {limit}")
        self.subject = subject
        self.size = size
        self.limit = limit


class _TlsRequiringClient(NatsClient):
    """A NATS client that refuses a server not offering TLS, before it sends anything (nats-py itself upgrades to TLS
    only when the server's INFO asks for it, so a plaintext impostor, or a TLS server's port misconfigured, would be
    spoken to in plaintext)."""

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and not info.get("tls_required"):  # nats-py upgrades only when the server requires it
            server = self._current_server.uri.netloc if self._current_server is not None else "?"
            raise nats.errors.Error(f"nats: the server at {server} does not offer TLS, and TLS is configured: refusing plaintext")
        await super()._process_info(info, initial_connection)


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if type(error).__name__ in text else f"{type(error).__name__}: {text}"


class _ConnectWatch:
    """The callbacks of one client's connection: what its attempts to connect saw (the error to report if startup fails,
    whether the server refused our identity) and the outages it reports afterwards."""

    def __init__(self, nc: NatsClient, name: str, *, tls_enabled: bool) -> None:
        self._nc = nc
        self._name = name
        self._tls_enabled = tls_enabled
        self.last_error: BaseException | None = None
        # The server refused our identity (its authorization, docs/security.md): no retry will change that.
        self.refused = asyncio.Event()
        self._warned: set[str] = set()

    async def on_error(self, error: Exception) -> None:
        # Called for every failed reconnect attempt; the state callbacks below
        # already report the outage once.
        log.debug("nats %s: %r", self._name, error)
        text = str(error).lower()
        if self.refused.is_set():
            return  # the refusal is the error to report, not the broken pipe that follows it
        if "authorization violation" in text and self._tls_enabled:  # plaintext: retried as before
            self.last_error = error
            self.refused.set()
            return
        if "permissions violation" in text and text not in self._warned:
            # A publish or subscription this identity is not allowed (the server drops it): a deployment error.
            self._warned.add(text)
            log.warning("nats %s: %s (the subjects this identity may use: phalanx.common.control_plane_acl)", self._name, error)
        # A TLS error says more than the reset that often follows it on a later attempt: it is kept.
        if self.last_error is None or isinstance(error, ssl.SSLError) or not isinstance(self.last_error, ssl.SSLError):
            self.last_error = error

    async def on_disconnected(self) -> None:
        if not self._nc.is_closed:  # close() reports a disconnect too
            log.warning("nats %s: disconnected, reconnecting", self._name)

    async def on_reconnected(self) -> None:
        log.info("nats %s: reconnected to %s", self._name, self._nc.connected_url.netloc if self._nc.connected_url else "?")


def _tls_options(config: NatsConfig, tls: ClientTls | None) -> dict[str, Any]:
    """nats-py's TLS arguments of ``config`` (none without TLS)."""
    tls_options: dict[str, Any] = {}
    if config.tls_enabled:
        # The context is made before connecting: a missing file is a configuration error, not an outage to retry.
        tls_options["tls"] = tls.ssl_context() if tls is not None else ssl.create_default_context()
        if tls is not None and tls.server_name:
            tls_options["tls_hostname"] = tls.server_name
    return tls_options


def _start_connecting(nc: NatsClient, config: NatsConfig, name: str, watch: _ConnectWatch, tls_options: dict[str, Any]
                      ) -> asyncio.Task[None]:
    """``nc``'s first connect, under way: it reconnects forever afterwards, with capped exponential backoff."""
    # nats-py retries the first connect forever when reconnecting is
    # allowed; the caller bounds it so that a wrong URL fails startup, not hangs it.
    return asyncio.ensure_future(
        nc.connect(
            servers=[s.strip() for s in config.url.split(",")],
            name=name,
            connect_timeout=config.connect_timeout_s,  # type: ignore[arg-type]  # nats-py annotates these seconds as int; floats work
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=config.initial_reconnect_wait_s,  # type: ignore[arg-type]  # nats-py annotates these seconds as int; floats work
            reconnect_to_server_handler=_backoff_handler(config),
            pending_size=config.pending_buffer_bytes,
            flush_timeout=config.publish_timeout_s,
            drain_timeout=config.drain_timeout_s,  # type: ignore[arg-type]  # nats-py annotates these seconds as int; floats work
            error_cb=watch.on_error,
            disconnected_cb=watch.on_disconnected,
            reconnected_cb=watch.on_reconnected,
            # Notice a silently dead server within seconds, not minutes.
            ping_interval=5,
            max_outstanding_pings=2,
            **tls_options,
        )
    )


async def _abandon(connecting: asyncio.Task[None], nc: NatsClient) -> None:
    """Give up a first connect that did not finish in time, and the client."""
    connecting.cancel()
    # Not awaited to the end: a TLS upgrade cut short by a server refusing our certificate can leave asyncio's
    # start_tls waiting forever, cancellation included (seen on CPython 3.11); the attempt is abandoned.
    await asyncio.wait({connecting}, timeout=1.0)
    closing = asyncio.ensure_future(_close_quietly(nc))
    await asyncio.wait({closing}, timeout=1.0)


def _startup_failure(config: NatsConfig, tls: ClientTls | None, watch: _ConnectWatch) -> str:
    """Why no server answered, as far as the attempts tell: the last error, and what to check for the usual causes."""
    last_error = watch.last_error
    why = f" (last error: {_describe(last_error)})" if last_error is not None else ""
    if watch.refused.is_set():
        identity = identity_of_certificate(tls.cert_file.read_bytes()) if tls is not None and tls.cert_file is not None else None
        why += (f": the server's authorization refused this client's certificate (identity {identity or '?'}); only "
                "the Phalanx services and admin may use NATS, tenants' `client` certificates may not (docs/security.md)")
    elif isinstance(last_error, ssl.SSLError) and not config.tls_enabled:
        why += ": the server requires TLS; set PHALANX_NATS_TLS_DIR or PHALANX_NATS_CA_FILE (and a client certificate)"
    elif isinstance(last_error, ConnectionResetError) and config.tls_enabled:
        # TLS 1.3: a server refusing the client certificate may close the connection before its alert is read.
        why += ": the server closed the TLS connection; if it wants a client certificate, does it trust the CA of ours?"
    return why


class EventBus:
    """A NATS connection that publishes and receives protobuf messages."""

    def __init__(self, nc: NatsClient, config: NatsConfig) -> None:
        """Use ``await EventBus.connect(...)``; this wraps an already connected client."""
        self._nc = nc
        self._config = config
        self._dropped = 0
        self._rejected: Counter[str] = Counter()
        self._closing: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, config: NatsConfig, *, name: str) -> EventBus:
        """Connect, retrying for ``config.startup_timeout_s``; afterwards reconnect forever.

        Raises ConnectionError if no server answered within the startup timeout.
        """
        tls = config.tls()
        tls_options = _tls_options(config, tls)
        nc = _TlsRequiringClient() if config.tls_enabled else NatsClient()
        watch = _ConnectWatch(nc, name, tls_enabled=config.tls_enabled)
        connecting = _start_connecting(nc, config, name, watch, tls_options)
        refusal = asyncio.ensure_future(watch.refused.wait())
        try:
            await asyncio.wait({connecting, refusal}, timeout=config.startup_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            connecting.cancel()
            raise
        finally:
            refusal.cancel()
        if not connecting.done():
            await _abandon(connecting, nc)
            raise ConnectionError(f"no NATS server answered at {config.url}{_startup_failure(config, tls, watch)}")
        connecting.result()
        return cls(nc, config)

    @property
    def connected(self) -> bool:
        """True while a server connection is up (False while reconnecting or closed)."""
        return self._nc.is_connected

    @property
    def dropped(self) -> int:
        """Messages given up because the bus was away, full, slow or closed."""
        return self._dropped

    @property
    def rejected(self) -> dict[str, int]:
        """Messages received and refused (undecodable, or failing their checks), by subject kind (``subject_kind``)."""
        return dict(self._rejected)

    @property
    def max_payload(self) -> int:
        """The server's limit for one message, headers included."""
        return self._nc.max_payload

    async def publish(self, subject: str, message: Message) -> None:
        """Serialize and publish ``message`` with the current trace context.

        Never raises for an unreachable or closed bus (the message is counted in
        ``dropped``); raises MessageTooLargeError for an oversized message.
        """
        payload = message.SerializeToString()
        headers = inject_headers()
        size = len(payload) + _HEADER_OVERHEAD + sum(len(k) + len(v) + 4 for k, v in headers.items())
        # The server resets the connection for an oversized message (headers
        # count), which would cost every publisher a reconnect: refuse it here.
        if size > self._nc.max_payload:
            raise MessageTooLargeError(subject, size, self._nc.max_payload)
        if self._closing is not None or self._nc.is_closed:
            self._drop(subject, "closed")
            return
        try:
            async with asyncio.timeout(self._config.publish_timeout_s):
                await self._nc.publish(subject, payload, headers=headers or None)
        except nats.errors.OutboundBufferLimitError:
            self._drop(subject, "reconnect buffer full")
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            self._drop(subject, "closed")
        except TimeoutError:
            # The message may still be in nats-py's buffer; count it as lost
            # because the caller cannot rely on it.
            self._drop(subject, "publish timed out")

    def _drop(self, subject: str, why: str) -> None:
        self._dropped += 1
        log.debug("dropped a message for %s: %s (%d dropped)", subject, why, self._dropped)

    async def subscribe(
        self,
        subject: str,
        message_type: type[M],
        handler: Callable[[M, str, Context], Awaitable[None]],
        *,
        check: Callable[[M], None] | None = None,
        on_rejected: Callable[[str], None] | None = None,
    ) -> Subscription:
        """Call ``await handler(message, subject, context)`` for each message on ``subject``.

        ``subject`` may hold wildcards. ``context`` is the publisher's trace
        context: start spans with ``tracer.start_as_current_span(..., context=context)``.
        Messages of one subscription are handled one at a time, in order.

        A message is rejected, never handed to ``handler``, when it does not
        parse, when on a per-worker subject (``phalanx.kv.<id>`` …) its
        ``worker_id`` is not that worker's, or when ``check`` raises
        InvalidRequestError for it (a handler may raise it too); rejections
        are counted in ``rejected`` and passed to ``on_rejected`` (the subject
        kind), for the service's metric. A handler that raises anything else
        is logged and the message skipped. Returns the nats-py subscription
        (``await sub.unsubscribe()``).
        """

        def reject(msg: Msg, why: str) -> None:
            kind = subject_kind(msg.subject)
            self._rejected[kind] += 1
            if on_rejected is not None:
                on_rejected(kind)
            log.warning("rejected a %s on %s (%d bytes): %s", message_type.__name__, msg.subject, len(msg.data), why)

        async def on_message(msg: Msg) -> None:
            message = message_type()
            try:
                message.ParseFromString(msg.data)
                _check_sender(message, msg.subject)
                if check is not None:
                    check(message)
            except DecodeError:
                reject(msg, "does not parse")
                return
            except InvalidRequestError as error:
                reject(msg, str(error))
                return
            try:
                await handler(message, msg.subject, extract_context(msg.headers))
            except InvalidRequestError as error:
                reject(msg, str(error))
            except Exception:
                # One bad message must not stop the subscription; nats-py would
                # only pass the error to error_cb, which logs at debug level.
                log.exception("handler for %s failed", msg.subject)

        return await self._nc.subscribe(subject, cb=on_message)

    async def flush(self, timeout: float = 2.0) -> None:  # nats-py's own deadline
        """Wait until the server has processed everything sent so far (for tests and shutdown)."""
        await self._nc.flush(timeout=timeout)  # type: ignore[arg-type]  # nats-py annotates seconds as int; floats work

    async def close(self) -> None:
        """Drain subscriptions and pending publishes, then close; idempotent and safe to race."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._nc.is_closed:
            return
        if self._nc.is_connected:
            try:
                await self._nc.drain()
                return
            except (nats.errors.Error, OSError, TimeoutError) as error:
                log.debug("drain failed, closing: %r", error)
        # Reconnecting or the server is gone: nothing can be drained, just stop.
        try:
            await self._nc.close()
        except (nats.errors.Error, OSError) as error:
            log.debug("close on a lost connection: %r", error)

    async def __aenter__(self) -> EventBus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _check_sender(message: Message, subject: str) -> None:
    """A message on a per-worker subject speaks for that worker: its ``worker_id``, where it has one, must be the subject's."""
    if "worker_id" not in message.DESCRIPTOR.fields_by_name:
        return
    try:
        expected = worker_id_from_subject(subject)
    except ValueError:
        return  # not a per-worker subject
    claimed = getattr(message, "worker_id")  # noqa: B009 - a field found by name in the descriptor, of any message type
    if claimed != expected:
        raise InvalidRequestError("worker_id", f"{claimed[:64]!r} on the subject of worker {expected!r}")


def check_load_report(report: Any) -> None:
    """A LoadReport's numbers are counts and rates: none negative, none NaN or infinite, free blocks within the total."""
    for name in ("queue_depth", "running_seqs", "free_blocks", "total_blocks"):
        if getattr(report, name) < 0:
            raise InvalidRequestError(name, f"{getattr(report, name)} is negative")
    if report.total_blocks and report.free_blocks > report.total_blocks:
        raise InvalidRequestError("free_blocks", f"{report.free_blocks} free of {report.total_blocks} blocks")
    for name in ("step_time_ms", "prefill_tokens_per_s", "decode_tokens_per_s"):
        value = getattr(report, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidRequestError(name, f"{value} is not a finite number >= 0")


# A TenantUsageReport's interval: receivers hold its usage for a few of them, so a sender cannot pin it for long.
MAX_USAGE_INTERVAL_S = 10.0


def check_tenant_usage_report(report: Any) -> None:
    """A TenantUsageReport names its router, has an interval in (0, MAX_USAGE_INTERVAL_S] s, and counts none negative."""
    try:
        validate_worker_id(report.router_id)
    except ValueError as error:
        raise InvalidRequestError("router_id", str(error)) from None
    if not report.incarnation:
        raise InvalidRequestError("incarnation", "is empty")
    if not (math.isfinite(report.interval_s) and 0 < report.interval_s <= MAX_USAGE_INTERVAL_S):
        raise InvalidRequestError("interval_s", f"{report.interval_s} is not in (0, {MAX_USAGE_INTERVAL_S:g}] s")
    for i, usage in enumerate(report.tenants):
        if not usage.tenant:
            raise InvalidRequestError(f"tenants[{i}].tenant", "is empty")
        if usage.streams < 0:
            raise InvalidRequestError(f"tenants[{i}].streams", f"{usage.streams} is negative")
        if not (math.isfinite(usage.tokens_recent) and usage.tokens_recent >= 0):
            raise InvalidRequestError(f"tenants[{i}].tokens_recent", f"{usage.tokens_recent} is not a finite number >= 0")


def check_kv_event(event: Any) -> None:
    """A KvEvent's stored blocks hold 1 token at least (a block's worth at most is the index's business)."""
    for i, block in enumerate(event.stored):
        if block.num_tokens < 1:
            raise InvalidRequestError(f"stored[{i}].num_tokens", f"{block.num_tokens} is not a token count")


def _backoff_handler(config: NatsConfig) -> Callable[..., tuple[Any, float]]:
    """A nats-py reconnect handler: capped exponential backoff with full jitter.

    nats-py's own ``reconnect_time_wait`` is a fixed delay; a fixed delay is
    either slow to recover or hammers a restarting server with every client.
    """

    def choose(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        server = min(servers, key=lambda s: s.reconnects)
        ceiling = min(config.max_reconnect_wait_s, config.initial_reconnect_wait_s * 2 ** min(server.reconnects, 30))
        # The first retry is immediate-ish: most outages are a restart on the same port.
        delay = random.uniform(ceiling / 2, ceiling)
        return server, delay

    return choose


async def _close_quietly(nc: NatsClient) -> None:
    with contextlib.suppress(nats.errors.Error, OSError):
        await nc.close()
