"""HTTP shell of the gateway: OpenAI's routes on FastAPI, each request one SDK stream through the routers.

The SDK resumes a stream that breaks (a router dies) at the next token, so
the HTTP client sees every token once whatever happens behind the gateway.
Errors are answered before any byte of a stream: the first token is awaited
before the 200 and the SSE headers go out, so a refusal (bad parameter, shed,
no worker) keeps its HTTP status. A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from phalanx.client import Chunk, Client, GenerateStream, NotFoundError, PhalanxClientError, PositionLogprobs, RetryPolicy
from phalanx.common.telemetry import extract_context, get_tracer
from phalanx.common.tls import sdk_tls
from phalanx.gateway.auth import TIER_HEADER, Caller, KeyRing
from phalanx.gateway.config import GatewayConfig
from phalanx.gateway.errors import GatewayError, bad_request, from_client_error
from phalanx.gateway.metrics import GatewayMetrics
from phalanx.gateway.responses import CHAT, COMPLETIONS, Dialect, LogprobsShape, finish_reason
from phalanx.gateway.schema import ChatCompletionRequest, CompletionRequest, GenerateArgs, chat_text, parse_body
from phalanx.gateway.stream_ids import StreamCursor
from phalanx.model.chat import ChatPrompts
from phalanx.model.config import served_model as tokenizer_model

__all__ = ["GatewayServer", "RouterClients", "build_app"]

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)
T = TypeVar("T")

_LIST_WORKERS_TIMEOUT_S = 5.0
_NO_MODEL_RETRY_AFTER_S = 1.0
# The gRPC limit of one router request; a larger HTTP body could not be forwarded anyway.
_MAX_BODY_BYTES = 4 * 1024 * 1024


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


class RouterClients:
    """One SDK client per API key the gateway forwards (keys ride on the channel), made on first use."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._retry = RetryPolicy(max_attempts=config.retry_max_attempts)
        self._clients: dict[str | None, Client] = {}
        self._closed = False

    async def get(self, api_key: str | None) -> Client:
        client = self._clients.get(api_key)
        if client is None:
            if self._closed:
                raise GatewayError(503, "the gateway is shutting down", kind="server_error", code="shutting_down", retry_after_s=1.0)
            made = await Client.connect(
                self._config.router, api_key=api_key, tls=sdk_tls(), timeout=self._config.request_timeout_s, retry=self._retry
            )
            client = self._clients.setdefault(api_key, made)
            if client is not made:
                await made.close()
        return client

    def wrong_peers(self) -> int:
        """Router calls of every client so far that reached another service (the SDK dropped the channel and retried)."""
        return sum(client.wrong_peers for client in list(self._clients.values()))

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()


class _ChatPrompts:
    """The served model's ChatPrompts, with the gateway's errors."""

    def __init__(self, model: str) -> None:
        self.prompts = ChatPrompts.for_model(model)

    def render(self, messages: list[dict[str, str]]) -> str:
        return chat_text(messages, self.prompts)


