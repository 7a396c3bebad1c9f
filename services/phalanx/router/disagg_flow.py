"""Disaggregated serving in the router: prefill a request on a prefill worker, then move it with its KV to its decode worker.

The policy (router/disagg.py) decides where a request is prefilled; this carries it out, around the relay:

1. `split`: the request was routed to a decode worker as usual. When the policy sends its prompt to a prefill worker,
   the request starts there instead, with the decode worker remembered in `Flow.decode_worker`.
2. The prefill worker streams the first token (the client gets it from there) and parks the request with its KV in the
   same engine step (worker/engine.py, `hand_back_after_first`): its stream ends HANDED_BACK with the state and the
   KV source, as a drained worker's does.
3. `hand_over`: the decode worker's Restore fetches the KV over a tensor channel from the prefill worker (migration's
   transfer path: KvSource.SendKv into its paged cache, positions its prefix cache holds already left as they are) and
   the relay attaches there from the next index; no token is lost or repeated, since each carries its index.
   A decode worker without the blocks refuses before any byte moves. When the transfer fails, stalls past
   `disagg_transfer_timeout_s` or is refused, the request prefills again on a decode worker from the handed-back state
   (prompt and first token: a Generate with resume_from, as after a drain) and streams on from there.

A media request goes the same way: the prefill worker gets its embeddings (rows inline, or handles it fetches from the
encoder that holds them) and the decode worker's Restore gets them too, beside the KV that covers their positions (the
cached prefix it keeps counts only blocks hashed with the same media). A prefill worker that cannot fetch the rows
answers as any worker does: the router encodes them again, inline, and opens the prefill there once more.

A prefill worker that dies before its stream ends HANDED_BACK is a broken stream like any other: the relay retries the
request elsewhere (new requests never go to a prefill worker, so it prefills on a decode worker) or migrates it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx._proto import common_pb2, migration_pb2, worker_pb2
from phalanx.common.block_hash import MediaSpan
from phalanx.common.errors import UnavailableError
from phalanx.common.roles import PREFILL
from phalanx.router.channels import WorkerChannels
from phalanx.router.config import RouterConfig
from phalanx.router.disagg import DisaggSettings, LocalReason, PrefillLocally, decide
from phalanx.router.flow import Flow
from phalanx.router.routing import RouteDecision, RoutingTable

__all__ = ["DisaggFlow", "DisaggMetrics"]

log = logging.getLogger(__name__)

_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB
# Beyond the decode worker's own fetch deadline: time to answer after giving up.
_RESTORE_GRACE_S = 2.0

# Fallback reasons after which the request prefills on another decode worker than the one that failed it, if any can.
_AVOID = frozenset({"refused", "unreachable", "timeout", "lost"})

Route = Callable[[list[int], frozenset[str]], RouteDecision]
Move = Callable[[Flow, RouteDecision], None]


class DisaggMetrics:
    """phalanx_router_disagg_* (in the router's registry)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.prefills = Counter(
            "phalanx_router_disagg_prefills",
            "Requests the disaggregation policy placed while prefill workers were registered: where=remote (a prefill "
            "worker) or local (the decode worker), with the policy's reason",
            ["where", "reason"], registry=r,
        )
        self.prefill_queue = Gauge(
            "phalanx_router_disagg_prefill_queue", "Requests queued on the routable prefill workers at the last decision", registry=r
        )
        self.transfers = Counter(
            "phalanx_router_disagg_transfers", "KV hand-overs from a prefill to a decode worker, by outcome", ["outcome"], registry=r
        )
        self.transfer_bytes = Histogram(
            "phalanx_router_disagg_transfer_bytes", "KV bytes of one hand-over", buckets=_BYTES_BUCKETS, registry=r
        )
        self.transfer_bytes_total = Counter(
            "phalanx_router_disagg_transferred_bytes", "KV bytes moved from prefill to decode workers", registry=r
        )
        self.skipped_tokens = Counter(
            "phalanx_router_disagg_skipped_tokens", "Prompt tokens whose KV was not moved: the decode worker cached them", registry=r
        )
        self.transfer_seconds = Histogram(
            "phalanx_router_disagg_transfer_seconds", "Seconds the decode worker took to fetch one hand-over's KV",
            buckets=_TRANSFER_BUCKETS, registry=r,
        )
        self.handover_seconds = Histogram(
            "phalanx_router_disagg_handover_seconds", "Seconds from the prefill worker's hand-back to the decode worker's "
            "acceptance (the Restore call, transfer included)", buckets=_TRANSFER_BUCKETS, registry=r,
        )


