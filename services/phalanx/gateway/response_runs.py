"""Running responses on: each unfinished response has one gateway that relays its tokens from the routers into etcd.

The router runs the request (its worker goes on generating when the relay
breaks, for the worker's detach grace); a gateway only relays. The gateway
that created a response runs it first; when that gateway dies its driver key
goes with its etcd session, and every gateway's ``adopt_forever`` loop looks
for unfinished responses without a driver, claims one (put-if-absent) and
resumes its request at the router from the number of tokens stored. A
gateway that stops gracefully detaches its relays without cancelling their
requests and revokes its session, so that another takes them over at once.

Readers (streams and GETs, on any gateway) read only etcd: ``follow`` replays
a response's events after a sequence number and then follows its growth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from phalanx.client import Client, FinishReason, GenerateOptions, GenerateStream, PhalanxClientError
from phalanx.common.lease import Backoff
from phalanx.gateway.errors import GatewayError, from_client_error
from phalanx.gateway.openai_responses import ResponseStatus, StoredResponse, events_after
from phalanx.gateway.response_store import ResponseStore, StoreUnavailableError

__all__ = ["ResponseRunner"]

log = logging.getLogger(__name__)

_END_STATUS: dict[FinishReason, ResponseStatus] = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete"}


class ResponseRunner:
    """This gateway's relays of responses, its loop that adopts orphaned ones, and the readers' view of etcd."""

    def __init__(
        self, store: ResponseStore, client_for: Callable[[StoredResponse], Awaitable[Client]], *, flush_interval_s: float, poll_interval_s: float,
        adopt_interval_s: float,
    ) -> None:
        self.store = store
        self._client_for = client_for  # the SDK client to run a response with (its tenant's API key)
        self._flush_interval_s = flush_interval_s
        self._poll_interval_s = poll_interval_s
        self._adopt_interval_s = adopt_interval_s
        self._runs: dict[str, asyncio.Task[GatewayError | None]] = {}
        self._streams: dict[str, GenerateStream] = {}
        self._written: dict[str, asyncio.Event] = {}  # wakes this process's readers of a response at each write
        self.ready = asyncio.Event()  # the etcd session is up
        self.adopted = 0

    # -- running ----------------------------------------------------------------------
    def run(self, response: StoredResponse, version: int) -> asyncio.Task[GatewayError | None]:
        """Relays a response this gateway holds the driver key of; the task's result is the error that failed it, if any."""
        task = asyncio.create_task(self._drive(response, version), name=f"response {response.id}")
        self._runs[response.id] = task
        task.add_done_callback(lambda done: self._runs.pop(response.id, None) if self._runs.get(response.id) is done else None)
        return task

    async def _drive(self, response: StoredResponse, version: int) -> GatewayError | None:
        try:
            return await self._relay(response, version)
        except (StoreUnavailableError, GatewayError) as error:
            # Released below: another gateway (or this one, at its next look) takes the response over.
            log.warning("relaying response %s stopped (%s); it is left to the next gateway that looks", response.id, error)
            message = error.message if isinstance(error, GatewayError) else str(error)
            return GatewayError(503, f"the response's relay stopped: {message}", kind="server_error", code="unavailable", retry_after_s=1.0)
        finally:
            self._streams.pop(response.id, None)
            with contextlib.suppress(StoreUnavailableError):
                await self.store.release(response.id)

    async def _open(self, response: StoredResponse) -> GenerateStream:
        client = await self._client_for(response)
        if response.pieces:
            return client.resume(response.request_id, len(response.pieces))
        # A retry of the same request id: the router streams the request that runs, or starts it if none does.
        options = GenerateOptions(
            max_tokens=response.max_tokens, temperature=1.0 if response.temperature is None else response.temperature,
            top_p=1.0 if response.top_p is None else response.top_p, ignore_eos=response.ignore_eos,
        )
        return client.generate(response.prompt, options=options, tier=response.tier, tenant=response.tenant or None,
                               request_id=response.request_id)

    async def _relay(self, response: StoredResponse, version: int) -> GatewayError | None:
        stream = await self._open(response)
        self._streams[response.id] = stream
        pending: list[str] = []
        prompt_tokens = 0
        failure: GatewayError | None = None
        flushed = time.monotonic()
        async with stream:
            try:
                async for chunk in stream:
                    if chunk.index == 0:
                        prompt_tokens = chunk.prompt_tokens
                    pending.append(chunk.text)
                    if chunk.finish_reason is None and time.monotonic() - flushed >= self._flush_interval_s:
                        written = await self._write(response.grown(pending, prompt_tokens=prompt_tokens), version, stream, in_progress=True)
                        if written is None:
                            return None
                        response, version = written
                        pending, flushed = [], time.monotonic()
            except PhalanxClientError as error:
                failure = from_client_error(error, prompt_param="input")
            response = response.grown(pending, prompt_tokens=prompt_tokens)
            status = _END_STATUS.get(stream.finish_reason) if stream.finish_reason is not None else None
            if failure is None and status is None:
                failure = GatewayError(
                    503, f"the request ended without finishing ({stream.finish_reason or 'no final token'})", kind="server_error",
                    code="aborted",
                )
            detail = None if failure is None else {"code": "server_error", "message": failure.message}
            await self._write(response.ended(status or "failed", int(time.time()), detail), version, stream, in_progress=False)
        return failure

    async def _write(
        self, response: StoredResponse, version: int, stream: GenerateStream, *, in_progress: bool
    ) -> tuple[StoredResponse, int] | None:
        """Writes the relay's progress; None when the relay must stop (cancelled, or another gateway runs it now)."""
        if in_progress and response.status == "queued":
            response = replace(response, status="in_progress")
        while True:
            try:
                written = await self.store.write(response, version)
                break
            except StoreUnavailableError as error:
                # The tokens stay pending here (and the worker keeps them): retry until the request itself ends.
                log.warning("cannot store response %s (%s); retrying", response.id, error)
                await asyncio.sleep(self._poll_interval_s)
        self._wake(response.id)
        if written is not None:
            return response, written
        current = await self.store.get(response.id)
        if current is None or current[0].final:
            log.info("response %s was cancelled (or expired) while relayed", response.id)
        else:
            log.warning("response %s is run by another gateway now; this relay stops", response.id)
            stream.detach()
        return None

    # -- adopting ---------------------------------------------------------------------
    async def adopt_forever(self) -> None:
        """Opens the etcd session, then keeps taking over unfinished responses that no gateway runs."""
        backoff = Backoff(initial=0.2, cap=5.0)
        failures = 0
        while True:
            try:
                await self.store.start()
                break
            except Exception as error:  # noqa: BLE001 - etcd away at startup must not stop the gateway; Responses wait for it
                delay = backoff.next()
                failures += 1
                log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                        "no etcd session for the Responses API yet (%s); retrying every %.1f s at most", error, delay)
                await asyncio.sleep(delay)
        self.ready.set()
        while True:
            try:
                for response_id in await self.store.orphans():
                    if response_id not in self._runs and await self.store.claim(response_id):
                        await self._adopt(response_id)
            except StoreUnavailableError as error:
                log.warning("cannot look for orphaned responses: %s", error)
            await asyncio.sleep(self._adopt_interval_s)

    async def _adopt(self, response_id: str) -> None:
        found = await self.store.get(response_id)
        if found is None or found[0].final:
            await self.store.release(response_id)
            return
        response, version = found
        log.info("taking over response %s at token %d", response_id, len(response.pieces))
        self.adopted += 1
        self.run(response, version)

    async def close(self) -> None:
        """Detaches every relay (their requests run on) and stops them; the session's revocation hands them to other gateways."""
        for stream in self._streams.values():
            stream.detach()
        runs = list(self._runs.values())
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        await self.store.close()

    # -- reading ----------------------------------------------------------------------
    def _wake(self, response_id: str) -> None:
        event = self._written.pop(response_id, None)
        if event is not None:
            event.set()

    async def get(self, response_id: str) -> StoredResponse | None:
        found = await self.store.get(response_id)
        return None if found is None else found[0]

    async def follow(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """The response's events with sequence numbers above ``after``, as they come, until its last."""
        sent = after
        while True:
            written = self._written.setdefault(response_id, asyncio.Event())
            response = await self.get(response_id)
            if response is None:
                raise GatewayError(404, f"the response {response_id} expired while it was streamed", kind="not_found_error", code="expired")
            for event in events_after(response, sent):
                yield event
                sent = event["sequence_number"]
            if response.final:
                self._written.pop(response_id, None)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(written.wait(), self._poll_interval_s)