class GatewayServer:
    """What the routes do: authenticate, parse, render, call the SDK, shape the answer, count it."""

    def __init__(self, config: GatewayConfig, clients: RouterClients, metrics: GatewayMetrics) -> None:
        self.config = config
        self.clients = clients
        self.metrics = metrics
        self.keyring = KeyRing(config.tenants, config.api_keys, router_api_key=config.router_api_key)
        self.started_at = int(time.time())
        self.stopping = False
        self._reported_model = ""
        self._chat: _ChatPrompts | None = None

    # -- the served model ----------------------------------------------------------------
    async def _workers_model(self, client: Client) -> str:
        """The model the router's workers report (asked once)."""
        if not self._reported_model:
            try:
                workers = await client.list_workers(timeout=_LIST_WORKERS_TIMEOUT_S)
            except PhalanxClientError as error:
                raise from_client_error(error) from None
            models = sorted({w.model for w in workers if w.model})
            if not models:
                raise GatewayError(
                    503, "no worker is registered yet, so the served model is unknown", kind="server_error", code="unavailable",
                    retry_after_s=_NO_MODEL_RETRY_AFTER_S,
                )
            self._reported_model = models[0]
        return self._reported_model

    async def served_model(self, client: Client) -> str:
        """The model id clients name: served_model_name, else model, else the workers' model."""
        return self.config.served_model_name or self.config.model or await self._workers_model(client)

    async def _check_model(self, client: Client, asked: str) -> str:
        served = await self.served_model(client)
        if asked != served:
            raise GatewayError(
                404, f"the model {asked!r} does not exist; this gateway serves {served!r}", kind="invalid_request_error", param="model",
                code="model_not_found",
            )
        return served

    async def _chat_prompts(self, client: Client) -> _ChatPrompts:
        if self._chat is None:
            # Simulated workers (sim:<model>) use their profiled model's tokenizer and chat template.
            model = self.config.model or tokenizer_model(await self._workers_model(client))
            try:
                self._chat = await asyncio.to_thread(_ChatPrompts, model)
            except ValueError as error:
                raise GatewayError(
                    500, f"cannot load the tokenizer of {model!r} for its chat template ({error}); start the gateway with "
                    "--model <checkpoint directory>", kind="server_error", code="chat_template",
                ) from None
        return self._chat

    # -- routes ------------------------------------------------------------------------------
    async def models(self, request: Request) -> dict[str, Any]:
        _, key = self.keyring.authenticate(request.headers.get("authorization"))
        name = await self.served_model(await self.clients.get(key))
        return {"object": "list", "data": [self._model_card(name)]}

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        _, key = self.keyring.authenticate(request.headers.get("authorization"))
        await self._check_model(await self.clients.get(key), model_id)
        return self._model_card(model_id)

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.started_at, "owned_by": "phalanx"}

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    # -- one generation ------------------------------------------------------------------------
    async def _generate(self, request: Request, dialect: Dialect) -> Response:
        arrived = time.perf_counter()
        # Under the web framework's own server span when it makes one (FastAPI's telemetry), else the caller's trace context.
        framework_span = trace.get_current_span().get_span_context().is_valid
        span = tracer.start_span(
            f"gateway.{dialect.endpoint}", context=None if framework_span else extract_context(request.headers),
            kind=trace.SpanKind.INTERNAL if framework_span else trace.SpanKind.SERVER, attributes={"http.route": request.url.path},
        )
        self.metrics.active.inc()
        streaming = False
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await self._start(request, dialect, span, arrived)
            streaming = isinstance(response, EventSourceResponse)
            return response
        except GatewayError as error:
            _fail_span(span, error.message)
            self._count(dialect, str(error.status), arrived)
            raise
        except ClientDisconnected:
            self._count(dialect, "client_closed", arrived)
            raise
        except Exception:
            self._count(dialect, "500", arrived)  # answered by the app's handler of unexpected errors
            raise
        finally:
            if not streaming:  # a stream ends its span and counts itself when it is over
                span.end()
                self.metrics.active.dec()

    async def _start(self, request: Request, dialect: Dialect, span: trace.Span, arrived: float) -> Response:
        tenant, key = self.keyring.authenticate(request.headers.get("authorization"))
        body = await _read_body(request)
        parsed: CompletionRequest | ChatCompletionRequest = parse_body(ChatCompletionRequest if dialect.chat else CompletionRequest, body)
        tier = self.keyring.tier(tenant, header_tier=request.headers.get(TIER_HEADER), metadata_tier=parsed.metadata_tier)
        caller = Caller(tenant, tier, key)
        client = await self.clients.get(caller.api_key)
        model = await self._check_model(client, parsed.model)
        last_event_id = request.headers.get("last-event-id")
        if last_event_id is not None:
            return await self._continue(request, dialect, client, parsed, last_event_id, model=model, span=span, arrived=arrived)
        args = await self._generate_args(client, parsed)
        request_id = uuid.uuid4().hex
        span.set_attributes({
            "phalanx.request_id": request_id, "phalanx.tenant": caller.tenant or "", "phalanx.tier": caller.tier.label if caller.tier else "",
            "gen_ai.request.model": model, "gen_ai.request.max_tokens": args.options.max_tokens,
        })
        stream = self._open(client, caller, args, request_id)
        call = _Call(self, dialect, stream, model=model, request_id=request_id, prompt_param="messages" if dialect.chat else "prompt",
                     span=span, arrived=arrived, args=args)
        if parsed.stream:
            return await call.respond_streaming(request, include_usage=parsed.include_usage)
        return await call.respond_whole(request)

    async def _continue(
        self, request: Request, dialect: Dialect, client: Client, parsed: CompletionRequest | ChatCompletionRequest, last_event_id: str,
        *, model: str, span: trace.Span, arrived: float,
    ) -> Response:
        """A reconnect: the stream the Last-Event-ID names goes on after that event (the body's prompt is not run again)."""
        if not parsed.stream:
            raise bad_request("stream", "a request with Last-Event-ID continues a stream: it needs stream: true")
        try:
            cursor = StreamCursor.parse(last_event_id)
        except ValueError as error:
            raise GatewayError(
                400, f"Last-Event-ID {last_event_id[:64]!r} {error}", kind="invalid_request_error", param="Last-Event-ID",
                code="invalid_event_id",
            ) from None
        span.set_attributes({"phalanx.request_id": cursor.request_id, "phalanx.resumed_at": cursor.tokens})
        args = await self._generate_args(client, parsed)  # the answer's shape (log-probabilities, echo) is the body's
        stream = client.resume(cursor.request_id, cursor.tokens)
        call = _Call(self, dialect, stream, model=model, request_id=cursor.request_id, prompt_param="messages" if dialect.chat else "prompt",
                     span=span, arrived=arrived, args=args, cursor=cursor)
        return await call.respond_streaming(request, include_usage=parsed.include_usage)

    async def _generate_args(self, client: Client, parsed: CompletionRequest | ChatCompletionRequest) -> GenerateArgs:
        if isinstance(parsed, ChatCompletionRequest):
            prompt = (await self._chat_prompts(client)).render(parsed.template_messages())
            return parsed.generate_args(prompt, default_max_tokens=self.config.default_max_tokens)
        return parsed.generate_args()

    def _open(self, client: Client, caller: Caller, args: GenerateArgs, request_id: str) -> GenerateStream:
        try:
            tier = caller.tier.label if caller.tier is not None else None
            return client.generate(
                args.prompt, options=args.options, media=args.media, tier=tier, tenant=caller.tenant, request_id=request_id
            )
        except PhalanxClientError as error:  # the SDK checks a few arguments itself
            raise from_client_error(error) from None
        except ValueError as error:  # a number the router's protobuf cannot hold (the schema bounds those it knows of)
            raise bad_request(None, f"a parameter is out of range for the router: {error}") from None

    def _count(self, dialect: Dialect, status: str, arrived: float) -> None:
        self.metrics.requests.labels(endpoint=dialect.endpoint, status=status).inc()
        self.metrics.latency.labels(endpoint=dialect.endpoint).observe(time.perf_counter() - arrived)


