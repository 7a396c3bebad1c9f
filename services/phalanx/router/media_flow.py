"""A media request's way through the router: its placeholders, the encode, and encoding again when rows cannot be fetched.

The encoder and the worker are chosen together (router/joint.py), and the
prompt's text before its first media is prefilled on that worker while the
encoder runs. With direct delivery the worker fetches the rows from the
encoder; when they cannot be fetched, `MediaRefetchPolicy` (router/refetch.py)
decides whether the media are encoded again, rows inline, and `MediaFlow`
executes that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from phalanx._proto import common_pb2, router_pb2, worker_pb2
from phalanx.common.block_hash import MediaSpan
from phalanx.common.errors import InvalidRequestError, PhalanxError, UnavailableError
from phalanx.common.telemetry import get_tracer
from phalanx.encoder_pool.tokens import expand_placeholders, visual_token_budget
from phalanx.model.params import SamplingParams
from phalanx.router.channels import WorkerChannels
from phalanx.router.config import RouterConfig
from phalanx.router.flow import Flow
from phalanx.router.joint import JointChoice, choose_joint
from phalanx.router.media import MediaEncoder
from phalanx.router.metrics import RouterMetrics
from phalanx.router.prompts import context_limit
from phalanx.router.refetch import Effect as RefetchEffect, Event as RefetchEvent, PassOn, Reencode, ReencodeCause, Reencoded, SkipMigration
from phalanx.router.routing import RoutingTable

__all__ = ["EncodedPrompt", "MediaFlow"]

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)


@dataclass(frozen=True)
class EncodedPrompt:
    """A media request's prompt once its media are encoded."""

    prompt_ids: list[int]  # each placeholder expanded to its media's rows
    media: list[common_pb2.MediaEmbedding]  # rows inline, or (direct delivery) where the worker fetches them
    worker_id: str | None  # the worker chosen with the encoder (prefer it when routing); None: routing decides alone
    budget: int  # the visual token budget the media were encoded within
    usable_until: float  # direct delivery: until when (time.monotonic) the rows are worth fetching