class DisaggFlow:
    """Places requests between prefill and decode workers and hands prefilled ones over (see the module's docstring)."""

    def __init__(
        self, config: RouterConfig, table: RoutingTable, channels: WorkerChannels,
        registrations: Mapping[str, common_pb2.WorkerRegistration], registry: CollectorRegistry,
    ) -> None:
        self.settings = DisaggSettings(
            min_prompt_tokens=config.disagg_min_prompt_tokens, max_prefill_queue=config.disagg_max_prefill_queue,
            interference=config.disagg_interference, transfer_s_per_token=config.disagg_transfer_s_per_token,
            block_size=table.block_size, always=config.disagg_mode == "always",
        )
        self.timeout_s = config.disagg_transfer_timeout_s
        self.table = table
        self.channels = channels
        self.registrations = registrations  # the servicer's, kept current by the process
        self.metrics = DisaggMetrics(registry)

    def split(self, prompt_ids: list[int], decision: RouteDecision, media: Sequence[Any]) -> tuple[RouteDecision, str]:
        """(where the request starts, its decode worker when that is another: "" prefills where it was routed).

        The decode worker's cached prompt tokens are `decision.cached_tokens` (the caller keeps them in the flow).
        `media`: the prompt's media runs (MediaEmbedding): both sides' cached prefixes count only blocks hashed with the
        same media, as the workers' prefix caches hash them."""
        if not self.table.has_prefill_workers():
            return decision, ""  # an aggregated fleet routes as before
        spans = [MediaSpan(m.start, m.rows, m.media_hash) for m in media]
        decode = next((e for e in self.table.estimates(prompt_ids, media=spans) if e.worker_id == decision.worker_id), None)
        if decode is None:
            self.metrics.prefills.labels(where="local", reason=LocalReason.DECODE_UNKNOWN.value).inc()
            return decision, ""
        prefills = self.table.estimates(prompt_ids, media=spans, prefill=True)
        self.metrics.prefill_queue.set(sum(p.queue_depth for p in prefills))
        choice = decide(self.settings, prompt_tokens=len(prompt_ids), decode=decode, prefills=prefills)
        if isinstance(choice, PrefillLocally):
            self.metrics.prefills.labels(where="local", reason=choice.reason.value).inc()
            return decision, ""
        self.metrics.prefills.labels(where="remote", reason="always" if self.settings.always else "cheaper").inc()
        self.table.note_routed(choice.prefill_worker_id, len(prompt_ids) - choice.cached_tokens)
        return RouteDecision(choice.prefill_worker_id, choice.cached_tokens, choice.cost_s, len(prefills)), decision.worker_id

    async def hand_over(self, flow: Flow, chunk: Any, route: Route, move: Move) -> Callable[[Any], Any] | None:
        """The next worker call of a request whose prefill worker's stream just ended; None: the relay decides
        (the stream broke or ended without handing the request back)."""
        if not self._on_prefill_worker(flow):
            flow.decode_worker = ""  # it runs on a decode worker now (the prefill stream broke and was retried there)
            return None
        if chunk is None:
            # The prefill stream broke: the relay decides. It may open it again on the same prefill worker (its media could
            # not be fetched there: encoded again, rows inline), and the hand-over then still waits at its end.
            return None
        decode_id, flow.decode_worker = flow.decode_worker, ""
        handoff: common_pb2.RequestState = chunk.handoff
        refused = await self._transfer(flow, chunk, decode_id)
        if refused is None:
            move(flow, RouteDecision(decode_id, 0, 0.0, 1))
            request_id = flow.record.request_id
            return lambda streams: streams.attach(worker_pb2.AttachRequest(request_id=request_id, from_index=flow.next_index))
        # Prefill again from the handed-back state (prompt and first token) on a decode worker; not on one that refused.
        self.metrics.transfers.labels(outcome=refused).inc()
        ids = list(handoff.prompt_token_ids) + list(handoff.output_token_ids)
        # Not on a decode worker that refused, left, or may hold a copy we stopped (a retried worker keeps the
        # stopped request's record a while, and a Generate of its id would stream that), while another can take it.
        try:
            decision = route(ids, frozenset({decode_id}) if refused in _AVOID else frozenset())
        except UnavailableError:
            decision = route(ids, frozenset())
        log.info("KV of %s not moved to %s (%s): prefilling again on %s", flow.record.request_id, decode_id, refused, decision.worker_id)
        move(flow, decision)
        return lambda streams: streams.generate(
            worker_pb2.GenerateRequest(request_id=flow.record.request_id, resume_from=handoff, media=flow.media)
        )

    async def _transfer(self, flow: Flow, chunk: Any, decode_id: str) -> str | None:
        """Moves the request onto `decode_id` with its KV; None when it runs there now, else why not (a metric label)."""
        registration = self.registrations.get(decode_id)
        if registration is None:
            return "unreachable"  # the decode worker left
        if not (chunk.handoff_kv_tokens and chunk.handoff_source):
            return "no_kv"
        handoff = chunk.handoff
        kv_tokens, bs = chunk.handoff_kv_tokens, self.settings.block_size
        # The prefix the decode worker caches already stays where it is: only the rest moves (whole blocks, and never
        # all of it: the decode worker's Restore takes at least one position).
        skip = min(flow.decode_cached_tokens, (kv_tokens - 1) // bs * bs) // bs * bs
        item = migration_pb2.RestoreItem(
            state=handoff, seed=handoff.sampling.seed, method=migration_pb2.MIGRATION_METHOD_TRANSFER, kv_tokens=kv_tokens,
            kv_from_token=max(0, skip),
            # The media ride along (rows inline, or handles the decode worker fetches from their encoder as a migration
            # target does): the moved KV covers their positions, but a preemption or a later hand-back computes them again.
            media=flow.media,
        )
        restore = worker_pb2.RestoreRequest(items=[item], kv_source_address=chunk.handoff_source, timeout_s=self.timeout_s)
        start = time.perf_counter()
        stub = self.channels.stub(registration.address)
        for attempt in range(2):
            try:
                reply = await stub.Restore(restore, timeout=self.timeout_s + _RESTORE_GRACE_S)
                break
            except grpc.aio.AioRpcError as error:
                log.warning("decode worker %s could not take %s: %s %s", decode_id, flow.record.request_id, error.code().name, error.details())
                # Once more after a connection the worker closed (a GOAWAY refuses calls it never started); then the
                # request prefills elsewhere, and a copy the worker may have started is stopped (it has no reader).
                closed = error.code() == grpc.StatusCode.UNAVAILABLE and _connection_closed(error)
                if attempt == 0 and closed:
                    continue
                if closed or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # It may have taken the request without our knowing: stopped there, before it prefills elsewhere.
                    await self._cancel(stub, flow.record.request_id)
                    return "timeout" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "lost"
                # The worker's own answer (UNAVAILABLE: the KV source failed or stalled past the deadline under its
                # fetch): it took nothing.
                return "failed"
        result = reply.results[0] if reply.results else None
        if result is None or not result.ok:
            code = result.code if result is not None else ""
            if code == "INVALID_REQUEST":
                await self._cancel(stub, flow.record.request_id)  # a retry found the first call's copy there: not ours to keep
                return "lost"
            log.info("decode worker %s refused %s: %s %s", decode_id, flow.record.request_id, code, result.message if result else "")
            return "refused" if code == "RESOURCE_EXHAUSTED" else "failed"
        self.metrics.transfers.labels(outcome="ok").inc()
        self.metrics.skipped_tokens.inc(item.kv_from_token)
        self.metrics.transfer_bytes.observe(reply.kv_bytes)
        self.metrics.transfer_bytes_total.inc(reply.kv_bytes)
        self.metrics.transfer_seconds.observe(reply.transfer_s)
        self.metrics.handover_seconds.observe(time.perf_counter() - start)
        return None

    def _on_prefill_worker(self, flow: Flow) -> bool:
        """Whether the request's stream that just ended was on a prefill worker (a worker that left counts as not)."""
        registration = self.registrations.get(flow.record.worker_id)
        return registration is not None and registration.role == PREFILL

    @staticmethod
    async def _cancel(stub: Any, request_id: str) -> None:
        """Stops a copy of the request the decode worker may have started (best effort)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=_RESTORE_GRACE_S)


def _connection_closed(error: grpc.aio.AioRpcError) -> bool:
    """Whether the call failed because the worker closed the connection under it (GOAWAY), not in the worker's code."""
    details = (error.details() or "").lower()
    return "too many pings" in details or "goaway" in details or "connection reset" in details