class _Call:
    """One request's SDK stream, answered whole or as server-sent events."""

    def __init__(
        self, server: GatewayServer, dialect: Dialect, stream: GenerateStream, *, model: str, request_id: str, prompt_param: str,
        span: trace.Span, arrived: float, args: GenerateArgs, cursor: StreamCursor | None = None,
    ) -> None:
        self.server = server
        self.dialect = dialect
        self.generation = stream
        self.model = model
        self.request_id = request_id
        self.prompt_param = prompt_param
        self.span = span
        self.arrived = arrived
        # Where the client is in the stream: a reconnect (cursor given) goes on from its Last-Event-ID.
        self.resumed = cursor is not None
        self.cursor = cursor or StreamCursor(request_id, 0, 0, int(time.time()))
        self.created = self.cursor.created
        self.prompt_tokens = self.cursor.prompt_tokens
        self.completion_tokens = self.cursor.tokens
        # Log-probabilities in the answer, in the endpoint's shape; the prompt echoed before the completion.
        self.logprobs = LogprobsShape(chat=dialect.chat) if args.top_logprobs is not None else None
        self.echo = args.echo
        self.echo_prompt = args.prompt if isinstance(args.prompt, str) else None

    def _echoed(self, first: Chunk | None) -> tuple[str, Sequence[PositionLogprobs]]:
        """The prompt's text and log-probabilities to put before the completion (echo), from the first chunk."""
        if not self.echo:
            return "", ()
        entries = first.prompt_logprobs if first is not None else ()
        text = self.echo_prompt if self.echo_prompt is not None else b"".join(e.token.token_bytes for e in entries).decode("utf-8", "replace")
        return text, entries

    def _took(self, chunk: Chunk) -> None:
        if chunk.index == 0:
            self.prompt_tokens = chunk.prompt_tokens
            self.server.metrics.ttft.labels(endpoint=self.dialect.endpoint).observe(time.perf_counter() - self.arrived)
        self.completion_tokens += 1
        self.server.metrics.tokens.labels(endpoint=self.dialect.endpoint).inc()

    def _finish(self) -> str:
        """OpenAI's finish_reason of a stream that ended; an end that is neither stop nor length is an error."""
        reason = finish_reason(self.generation.finish_reason)
        if reason is None:
            raise GatewayError(
                503, f"the request ended without finishing ({self.generation.finish_reason or 'no final token'})", kind="server_error",
                code="aborted", retry_after_s=1.0,
            )
        return reason

    def _close_span(self) -> None:
        self.span.set_attributes({
            "gen_ai.usage.input_tokens": self.prompt_tokens, "gen_ai.usage.output_tokens": self.completion_tokens,
            "phalanx.resumes": self.generation.resumes,
        })
        if self.generation.resumes:
            self.server.metrics.resumes.inc(self.generation.resumes)

    async def respond_whole(self, request: Request) -> Response:
        async def collect() -> list[Chunk]:
            async with self.generation:
                chunks = []
                try:
                    async for chunk in self.generation:
                        self._took(chunk)
                        chunks.append(chunk)
                except PhalanxClientError as error:
                    raise from_client_error(error, prompt_param=self.prompt_param) from None
                return chunks

        try:
            chunks = await _unless_disconnected(request, collect())
            echoed, prompt_logprobs = self._echoed(chunks[0] if chunks else None)
            logprobs = None
            if self.logprobs is not None:
                logprobs = self.logprobs.part([*prompt_logprobs, *(c.logprobs for c in chunks if c.logprobs is not None)])
            body = self.dialect.response(
                request_id=self.request_id, created=self.created, model=self.model, text=echoed + "".join(c.text for c in chunks),
                finish=self._finish(), prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, logprobs=logprobs,
            )
        finally:
            self._close_span()
        self.server._count(self.dialect, "200", self.arrived)
        return JSONResponse(body, headers={"x-request-id": self.request_id})

    async def respond_streaming(self, request: Request, *, include_usage: bool) -> Response:
        """SSE once the first token is here (a refusal before it keeps its HTTP status); the rest as it comes."""

        async def first_chunk() -> Chunk | None:
            try:
                return await anext(self.generation, None)
            except NotFoundError as error:
                if self.resumed:
                    raise GatewayError(
                        410, f"the stream {self.request_id} cannot be continued: the router no longer holds it (it ended longer ago "
                        f"than the resume window, or never existed): {error.message}", kind="invalid_request_error",
                        param="Last-Event-ID", code="stream_expired",
                    ) from None
                raise from_client_error(error, prompt_param=self.prompt_param) from None
            except PhalanxClientError as error:
                raise from_client_error(error, prompt_param=self.prompt_param) from None

        try:
            first = await _unless_disconnected(request, first_chunk())
            if first is None:
                self._finish()  # raises: the stream ended without a token
        except BaseException:
            await self.generation.aclose()
            self._close_span()
            raise
        return EventSourceResponse(
            self._events(first, include_usage), headers={"x-request-id": self.request_id, "cache-control": "no-cache"}, ping=15,
        )

    async def _events(self, first: Chunk | None, include_usage: bool) -> AsyncIterator[dict[str, str]]:
        status = "client_closed"
        server = self.server
        try:
            with trace.use_span(self.span, end_on_exit=False):
                try:
                    chunk = first
                    is_first = self.cursor.tokens == 0  # a reconnect's stream sent the first chunk (and chat's role) before
                    # The echoed prompt goes before the first token, once: a reconnect's stream sent it before.
                    echoed, prompt_logprobs = self._echoed(first) if is_first else ("", ())
                    if echoed:
                        yield self._event(self.dialect.chunk(
                            request_id=self.request_id, created=self.created, model=self.model, text=echoed, finish=None, first=True,
                            include_usage=include_usage, logprobs=self.logprobs.part(prompt_logprobs) if self.logprobs else None,
                        ))
                    while chunk is not None:
                        self._took(chunk)
                        finish = self._finish() if chunk.finish_reason is not None else None
                        # A token whose text is still incomplete (part of a UTF-8 character) is sent for its logprob.
                        scored = self.logprobs is not None and chunk.logprobs is not None
                        if chunk.text or finish or (is_first and self.dialect.chat) or scored:
                            yield self._event(self.dialect.chunk(
                                request_id=self.request_id, created=self.created, model=self.model, text=chunk.text, finish=finish,
                                first=is_first, include_usage=include_usage,
                                logprobs=self.logprobs.part([chunk.logprobs]) if self.logprobs and chunk.logprobs else None,
                            ), self._cursor_after(chunk))
                            is_first = False
                        chunk = await anext(self.generation, None)
                    self._finish()
                    cursor = self.cursor.after(self.completion_tokens)
                    if include_usage:
                        yield self._event(self.dialect.usage_chunk(
                            request_id=self.request_id, created=self.created, model=self.model, prompt_tokens=self.prompt_tokens,
                            completion_tokens=self.completion_tokens,
                        ), cursor)
                    yield {"data": "[DONE]", "id": cursor.event_id()}
                    status = "200"
                except (PhalanxClientError, GatewayError) as failure:
                    # The 200 is long gone: the error goes in the stream, where OpenAI's clients raise it.
                    error = failure if isinstance(failure, GatewayError) else from_client_error(failure, prompt_param=self.prompt_param)
                    status = str(error.status)
                    _fail_span(self.span, error.message)
                    yield self._event(error.body())
        finally:
            self._close_span()
            self.span.end()
            server.metrics.active.dec()
            server._count(self.dialect, status, self.arrived)
            # A client that left cancels this response's scope, which would interrupt every await here but a shielded one.
            with anyio.CancelScope(shield=True):
                await self.generation.aclose()

    def _cursor_after(self, chunk: Chunk) -> StreamCursor:
        return StreamCursor(self.request_id, chunk.index + 1, self.prompt_tokens, self.created)

    @staticmethod
    def _event(body: dict[str, Any], cursor: StreamCursor | None = None) -> dict[str, str]:
        """One SSE event; its id (a cursor) is where a client that reconnects with it as Last-Event-ID goes on."""
        event = {"data": json.dumps(body, separators=(",", ":"))}
        if cursor is not None:
            event["id"] = cursor.event_id()
        return event


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > _MAX_BODY_BYTES:
        raise GatewayError(413, f"the body exceeds {_MAX_BODY_BYTES} bytes", kind="invalid_request_error", code="body_too_large")
    body = await request.body()
    if len(body) > _MAX_BODY_BYTES:
        raise GatewayError(413, f"the body exceeds {_MAX_BODY_BYTES} bytes", kind="invalid_request_error", code="body_too_large")
    return body


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is read by then, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancels it (and so the SDK stream, which then cancels the request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected
    finally:
        watcher.cancel()
        task.cancel()


def _fail_span(span: trace.Span, message: str) -> None:
    span.set_status(trace.Status(trace.StatusCode.ERROR, message))


def _error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def build_app(server: GatewayServer) -> FastAPI:
    """The FastAPI application: OpenAI's routes, /health and /metrics, and every error in OpenAI's shape."""
    app = FastAPI(title="Phalanx OpenAI-compatible gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> Response:
        return _error_response(error)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the nginx convention for "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(GatewayError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error_response(GatewayError(500, f"internal error: {type(error).__name__}", kind="server_error", code="internal_error"))

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return await server.models(request)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> dict[str, Any]:
        return await server.model(request, model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/health")
    async def health() -> Response:
        if server.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

