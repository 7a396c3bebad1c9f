"""Moving one in-flight request to another worker, the cheapest way that is possible.

Where the request's state can come from, best first:
- a live source that parked it with its KV (a drain or a quarantine): (a) transfer;
- the checkpoint store's commit record (a dead source): (b) restore from it;
- what the caller delivered to the client so far: (c) re-prefill only.
The cost model compares KV bytes over the measured link with recomputing on
the target: the KV methods still recompute the tokens past their KV, so a
commit that lags far behind can lose to a fresh re-prefill. Targets are
tried in order of load among workers with enough free blocks, never the
failing one; a target that refuses (no blocks) passes the request on.

An engine of a failover slot (its registration names the slot) has a
natural heir: the slot's shadow, which takes the slot's lock the moment the
engine dies and registers a fraction of a second later. Its requests wait
for it (up to ``failover_wait_s``) and go there first; the usual choice
follows if it does not come or refuses.

Concurrent calls for the same request (the router saw the stream break
while health declared the worker dead) share one migration, and a finished
one answers late callers for `remember_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from phalanx._proto import checkpoint_pb2, checkpoint_pb2_grpc, common_pb2, migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import CheckpointStoreDirectory, DirectoryView, WorkerDirectory, addresses_of
from phalanx.common.errors import MEDIA_SOURCE_SUBJECT, FailedPreconditionError, InvalidRequestError, UnavailableError
from phalanx.common.events import EventBus
from phalanx.common.grpc_channels import GrpcChannels
from phalanx.common.roles import serves_requests
from phalanx.common.subjects import MIGRATION_EVENTS_SUBJECT
from phalanx.common.telemetry import get_tracer
from phalanx.migration.batching import Reservations, RestoreBatcher, SharedCalls
from phalanx.migration.config import MigrationConfig
from phalanx.migration.metrics import MigrationMetrics
from phalanx.migration.priority import PriorityGate, effective_priority

if TYPE_CHECKING:
    from opentelemetry.context import Context

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

M = migration_pb2
Registrations = Mapping[str, common_pb2.WorkerRegistration]
METHOD_NAMES = {
    M.MIGRATION_METHOD_TRANSFER: "transfer",
    M.MIGRATION_METHOD_CHECKPOINT: "checkpoint",
    M.MIGRATION_METHOD_REPREFILL: "reprefill",
    M.MIGRATION_METHOD_SEQUENTIAL_REPLAY: "sequential_replay",
}
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# A registration that states no block size (phalanx.model.kv_cache.BLOCK_SIZE; importing it would import torch here).
_DEFAULT_BLOCK_SIZE = 16
# KV bytes per token when neither a commit nor a registration states the layout (a worker from before it did): it
# only orders the methods, and recompute and transfer differ by orders of magnitude.
_UNKNOWN_BYTES_PER_TOKEN = 4096
_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
# A worker's commits listed for a burst serve its migrations that come this much later too (a dead worker writes no
# more; a live one's later tokens come with the router's known state, see _with_fresher_tokens).
_LISTING_REUSE_S = 0.1


@dataclass
class Plan:
    """How one request comes back: its state, method, and where its KV is."""

    state: common_pb2.RequestState
    seed: int
    method: M.MigrationMethod
    kv_tokens: int = 0
    kv_source: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.state.prompt_token_ids) + len(self.state.output_token_ids)


def choose_plan(
    strategy: str, *, handoff: Plan | None, commit: Plan | None, known: Plan | None, bytes_per_token: int,
    link_bytes_per_s: float, prefill_tokens_per_s: float, decode_step_s: float = 0.02, kv_overhead_s: float = 0.03,
) -> Plan:
    """The cheapest way allowed by the strategy (pure: unit-tested).

    A plan whose state holds fewer output tokens than the freshest one known
    must decode the missing ones again, one step each: a lagging commit
    costs that much more than a live source's exact state.
    """
    states = [p for p in (handoff, commit, known) if p is not None]
    if not states:
        raise InvalidRequestError("known_state", "nothing is known of this request: no handoff, no commit, no caller state")
    freshest = max(len(p.state.output_token_ids) for p in states)
    candidates: list[Plan] = []
    if strategy in ("checkpoint", "transfer-only") and handoff is not None and handoff.kv_tokens > 0:
        candidates.append(handoff)
    if strategy == "checkpoint" and commit is not None and commit.kv_tokens > 0:
        candidates.append(_with_fresher_tokens(commit, known))
    # Recomputing starts from an exact state: a live source's, else the freshest of the commit and what the client got
    # (the client's only for greedy requests: it carries no generator state).
    if handoff is not None:
        base = handoff
    else:
        usable = [p for p in (commit, known) if p is not None and (p is commit or p.state.sampling.temperature == 0 or commit is None)]
        base = max(usable, key=lambda p: len(p.state.output_token_ids))
    replay = M.MIGRATION_METHOD_SEQUENTIAL_REPLAY if strategy == "sequential-replay" else M.MIGRATION_METHOD_REPREFILL
    recompute = Plan(base.state, base.seed, replay)
    if not candidates:
        return recompute

    def cost(plan: Plan) -> float:
        behind = (freshest - len(plan.state.output_token_ids)) * decode_step_s
        if plan.method in (M.MIGRATION_METHOD_REPREFILL, M.MIGRATION_METHOD_SEQUENTIAL_REPLAY):
            return plan.num_tokens / prefill_tokens_per_s + behind
        moved = kv_overhead_s + plan.kv_tokens * bytes_per_token / link_bytes_per_s
        return moved + (plan.num_tokens - plan.kv_tokens) / prefill_tokens_per_s + behind

    return min([*candidates, recompute], key=cost)


def _with_fresher_tokens(commit: Plan, known: Plan | None) -> Plan:
    """The commit's KV under the caller's state when that extends the commit's tokens (greedy only: no generator state).

    The target then prefills the few positions past the KV in one pass instead of decoding them again step by step.
    """
    if known is None or known.state.sampling.temperature != 0:
        return commit
    committed, delivered = commit.state.output_token_ids, known.state.output_token_ids
    if len(delivered) <= len(committed) or list(delivered[: len(committed)]) != list(committed):
        return commit
    if list(known.state.prompt_token_ids) != list(commit.state.prompt_token_ids):
        return commit
    return Plan(known.state, commit.seed, commit.method, commit.kv_tokens, commit.kv_source)


class Placement(Protocol):
    async def target_for(self, request_id: str, source: str) -> str | None:
        """The worker `request_id`, handed back by `source`, was parked for (a rebalance's); None if none."""


class Migrator:
    def __init__(self, config: MigrationConfig, etcd_config: EtcdConfig, bus: EventBus | None, metrics: MigrationMetrics) -> None:
        self.config = config
        self.etcd_config = etcd_config
        self.bus = bus
        self.metrics = metrics
        # Kept current by their watches (`follow`): a migration reads them without an etcd round trip.
        self.workers = DirectoryView(WorkerDirectory(etcd_config))
        self.stores = DirectoryView(CheckpointStoreDirectory(etcd_config))
        self._inflight: dict[str, asyncio.Future] = {}
        # Migrations at once; the rest wait, premium first, whoever asked (health's DEAD event or a router).
        self._gate = PriorityGate(config.parallel)
        # Restores to one target (from one KV source) that come together go in one Restore call.
        self._batcher: RestoreBatcher[tuple[str, str], M.RestoreItem, worker_pb2.RestoreResult] = RestoreBatcher(
            self._send_restores, window_s=config.restore_batch_window_s
        )
        # A failed worker's requests arrive together: they share their etcd reads and the targets' Stats.
        self._reads: SharedCalls = SharedCalls()
        # (store, failed worker) -> its commits by request id: the rest of a burst reads them in one ListCommits.
        self._listings: SharedCalls = SharedCalls(reuse_s=_LISTING_REUSE_S)
        self._commit_reads: dict[str, int] = {}  # failed worker -> its migrations reading their commit now
        self._target_stats: SharedCalls = SharedCalls(reuse_s=config.target_stats_reuse_s)
        self._reserved = Reservations()
        # Each worker's latest NATS load report and when it came: targets are priced without a Stats call.
        self._loads: dict[str, tuple[common_pb2.LoadReport, float]] = {}
        self._done: dict[tuple[str, str], tuple[float, M.MigrateResponse]] = {}
        self._channels = GrpcChannels(_OPTIONS, traced=False)
        # First failure seen per worker (the restart strategy waits for a worker registered after it).
        self._failed_at: dict[str, float] = {}
        # The failover slot of every worker seen registered with one: a dead engine's key may be gone when asked.
        self._slots: dict[str, str] = {}
        # The requests of one dead engine wait for its slot's next engine together, and share what they find.
        self._heirs: SharedCalls = SharedCalls(reuse_s=1.0)
        # Measured as transfers happen (EMA), starting from the configured guess.
        self.link_bytes_per_s = config.link_bytes_per_s
        # Where rebalanced requests go (the service's Rebalancer; None: no rebalancing).
        self.placement: Placement | None = None

    async def close(self) -> None:
        await self._channels.close()
        await self.stores.close()
        await self.workers.close()

    async def follow(self) -> None:
        """Keeps the workers and stores views current; run as a task for the Migrator's life."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.workers.follow())
            tasks.create_task(self.stores.follow())

    def _channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    @property
    def loads(self) -> Mapping[str, tuple[common_pb2.LoadReport, float]]:
        """Each worker's latest NATS load report and the monotonic time it came."""
        return self._loads

    async def on_load(self, report: common_pb2.LoadReport, subject: str = "", context: Context | None = None) -> None:
        self._loads[report.worker_id] = (report, time.monotonic())

    # -- one request ------------------------------------------------------------------
    async def migrate(self, request: M.MigrateRequest) -> M.MigrateResponse:
        request_id = request.request_id
        if not request_id:
            raise InvalidRequestError("request_id", "is required")
        key = (request_id, request.worker_id)
        self._forget_old()
        done = self._done.get(key)
        if done is not None:
            return done[1]
        running = self._inflight.get(request_id)
        if running is None:
            running = self._inflight[request_id] = asyncio.ensure_future(self._migrate_in_turn(request))
            running.add_done_callback(lambda _f: self._inflight.pop(request_id, None))
        response = await asyncio.shield(running)
        self._done[key] = (time.monotonic(), response)
        return response

    def _forget_old(self) -> None:
        horizon = time.monotonic() - self.config.remember_s
        for key in [k for k, (at, _) in self._done.items() if at < horizon]:
            del self._done[key]

    async def _migrate_in_turn(self, request: M.MigrateRequest) -> M.MigrateResponse:
        priority = effective_priority(request.priority, request.known_state.priority, request.handoff.priority)
        async with self._gate.slot(priority):
            return await self._migrate(request)

    async def _migrate(self, request: M.MigrateRequest) -> M.MigrateResponse:
        start = time.perf_counter()
        with tracer.start_as_current_span("migration.migrate") as span:
            span.set_attribute("phalanx.request_id", request.request_id)
            span.set_attribute("phalanx.from_worker", request.worker_id)
            store_address, commit, stored_media = await self._commit(request)
            handoff = known = None
            if request.HasField("handoff") and request.handoff.prompt_token_ids:
                handoff = Plan(request.handoff, request.handoff.sampling.seed, M.MIGRATION_METHOD_TRANSFER,
                               request.handoff_kv_tokens, request.handoff_source_address)
            if request.HasField("known_state") and request.known_state.prompt_token_ids:
                known = Plan(request.known_state, request.seed or request.known_state.sampling.seed, M.MIGRATION_METHOD_REPREFILL)
            registrations = await self._reads.get("workers", self.workers.get)
            if self.config.strategy == "restart":
                # The coarse baseline: nothing is moved to the survivors; the request waits for a restarted worker
                # (one that registered after the failure) and is replayed there from scratch.
                registrations = await self._replacements(request.worker_id)
                commit = None
            layout_bytes = commit[1] if commit is not None else 0
            source = registrations.get(request.worker_id)
            largest = max((p for p in (handoff, commit[0] if commit else None, known) if p is not None), key=lambda p: p.num_tokens, default=None)
            # The likely target's own measured rates price recomputing; the link's measured bandwidth prices moving KV.
            target = await self._heir(request.worker_id, source) if self.config.strategy != "restart" else None
            planned = await self._planned(request) if target is None and handoff is not None else None
            if planned is not None and largest is not None:
                # A rebalance parked it for that worker; the usual choice if it cannot take it (gone, full, draining).
                subset = {w: r for w, r in registrations.items() if w in (planned, request.worker_id)}
                target = await self._pick_target(largest, subset, {request.worker_id})
            if target is None and largest is not None and request.avoid_worker_ids:
                # Scattered: away from where the other suspects of a crash went, while another worker can take it.
                target = await self._pick_target(largest, registrations, {request.worker_id, *request.avoid_worker_ids})
            if target is None and largest is not None:
                target = await self._pick_target(largest, registrations, {request.worker_id})
            stats = target[1] if target is not None else None
            # Without a commit's layout, the failed worker's registration tells it (else the target's: the same model).
            bytes_per_token = layout_bytes or registration_bytes_per_token(source, target[0] if target is not None else None)
            plan = choose_plan(
                self.config.strategy, handoff=handoff, commit=commit[0] if commit else None, known=known,
                bytes_per_token=bytes_per_token, link_bytes_per_s=self.link_bytes_per_s,
                prefill_tokens_per_s=(stats.prefill_tokens_per_s if stats and stats.prefill_tokens_per_s > 0 else self.config.prefill_tokens_per_s),
                decode_step_s=(stats.step_time_ms / 1e3 if stats and stats.step_time_ms > 0 else 0.02),
                kv_overhead_s=self.config.kv_restore_overhead_s,
            )
            if plan.method == M.MIGRATION_METHOD_CHECKPOINT:
                plan.kv_source = store_address
            # The caller's embeddings if it sent them (a router), else the store's: a request moved by health's DEAD
            # trigger, or by a router other than the one that encoded its media, has no other copy.
            media = request.media or stored_media
            response = await self._restore(request, plan, registrations, media, first=target[0] if target else None)
            response.seconds = time.perf_counter() - start
            if planned is not None:
                self.metrics.rebalance_placed.labels(target="planned" if response.worker_id == planned else "other").inc()
            method = METHOD_NAMES[response.method]
            span.set_attribute("phalanx.method", method)
            span.set_attribute("phalanx.to_worker", response.worker_id)
        self.metrics.migrations.labels(method=method).inc()
        self.metrics.duration.labels(method=method).observe(response.seconds)
        log.info("migrated %s from %s to %s by %s in %.3f s", request.request_id, request.worker_id, response.worker_id, method, response.seconds)
        if self.bus is not None:
            await self.bus.publish(MIGRATION_EVENTS_SUBJECT, M.MigrationEvent(
                request_id=request.request_id, from_worker_id=request.worker_id, worker_id=response.worker_id,
                worker_address=response.worker_address, method=response.method, at=time.time(),
            ))
        return response

    async def _planned(self, request: M.MigrateRequest) -> str | None:
        """The worker a rebalance parked this handed-back request for (None: no rebalance's, or none runs)."""
        return await self.placement.target_for(request.request_id, request.worker_id) if self.placement is not None else None

    async def _heir(
        self, failed_worker: str, source: common_pb2.WorkerRegistration | None
    ) -> tuple[common_pb2.WorkerRegistration, common_pb2.LoadReport] | None:
        """The failed engine's failover slot's next engine, once registered (None: not an engine of a slot, or none came)."""
        if source is not None and source.failover_slot:
            self._slots[failed_worker] = source.failover_slot
        slot = self._slots.get(failed_worker)
        if not slot or self.config.failover_wait_s <= 0:
            return None
        heir = await self._heirs.get((slot, failed_worker), lambda: self._wait_for_heir(slot, failed_worker))
        if heir is None:
            return None
        load = (await self._loads_of({heir.worker_id: heir})).get(heir.worker_id)
        return heir, load or common_pb2.LoadReport(worker_id=heir.worker_id, total_blocks=heir.total_blocks, free_blocks=heir.total_blocks)

    async def _wait_for_heir(self, slot: str, failed_worker: str) -> common_pb2.WorkerRegistration | None:
        started = time.monotonic()
        deadline = started + self.config.failover_wait_s
        while True:
            registrations = await self.workers.get()
            for worker_id, registration in registrations.items():
                if registration.failover_slot:
                    self._slots[worker_id] = registration.failover_slot
            heirs = [r for w, r in registrations.items() if r.failover_slot == slot and w != failed_worker]
            if heirs:
                heir = max(heirs, key=lambda r: r.started_at)
                log.info("%s's slot %s is served by %s now (found after %.3f s)", failed_worker, slot, heir.worker_id,
                         time.monotonic() - started)
                return heir
            if time.monotonic() >= deadline:
                log.warning("no engine of %s's slot %s registered within %.1f s; migrating to peers", failed_worker, slot,
                            self.config.failover_wait_s)
                return None
            await asyncio.sleep(0.01)

    async def _commit(
        self, request: M.MigrateRequest
    ) -> tuple[str, tuple[Plan, int] | None, Sequence[common_pb2.MediaEmbedding]]:
        """The address of the store holding the request's commit record, that record as a plan (with KV bytes per
        token) and the embeddings of its media the store holds; ("", None, ()) without one.

        Every advertised store is asked in turn: while a crashed store's advertisement lingers for its lease TTL,
        the workers already stream to its replacement.
        """
        if self.config.strategy not in ("checkpoint",):
            return "", None, ()
        reply = None
        stores = await self.store_addresses()
        burst = self._commit_reads.get(request.worker_id, 0) > 0
        self._commit_reads[request.worker_id] = self._commit_reads.get(request.worker_id, 0) + 1
        try:
            for store in stores:
                try:
                    reply = await self._commit_in(store, request, burst=burst)
                    break
                except grpc.aio.AioRpcError as error:
                    if error.code() != grpc.StatusCode.NOT_FOUND:
                        log.warning("checkpoint store %s: %s", store, error.details())
        finally:
            self._commit_reads[request.worker_id] -= 1
            if not self._commit_reads[request.worker_id]:
                del self._commit_reads[request.worker_id]
        if reply is None:
            return "", None, ()
        record, layout = reply.commit, reply.commit.layout
        per_token = kv_bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
        return store, (Plan(record.state, record.seed, M.MIGRATION_METHOD_CHECKPOINT, record.kv_tokens), per_token), reply.media

    async def _commit_in(self, store: str, request: M.MigrateRequest, *, burst: bool) -> checkpoint_pb2.GetCommitResponse:
        """The request's commit record in `store`, with the media embeddings the store holds for it where the caller
        brought none; NOT_FOUND (AioRpcError) if it holds none.

        A migration that finds another of its worker's still reading its commit is part of a burst (the worker died
        with all of its streams): those read the worker's commits in one shared ListCommits rather than one GetCommit
        each. The first asks alone, so that one broken stream of a live worker does not list all of its requests. A
        listing carries no embeddings: a listed request that needs the store's asks for them alone.
        """
        stub = checkpoint_pb2_grpc.CheckpointStoreStub(self._channel(store))
        if burst and request.worker_id:
            held = await self._listings.get((store, request.worker_id), lambda: _commits_of(stub, request.worker_id))
            record = held.get(request.request_id)
            if record is not None and (not record.media_held or request.media):
                return checkpoint_pb2.GetCommitResponse(commit=record)
        return await stub.GetCommit(checkpoint_pb2.GetCommitRequest(request_id=request.request_id), timeout=1.0)

    async def _replacements(self, failed_worker: str) -> dict:
        failed_at = self._failed_at.setdefault(failed_worker, time.time())
        deadline = time.monotonic() + 6 * self.config.restore_timeout_s
        while time.monotonic() < deadline:
            fresh = {w: r for w, r in (await self.workers.get()).items() if r.started_at > failed_at}
            if fresh:
                return fresh
            await asyncio.sleep(0.05)
        raise UnavailableError(
            f"no worker restarted within {6 * self.config.restore_timeout_s:.0f} s of {failed_worker}'s failure", retry_after_s=1.0
        )

    async def store_addresses(self) -> list[str]:
        """Each advertised store's address, in key order."""
        return addresses_of(await self._reads.get("stores", self.stores.get))

    async def _restore(
        self, request: M.MigrateRequest, plan: Plan, registrations: Registrations, media: Sequence[common_pb2.MediaEmbedding],
        first: common_pb2.WorkerRegistration | None = None,
    ) -> M.MigrateResponse:
        tried: set[str] = {request.worker_id}
        last_error = "no worker can take it"
        for attempt in range(self.config.max_attempts):
            if attempt == 0 and first is not None:
                target = first
            else:
                picked = await self._pick_target(plan, registrations, tried)
                if picked is None:
                    break
                target = picked[0]
            tried.add(target.worker_id)
            state = common_pb2.RequestState()
            state.CopyFrom(plan.state)
            state.request_id = request.request_id
            state.sampling.seed = plan.seed
            item = M.RestoreItem(state=state, seed=plan.seed, method=plan.method, kv_tokens=plan.kv_tokens, media=media)
            try:
                with self._reserved.hold(target.worker_id, blocks_for(plan.num_tokens, target.block_size)):
                    result = await self._batcher.submit((target.address, plan.kv_source), item)
            except grpc.aio.AioRpcError as error:
                last_error = f"{target.worker_id}: {error.code().name}: {error.details()}"
                if plan.method in (M.MIGRATION_METHOD_TRANSFER, M.MIGRATION_METHOD_CHECKPOINT) and error.code() == grpc.StatusCode.UNAVAILABLE:
                    # The KV source failed (or the target): recompute instead, on the next target.
                    log.warning("KV restore of %s failed (%s); re-prefilling", request.request_id, last_error)
                    plan = Plan(plan.state, plan.seed, M.MIGRATION_METHOD_REPREFILL)
                continue
            if result.ok:
                return M.MigrateResponse(
                    request_id=request.request_id, worker_id=target.worker_id, worker_address=target.address, method=plan.method,
                    restored_outputs=len(plan.state.output_token_ids),
                )
            last_error = f"{target.worker_id}: {result.code}: {result.message}"
            if result.code == "INVALID_ARGUMENT":
                raise InvalidRequestError("request", last_error)
            if result.subject == MEDIA_SOURCE_SUBJECT:
                # The encoder holding its media (direct delivery) died or dropped them: another target would not fetch
                # them either. The caller (the router) encodes them again and asks once more, rows inline.
                raise FailedPreconditionError(
                    f"request {request.request_id} could not be migrated: {last_error}", subject=MEDIA_SOURCE_SUBJECT,
                )
        self.metrics.failures.inc()
        raise UnavailableError(f"request {request.request_id} could not be migrated ({last_error})", retry_after_s=0.5)

    async def _send_restores(self, key: tuple[str, str], items: list[M.RestoreItem]) -> list[worker_pb2.RestoreResult]:
        """One Restore call to the target `key[0]` with every item, KV from `key[1]`; a result per item, in order."""
        address, kv_source = key
        transport = M.KV_TRANSPORT_GRPC if self.config.transport == "grpc" else M.KV_TRANSPORT_CHANNEL
        reply = await worker_pb2_grpc.WorkerServiceStub(self._channel(address)).Restore(
            worker_pb2.RestoreRequest(items=items, kv_source_address=kv_source, transport=transport, timeout_s=self.config.restore_timeout_s),
            timeout=self.config.restore_timeout_s + 2.0,
        )
        if reply.transfer_s > 0 and reply.kv_bytes > 1 << 20:
            self.link_bytes_per_s = 0.8 * self.link_bytes_per_s + 0.2 * reply.kv_bytes / reply.transfer_s
        self.metrics.kv_bytes.inc(reply.kv_bytes)
        self.metrics.restore_calls.observe(len(items))
        results = {r.request_id: r for r in reply.results}
        missing = worker_pb2.RestoreResult(ok=False, code="UNAVAILABLE", message="the target returned no result for it")
        return [results.get(i.state.request_id, missing) for i in items]

    async def _pick_target(
        self, plan: Plan, registrations: Registrations, exclude: set[str]
    ) -> tuple[common_pb2.WorkerRegistration, common_pb2.LoadReport] | None:
        """(registration, load report) of the least loaded live worker with the blocks for the request.

        Load and free blocks are the workers' latest load reports (a Stats call, shared by the migrations of a
        burst, for those with none fresh) plus what migrations still in flight have reserved on them. Workers of
        the failed one's tensor-parallel size come first: greedy outputs are bit-identical only between groups of
        the same size. Any other worker with room is the fallback.
        """
        # Never a prefill worker: it would hand the request on again after one token (common/roles.py).
        candidates = {w: r for w, r in registrations.items() if w not in exclude and serves_requests(r.role)}
        # The failed worker is excluded but often still registered (its lease outlives it by a TTL); failed targets
        # excluded later were picked with the same preference, so their size is the one to keep.
        source_sizes = {r.tensor_parallel_size or 1 for worker_id, r in registrations.items() if worker_id in exclude}
        loads = await self._loads_of(candidates)
        usable = []
        for worker_id, registration in candidates.items():
            load, (requests, blocks) = loads.get(worker_id), self._reserved.of(worker_id)
            needed = blocks_for(plan.num_tokens, registration.block_size)
            if load is not None and not load.draining and load.free_blocks - blocks >= needed:
                usable.append((registration, load, load.queue_depth + load.running_seqs + requests, load.free_blocks - blocks))
        if not usable:
            return None
        same_size = [u for u in usable if (u[0].tensor_parallel_size or 1) in source_sizes]
        registration, load, _, _ = min(same_size or usable, key=lambda u: (u[2], -u[3]))
        return registration, load

    async def _loads_of(self, registrations: Registrations) -> dict[str, common_pb2.LoadReport | None]:
        """Each worker's load: its report if fresh, else from a Stats call (None: neither)."""
        now = time.monotonic()
        if len(self._loads) > 2 * len(registrations) + 16:  # workers that left stop reporting: forget them
            self._loads = {w: (report, at) for w, (report, at) in self._loads.items() if now - at < 60.0}
        oldest = now - self.config.load_report_max_age_s
        loads: dict[str, common_pb2.LoadReport | None] = {
            w: report for w, (report, at) in self._loads.items() if w in registrations and at >= oldest
        }
        if missing := {w: r for w, r in registrations.items() if w not in loads}:
            key = frozenset((w, r.address) for w, r in missing.items())
            loads.update(await self._target_stats.get(key, lambda: self._stats_of(missing)))
        return loads

    async def _stats_of(self, registrations: Registrations) -> dict[str, common_pb2.LoadReport | None]:
        """Each worker's Stats as a load report (None: no answer within 0.5 s), asked in parallel."""

        async def stats(registration: common_pb2.WorkerRegistration) -> common_pb2.LoadReport | None:
            try:
                s = await worker_pb2_grpc.WorkerServiceStub(self._channel(registration.address)).Stats(
                    worker_pb2.StatsRequest(), timeout=0.5
                )
            except grpc.aio.AioRpcError:
                return None
            return common_pb2.LoadReport(
                worker_id=s.worker_id, queue_depth=s.queue_depth, running_seqs=s.running_seqs, free_blocks=s.free_blocks,
                total_blocks=s.total_blocks, step_time_ms=s.step_time_ms, prefill_tokens_per_s=s.prefill_tokens_per_s,
                decode_tokens_per_s=s.decode_tokens_per_s, draining=s.draining,
            )

        answers = await asyncio.gather(*(stats(r) for r in registrations.values()))
        return dict(zip(registrations, answers, strict=True))

    # -- a whole worker -----------------------------------------------------------------
    async def migrate_worker(self, worker_id: str, reason: str) -> M.MigrateWorkerResponse:
        """Every request the store holds for `worker_id`, in parallel (bounded), premium first."""
        held: dict[str, checkpoint_pb2.CommitRecord] = {}
        for store in await self.store_addresses():  # a replacement store may hold some while the old one lingers
            try:
                listing = await _commits_of(checkpoint_pb2_grpc.CheckpointStoreStub(self._channel(store)), worker_id, timeout=2.0)
            except grpc.aio.AioRpcError as error:
                log.warning("checkpoint store %s: %s", store, error.details())
                continue
            for request_id, commit in listing.items():
                held.setdefault(request_id, commit)
        response = M.MigrateWorkerResponse()
        # A request whose media embeddings the store does not all hold (a writer from before it kept them, or items that
        # did not fit) cannot be moved from here: every target would refuse it (FAILED_PRECONDITION), and a router
        # asking meanwhile would share that failure. The router relaying it holds them, and moves its requests off a
        # worker declared DEAD itself.
        for commit in [c for c in held.values() if c.media_held < len(c.state.media)]:
            del held[commit.request_id]
            response.left_to_router.append(commit.request_id)
            self.metrics.left_to_router.inc()

        async def one(commit: checkpoint_pb2.CommitRecord) -> None:
            request = M.MigrateRequest(request_id=commit.request_id, worker_id=worker_id, reason=reason, priority=commit.state.priority)
            try:
                response.migrated.append(await self.migrate(request))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                log.warning("migrating %s off %s failed: %s", commit.request_id, worker_id, exc)
                response.failed.append(commit.request_id)

        # In priority order, so that equal priorities queue at the gate in the store's order.
        commits = sorted(held.values(), key=lambda c: effective_priority(c.state.priority))
        await asyncio.gather(*(one(c) for c in commits))
        return response


async def _commits_of(stub: checkpoint_pb2_grpc.CheckpointStoreStub, worker_id: str, *,
                      timeout: float = 1.0) -> dict[str, checkpoint_pb2.CommitRecord]:
    listing = await stub.ListCommits(checkpoint_pb2.ListCommitsRequest(worker_id=worker_id), timeout=timeout)
    return {commit.request_id: commit for commit in listing.commits}


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks a request of `num_tokens` needs on a target with `block_size` (0: unstated): its tokens and the next one's."""
    return -(-(num_tokens + 1) // (block_size or _DEFAULT_BLOCK_SIZE))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one token position's KV: a key and a value per layer and KV head (an unknown dtype counts 4 bytes)."""
    return num_layers * 2 * num_kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def registration_bytes_per_token(*registrations: common_pb2.WorkerRegistration | None) -> int:
    """KV bytes per token by the first registration that states its KV layout (older workers' do not)."""
    for r in registrations:
        if r is not None and r.num_layers > 0:
            return kv_bytes_per_token(r.num_layers, r.num_kv_heads, r.head_dim, r.kv_dtype)
    return _UNKNOWN_BYTES_PER_TOKEN