class MediaFlow:
    """The router's media I/O: encodes a request's media, prefills its text prefix meanwhile, encodes them again."""

    def __init__(
        self, encoder: MediaEncoder, config: RouterConfig, table: RoutingTable, metrics: RouterMetrics, channels: WorkerChannels,
        registrations: Mapping[str, common_pb2.WorkerRegistration],
    ) -> None:
        self.encoder = encoder
        self.config = config
        self.table = table
        self.metrics = metrics
        self.channels = channels
        self.registrations = registrations  # the servicer's, kept current by the process

    async def encode(
        self, request_id: str, request: router_pb2.GenerateRequest, prompt_ids: list[int], params: SamplingParams,
    ) -> EncodedPrompt:
        """Encode the media, expand each placeholder to its rows; the visual token budget bounds them all.

        The text before the first placeholder is prefilled on the jointly chosen worker while the encoder runs.
        """
        placeholder = self.config.media_placeholder_token_id
        items = len(request.media)
        found = prompt_ids.count(placeholder)
        if found == 0:
            prompt_ids = [placeholder] * items + prompt_ids
        elif found != items:
            raise InvalidRequestError("prompt.tokens", f"{found} media placeholders (id {placeholder}) for {items} media items")
        budget = visual_token_budget(
            max_visual_tokens=self.config.max_media_tokens, context_length=context_limit(self.registrations) or self.config.max_prompt_tokens,
            text_tokens=len(prompt_ids) - items, max_output_tokens=params.max_tokens,
        )
        if budget < 1:
            raise InvalidRequestError("media", "the prompt and max_tokens leave no room for media in the context")
        choice = None if self.encoder.all_cached(request.media) else self._joint_choice(prompt_ids, request.media, budget)
        prefill: asyncio.Task | None = None
        first_media = prompt_ids.index(placeholder)
        if (
            choice is not None and self.config.media_prefix_overlap
            and first_media - choice.prefix_cached_tokens >= self.table.block_size  # a full block to compute, or nothing is cached
            and choice.overlap_pays(self.config.media_prefix_overlap_min_steps)
        ):
            prefill = asyncio.create_task(self._prefill_prefix(request_id, choice.worker_id, prompt_ids[:first_media]))
        try:
            with tracer.start_as_current_span("router.encode", attributes={"request_id": request_id, "items": items}):
                encoded = await self.encoder.encode(
                    request_id, request.media, budget, first=choice.encoder_id if choice else None,
                    deliver=self.config.media_delivery == "direct",
                )
            if prefill is not None:
                # Its blocks must be cached before the request comes, or the worker computes them again; a worker that
                # takes much longer than the encoder is slow or hung, and the request must not wait on it for long.
                await asyncio.wait([prefill], timeout=self.config.media_prefix_wait_s)
        finally:
            if prefill is not None and not prefill.done():
                prefill.cancel()
                self.metrics.prefix_prefills.labels(result="unfinished").inc()
        embeddings = encoded.embeddings
        self.metrics.media_inline_bytes.inc(sum(len(e.data) for e in embeddings))
        expanded, spans = expand_placeholders(prompt_ids, placeholder, [e.rows for e in embeddings], [e.media_hash for e in embeddings])
        worker_id = choice.worker_id if choice is not None else None
        return EncodedPrompt(expanded, encoded.media(spans), worker_id, budget, encoded.usable_until)

    async def refetch(self, flow: Flow, event: RefetchEvent, why: str) -> RefetchEffect:
        """Runs the request's refetch policy on `event`, encoding the media again where it says so (`why`: for the log);
        returns the effect that decides what comes next. PassOn after a failed re-encode raises its error."""
        effect = flow.refetch.on(event)
        if not isinstance(effect, Reencode):
            return effect
        log.info("%s; encoding the media of %s again", why, flow.record.request_id)
        try:
            await self._reencode(flow, effect.cause)
        except PhalanxError as error:
            outcome = flow.refetch.on(Reencoded(ok=False))
            if isinstance(outcome, PassOn):
                raise
            if isinstance(outcome, SkipMigration):
                log.warning("cannot migrate %s: its media could not be encoded again (%s)", flow.record.request_id, error)
            return outcome
        return flow.refetch.on(Reencoded(ok=True))

    async def _reencode(self, flow: Flow, cause: ReencodeCause) -> None:
        """Encodes a directly delivered request's media again, rows inline this time (media are pure inputs: the same rows).

        UnavailableError if no encoder can.
        """
        self.metrics.media_reencodes.labels(cause=cause.value).inc()
        with tracer.start_as_current_span("router.encode", attributes={"request_id": flow.record.request_id, "cause": cause.value}):
            encoded = await self.encoder.encode(flow.record.request_id, flow.media_inputs, flow.media_budget, cached=False)
        embeddings = encoded.embeddings
        if [e.rows for e in embeddings] != [m.rows for m in flow.media]:
            raise UnavailableError(f"encoding the media of {flow.record.request_id} again gave other rows", retry_after_s=1.0)
        self.metrics.media_inline_bytes.inc(sum(len(e.data) for e in embeddings))
        flow.media = encoded.media([MediaSpan(m.start, m.rows, m.media_hash) for m in flow.media])
        flow.media_inputs = ()  # inline now: nothing left to fetch

    def _joint_choice(self, prompt_ids: list[int], media: Sequence[router_pb2.MediaInput], budget: int) -> JointChoice | None:
        """The (encoder, worker) pair with the lowest estimated TTFT; None when either is missing (encode decides the error)."""
        try:
            encoders, rows = self.encoder.estimates(
                media, link_bytes_per_s=self.config.media_link_bytes_per_s, through_router=self.config.media_delivery == "inline",
            )
        except InvalidRequestError:
            return None  # encode() raises it again, with the same message
        first_media = prompt_ids.index(self.config.media_placeholder_token_id)
        prefix = prompt_ids[:first_media]
        # One token past the prefix: a prefix's last full block counts as cached (the routing table always leaves the last
        # token of what it is given to compute).
        workers = self.table.estimates(prompt_ids[: first_media + 1])
        rest = len(prompt_ids) - first_media - len(media) + min(rows, budget)
        return choose_joint(
            encoders, workers, prefix_tokens=len(prefix), rest_tokens=rest, overlap=self.config.media_prefix_overlap,
        )

    async def _prefill_prefix(self, request_id: str, worker_id: str, prefix: list[int]) -> None:
        """Fills the worker's prefix cache with the prompt's text before its media; on failure the request computes it."""
        registration = self.registrations.get(worker_id)
        if registration is None:
            return
        with tracer.start_as_current_span("router.prefill_prefix", attributes={"request_id": request_id, "tokens": len(prefix)}):
            try:
                await self.channels.stub(registration.address).Prefill(
                    worker_pb2.PrefillRequest(request_id=request_id, tokens=common_pb2.PromptTokens(ids=prefix)),
                    timeout=self.config.encode_timeout_s,
                )
            except grpc.aio.AioRpcError as error:
                log.info("prefix prefill of %s on %s failed (%s); the request computes it", request_id, worker_id, error.code().name)
                self.metrics.prefix_prefills.labels(result="failed").inc()
                return
        self.metrics.prefix_prefills.labels(result="ok").inc()
