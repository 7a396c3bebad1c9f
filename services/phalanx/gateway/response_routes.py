"""HTTP shell of the Responses API: POST /v1/responses, GET /v1/responses/{id} (whole, or its events), POST .../cancel.

Every answer comes from etcd (response_store), so any gateway replica serves
any response; the gateway that creates a response also starts relaying it
(response_runs), and another takes over if it dies.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from phalanx.client import Client, GenerateOptions, InvalidArgumentError, PhalanxClientError
from phalanx.gateway.auth import TIER_HEADER
from phalanx.gateway.errors import GatewayError, bad_request, from_client_error
from phalanx.gateway.openai_responses import ResponsesRequest, StoredResponse, response_object
from phalanx.gateway.response_runs import ResponseRunner
from phalanx.gateway.response_store import StoreUnavailableError
from phalanx.gateway.schema import parse_body
from phalanx.gateway.server import GatewayServer, _read_body

__all__ = ["ResponsesApi", "add_response_routes", "tenant_client"]

_CANCEL_ATTEMPTS = 5
T = TypeVar("T")


async def tenant_client(server: GatewayServer, response: StoredResponse) -> Client:
    """The SDK client that runs a response: its tenant's key (every replica has the same keys, so any finds one)."""
    config = server.config
    if not config.api_keys:
        return await server.clients.get(config.router_api_key or None)
    key = next((k for k, tenant in sorted(config.api_keys.items()) if tenant == response.tenant), None)
    if key is None:
        raise GatewayError(500, f"no API key of tenant {response.tenant!r} is configured here", kind="server_error", code="no_key")
    return await server.clients.get(key)


class ResponsesApi:
    def __init__(self, server: GatewayServer, runner: ResponseRunner) -> None:
        self.server = server
        self.runner = runner

    async def client_for(self, response: StoredResponse) -> Client:
        return await tenant_client(self.server, response)

    def _need_store(self) -> None:
        if not self.runner.ready.is_set():
            raise GatewayError(503, "the Responses API waits for etcd", kind="server_error", code="unavailable", retry_after_s=1.0)

    async def create(self, request: Request) -> Response:
        tenant, key = self.server.keyring.authenticate(request.headers.get("authorization"))
        parsed: ResponsesRequest = parse_body(ResponsesRequest, await _read_body(request))
        parsed.check()
        self._need_store()
        tier = self.server.keyring.tier(
            tenant, header_tier=request.headers.get(TIER_HEADER), metadata_tier=(parsed.metadata or {}).get("tier")
        )
        client = await self.server.clients.get(key)
        model = await self.server._check_model(client, parsed.model)
        prompt = (await self.server._chat_prompts(client)).render(parsed.messages())
        max_tokens = parsed.max_output_tokens or self.server.config.default_max_tokens
        try:  # the SDK's own checks of the sampling parameters, before anything is stored
            GenerateOptions(max_tokens=max_tokens, temperature=parsed.temperature or 0.0, top_p=parsed.top_p or 1.0)
        except InvalidArgumentError as error:
            raise from_client_error(error) from None
        request_id = uuid.uuid4().hex
        response = StoredResponse(
            id="resp_" + request_id, request_id=request_id, model=model, created_at=int(time.time()), prompt=prompt,
            lease_id=await self._store(self.runner.store.grant()), max_tokens=max_tokens, tenant=tenant or "",
            tier=tier.label if tier is not None else None, background=bool(parsed.background), instructions=parsed.instructions,
            max_output_tokens=parsed.max_output_tokens, temperature=parsed.temperature, top_p=parsed.top_p, ignore_eos=parsed.ignore_eos,
            metadata=dict(parsed.metadata or {}), status="queued" if parsed.background else "in_progress",
        )
        version = await self._store(self.runner.store.create(response))
        run = self.runner.run(response, version)
        if parsed.stream:
            return self._events(response.id, -1)
        if parsed.background:
            return JSONResponse(response_object(response))
        failure = await asyncio.shield(run)  # a client that leaves does not stop it: the response stays stored
        if failure is not None and not failure.status >= 500:
            raise failure  # refused (bad parameter, rate limit): the HTTP status says so, as for the other endpoints
        return JSONResponse(response_object(await self._found(response.id, tenant)))

    async def retrieve(self, request: Request, response_id: str) -> Response:
        tenant, _ = self.server.keyring.authenticate(request.headers.get("authorization"))
        self._need_store()
        response = await self._found(response_id, tenant)
        if request.query_params.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(response_object(response))
        raw = request.query_params.get("starting_after")
        try:
            after = -1 if raw is None else int(raw)
        except ValueError:
            raise bad_request("starting_after", f"must be an integer sequence number, got {str(raw)[:32]!r}") from None
        if after < -1:
            raise bad_request("starting_after", "must be -1 or a sequence number")
        return self._events(response_id, after)

    async def cancel(self, request: Request, response_id: str) -> Response:
        tenant, _ = self.server.keyring.authenticate(request.headers.get("authorization"))
        self._need_store()
        for _ in range(_CANCEL_ATTEMPTS):
            response = await self._found(response_id, tenant)
            if response.final:
                return JSONResponse(response_object(response))
            found = await self._store(self.runner.store.get(response_id))
            if found is None:
                break
            current, version = found
            cancelled = current.ended("cancelled", int(time.time()))
            # Stored first: the relay's next write fails on the version and stops, whichever gateway relays it.
            if await self._store(self.runner.store.write(cancelled, version)) is not None:
                try:
                    await (await self.client_for(current)).cancel(current.request_id, timeout=5.0)
                except PhalanxClientError:
                    pass  # the request ended or its worker died meanwhile: the stored status is what counts
                return JSONResponse(response_object(cancelled))
        raise GatewayError(409, f"the response {response_id} kept changing; try again", kind="invalid_request_error", code="conflict")

    async def _found(self, response_id: str, tenant: str | None) -> StoredResponse:
        response = await self._store(self.runner.get(response_id))
        if response is None or response.tenant != (tenant or ""):  # another tenant's response is as good as unknown
            raise GatewayError(
                404, f"no response {response_id!r}: it never existed or its time to live ({self.runner.store.ttl_s} s) ran out",
                kind="invalid_request_error", param="response_id", code="response_not_found",
            )
        return response

    @staticmethod
    async def _store(awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except StoreUnavailableError as error:
            raise GatewayError(503, f"the response store is unavailable: {error}", kind="server_error", code="unavailable",
                               retry_after_s=1.0) from None

    def _events(self, response_id: str, after: int) -> Response:
        async def events() -> AsyncIterator[dict[str, str]]:
            try:
                async for event in self.runner.follow(response_id, after):
                    yield {"event": event["type"], "data": json.dumps(event, separators=(",", ":"))}
            except (GatewayError, StoreUnavailableError) as failure:
                error = failure if isinstance(failure, GatewayError) else GatewayError(503, str(failure), kind="server_error")
                yield {"event": "error", "data": json.dumps({**error.body()["error"], "type": "error"}, separators=(",", ":"))}

        return EventSourceResponse(events(), headers={"cache-control": "no-cache"}, ping=15)


def add_response_routes(app: FastAPI, api: ResponsesApi) -> None:
    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await api.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await api.retrieve(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await api.cancel(request, response_id)


