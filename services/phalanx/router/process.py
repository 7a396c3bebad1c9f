"""The router's lifecycle, in one place.

Start: health NOT_SERVING -> connect NATS (subscribe KV and load events
first, so nothing falls between the snapshot and the stream) -> list
workers, health records and the degradation level from etcd -> KvSnapshot
every worker into the index -> open the request-record session -> register
-> SERVING. A fresh replica therefore routes with a full view at once.
While serving, it publishes its per-tenant usage every tenant_usage_interval_s
and counts the other routers' reports against each tenant's limits.
Stop: NOT_SERVING -> let streams finish for a grace period (clients resume
elsewhere afterwards) -> revoke the registration (records stay for the
resume window) -> close NATS and etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid

import grpc

from phalanx._proto import common_pb2, migration_pb2, router_pb2, router_pb2_grpc, worker_pb2
from phalanx.common.config import EtcdConfig, NatsConfig, TelemetryConfig
from phalanx.common.discovery import EncoderDirectory, EtcdDirectory, WorkerDirectory, encode_json
from phalanx.common.errors import UnavailableError
from phalanx.common.events import EventBus, MessageTooLargeError, check_kv_event, check_load_report, check_tenant_usage_report
from phalanx.common.lease import Backoff
from phalanx.common.service import ServerTls, ServiceShell
from phalanx.common.subjects import (
    DEGRADATION_SUBJECT,
    HEALTH_EVENTS_ALL,
    HEALTH_PREFIX,
    KV_EVENTS_ALL,
    LOAD_ALL,
    MIGRATION_EVENTS_SUBJECT,
    SPARES_PREFIX,
    TENANT_USAGE_SUBJECT,
    health_report_subject,
    router_key,
    validate_worker_id,
)
from phalanx.common.watched import DEGRADATION, StateFollower
from phalanx.model.config import is_builtin_model, model_tokenizer, served_model
from phalanx.model.tokenizer import Tokenizer
from phalanx.router.admission import Admission, QueueSettings
from phalanx.router.config import RouterConfig
from phalanx.router.limits import FleetUsage, TenantUsage, UsageReport
from phalanx.router.media import EmbeddingCache, EncoderSet, MediaEncoder
from phalanx.router.metrics import RouterMetrics, tenant_label
from phalanx.router.migration_client import MigrationClient
from phalanx.router.quarantine import QuarantineStore, RequestQuarantine
from phalanx.router.records import RequestRecords
from phalanx.router.routing import RoutingTable
from phalanx.router.server import RouterServicer, WorkerChannels
from phalanx.router.slo import LatencySlo

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
_SHUTDOWN_GRACE_S = 5.0
# The shortest gap between two usage reports, as a fraction of the interval: an early report after a new stream comes
# no sooner (a busy router sends at most 1 / _EAGER_FRACTION reports an interval).
_EAGER_FRACTION = 0.125


class RouterProcess:
    def __init__(self, config: RouterConfig, nats: NatsConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.nats_config = nats
        self.etcd_config = etcd
        self.telemetry_config = telemetry
        self.router_id = validate_worker_id(config.router_id or f"router-{socket.gethostname()}-{os.getpid()}")
        self.metrics = RouterMetrics()
        limit = config.max_message_bytes
        self.shell = ServiceShell(
            "phalanx-router", config, telemetry, registry=self.metrics.registry, shutdown_grace_s=_SHUTDOWN_GRACE_S,
            tls=ServerTls(config.tls_cert_file, config.tls_key_file) if config.tls_cert_file else None,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # SDK clients ping every 20 s on quiet streams (long prefills); the default would GOAWAY them.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self.health = self.shell.health
        self.ready = self.shell.ready
        self.table = RoutingTable(load_stale_s=config.load_stale_s)
        # The fleet's tenant limits (docs/tenants.md, "Where the counts live"); None: each router holds them alone.
        self.fleet = FleetUsage(self.router_id) if config.tenant_usage_interval_s > 0 else None
        self._incarnation = uuid.uuid4().hex
        self._usage_wake = asyncio.Event()
        self.admission = Admission(
            config.tenants, config.api_keys, retry_after_s=config.no_worker_retry_after_s, premium_at_level_4=config.premium_at_level_4,
            limit_defaults=config.tenant_limits,
            queue=QueueSettings(
                max_streams=config.max_streams, timeout_s=config.queue_timeout_s, max_per_tenant=config.max_queued_per_tenant,
                retry_after_s=config.tenant_retry_after_s,
            ),
            fleet=self.fleet,
        )
        if self.fleet is not None:
            self.admission.on_admitted = self._usage_wake.set
        self._resync_wanted: set[str] = set()
        self._resync_wake = asyncio.Event()
        self._tokenizers: dict[str, Tokenizer] = {}
        self.servicer: RouterServicer | None = None
        # Poison requests: the fleet's quarantined fingerprints, followed in etcd, and this router's crash attribution.
        self.quarantine_store = QuarantineStore(etcd)
        self.quarantine = RequestQuarantine(config, self.router_id, self.metrics, self.quarantine_store)
        self._bus: EventBus | None = None

    @property
    def _servicer(self) -> RouterServicer:
        assert self.servicer is not None, "used before run() built it"
        return self.servicer

    @property
    def address(self) -> str:
        return self.shell.address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        async with self.shell as shell:
            records = RequestRecords(self.etcd_config, self.router_id, resume_window_s=self.config.resume_window_s)
            channels = WorkerChannels(self.config.max_message_bytes, multiplex=self.config.multiplex_worker_streams)
            shell.push_async_callback(channels.close)
            migration = self.migration = MigrationClient(self.etcd_config)
            shell.push_async_callback(migration.close)
            encoders = EncoderSet()
            media_encoder = MediaEncoder(
                encoders, timeout_s=self.config.encode_timeout_s, max_message_bytes=self.config.max_message_bytes,
                on_retry=self.metrics.encode_retries.inc, cache=EmbeddingCache(self.config.embedding_cache_bytes),
                on_cache_hit=self.metrics.embedding_cache_hits.inc,
            )
            shell.push_async_callback(media_encoder.close)
            shell.push_async_callback(self._close_quarantine)
            servicer = self.servicer = RouterServicer(
                self.router_id, self.config, self.table, self.admission, records, channels, self.metrics, tokenizer=self._tokenizer,
                on_broken_stream=self._report_broken_stream, migrate=migration.migrate if self.config.migration else None,
                media_encoder=media_encoder, quarantine=self.quarantine)
            shell.add_service(SERVICE_NAME, router_pb2_grpc.add_RouterServiceServicer_to_server, servicer)
            await shell.start()
            workers = WorkerDirectory(self.etcd_config)
            healths = EtcdDirectory(self.etcd_config, prefix=HEALTH_PREFIX, message_type=common_pb2.WorkerHealthRecord)
            degradation = StateFollower(self.etcd_config, DEGRADATION)
            spares = EtcdDirectory(self.etcd_config, prefix=SPARES_PREFIX, message_type=common_pb2.HotSpareRecord)
            encoder_directory = EncoderDirectory(self.etcd_config)
            for directory in (workers, healths, degradation, spares, encoder_directory):
                shell.push_async_callback(directory.close)
            bus = await shell.connect_nats(self.nats_config, name=f"router-{self.router_id}")
            rejected = self._bus_rejected
            await bus.subscribe(KV_EVENTS_ALL, common_pb2.KvEvent, self._on_kv_event, check=check_kv_event, on_rejected=rejected)
            await bus.subscribe(LOAD_ALL, common_pb2.LoadReport, self._on_load, check=check_load_report, on_rejected=rejected)
            # Health changes arrive on NATS first (the etcd watch confirms them); versions keep the newest.
            await bus.subscribe(HEALTH_EVENTS_ALL, common_pb2.WorkerHealthRecord, self._on_health_event)
            await bus.subscribe(DEGRADATION_SUBJECT, common_pb2.DegradationState, self._on_degradation_event)
            # A request moved off a worker its relay still reads (hung, lease lapsed): the relay follows it.
            await bus.subscribe(MIGRATION_EVENTS_SUBJECT, migration_pb2.MigrationEvent, self._on_migration_event)
            if self.fleet is not None:
                await bus.subscribe(
                    TENANT_USAGE_SUBJECT, common_pb2.TenantUsageReport, self._on_usage_report, check=check_tenant_usage_report,
                    on_rejected=rejected,
                )
            self._bus = bus
            # Spares first: a spare's registration must never make it routable, not even for an instant.
            for worker_id, spare in (await spares.list()).items():
                self._on_spare("put", worker_id, spare)
            for worker_id, reg in (await workers.list()).items():
                self._on_worker("put", worker_id, reg)
            for worker_id, record in (await healths.list()).items():
                self._on_health("put", worker_id, record)
            self._on_degradation(await degradation.read())
            for encoder_id, registration in (await encoder_directory.list()).items():
                encoders.update("put", encoder_id, registration)
            await self._initial_sync(channels)
            await self.quarantine_store.start()  # the quarantined fingerprints are refused from the first request on
            await records.start()
            shell.push_async_callback(records.close)
            await shell.register(self.etcd_config, router_key(self.router_id), self._registration())
            await shell.set_serving(True)
            log.info("router %s serving on %s with %d workers", self.router_id, self.address, len(servicer.registrations))
            async with asyncio.TaskGroup() as tasks:
                loops = [
                    tasks.create_task(workers.follow(self._on_worker)),
                    tasks.create_task(healths.follow(self._on_health)),
                    tasks.create_task(degradation.follow(self._on_degradation)),  # NATS brings a change first, this confirms it
                    tasks.create_task(spares.follow(self._on_spare)),
                    tasks.create_task(encoder_directory.follow(encoders.update)),
                    tasks.create_task(migration.follow()),
                    tasks.create_task(self.quarantine_store.follow()),
                    tasks.create_task(self._resync_loop(channels)),
                    tasks.create_task(self._gauges_loop()),
                ]
                if self.fleet is not None:
                    loops.append(tasks.create_task(self._usage_loop(bus)))
                await shell.wait_for_stop()
                await shell.stop_server()
                for task in loops:
                    task.cancel()
            if self.fleet is not None:
                await self._publish_usage(bus)  # its streams have ended: the others need not wait for it to expire

    async def _close_quarantine(self) -> None:
        if self.servicer is not None:
            await self.servicer.gate.close()  # its requests are held no longer: the server stopped
        await self.quarantine.close()
        await self.quarantine_store.close()

    def _registration(self) -> bytes:
        return encode_json(
            common_pb2.RouterRegistration(
                router_id=self.router_id, address=self.address, pid=os.getpid(), metrics_address=self.shell.metrics_address,
                started_at=time.time(),
            )
        )

    def _tokenizer(self) -> Tokenizer:
        """The deployment's tokenizer: the configured model's, else the workers' built-in model's."""
        name = self.config.model
        if not name:
            models = {r.model for r in self._servicer.registrations.values()}
            if not models:
                raise UnavailableError("no worker is registered yet", retry_after_s=self.config.no_worker_retry_after_s)
            name = served_model(sorted(models)[0])  # simulated workers tokenize as their profiled model
            if not is_builtin_model(name):
                raise UnavailableError(
                    f"workers serve the checkpoint {name!r}: start the router with --model <its directory> to tokenize for it",
                    retry_after_s=5.0,
                )
        tokenizer = self._tokenizers.get(name)
        if tokenizer is None:
            tokenizer = self._tokenizers[name] = model_tokenizer(name)
        return tokenizer

    # -- membership and shared state ------------------------------------------
    def _on_worker(self, kind: str, worker_id: str, registration: common_pb2.WorkerRegistration | None) -> None:
        registrations = self._servicer.registrations
        if kind == "delete":
            gone = registrations.pop(worker_id, None)
            self.table.remove_worker(worker_id)
            self._servicer.gate.forget_worker(worker_id)
            self._resync_wanted.discard(worker_id)
            if gone is not None:
                log.info("worker %s left routing", worker_id)
                self._servicer.channels.retire(gone.address)
            return
        assert registration is not None  # a put carries its message
        registrations[worker_id] = registration
        changed = self.table.upsert_worker(
            worker_id, registration.address, pid=registration.pid, model=registration.model, total_blocks=registration.total_blocks,
            role=registration.role,
        )
        if changed:
            self._want_resync(worker_id)

    def _on_spare(self, kind: str, worker_id: str, record: common_pb2.HotSpareRecord | None) -> None:
        """A hot spare's mark: put, out of routing; delete, promoted (or gone), routable from now on."""
        self.table.set_spare(worker_id, kind == "put")
        if kind == "delete" and worker_id in self.table:
            log.info("hot spare %s promoted: routable", worker_id)

    def _on_health(self, kind: str, worker_id: str, record: common_pb2.WorkerHealthRecord | None) -> None:
        records = self._servicer.health_records
        if kind == "delete":
            records.pop(worker_id, None)
            self.table.set_weight(worker_id, 1.0)
            return
        assert record is not None  # a put carries its message
        known = records.get(worker_id)
        if known is not None and record.version < known.version and record.worker_started_at == known.worker_started_at:
            return  # an older state arriving late (NATS and the etcd watch interleave)
        records[worker_id] = record
        self.table.set_weight(worker_id, min(1.0, max(0.0, record.routing_weight)), health=record.health)
        if record.health == common_pb2.WORKER_HEALTH_DEAD and self.servicer is not None:
            self._servicer.on_worker_dead(worker_id, record.worker_started_at)

    async def _on_health_event(self, record: common_pb2.WorkerHealthRecord, subject: str, context) -> None:
        self._on_health("put", record.worker_id, record)

    async def _on_migration_event(self, event: migration_pb2.MigrationEvent, subject: str, context) -> None:
        self._servicer.on_migrated(event)

    async def _on_degradation_event(self, state: common_pb2.DegradationState, subject: str, context) -> None:
        self._on_degradation(state)

    def _report_broken_stream(self, worker_id: str, error: grpc.aio.AioRpcError) -> None:
        """Tell the health service at once: it probes the worker instead of waiting for a canary or the lease."""
        if self._bus is None:
            return
        report = common_pb2.WorkerStreamBroken(
            worker_id=worker_id, router_id=self.router_id, code=error.code().name, detail=(error.details() or "")[:200], timestamp=time.time()
        )
        asyncio.get_running_loop().create_task(self._bus.publish(health_report_subject(worker_id), report))

    def _on_degradation(self, state: common_pb2.DegradationState | None) -> None:
        level = 0 if state is None else state.level
        if level != self.admission.level:
            log.warning("degradation level %d -> %d%s", self.admission.level, level, f" ({state.reason})" if state and state.reason else "")
        self.admission.level = level
        if self.servicer is not None:
            self._servicer.slo = self._servicer.gate.slo = LatencySlo.from_state(state)
        self.metrics.degradation.set(level)

    # -- KV index and load ---------------------------------------------------------
    def _bus_rejected(self, subject_kind: str) -> None:
        self.metrics.bus_rejected.labels(subject_kind=subject_kind).inc()

    async def _on_kv_event(self, event: common_pb2.KvEvent, subject: str, context) -> None:
        if self.table.on_kv_event(event):
            self._want_resync(event.worker_id)

    async def _on_load(self, report: common_pb2.LoadReport, subject: str, context) -> None:
        self.table.update_load(report)
        if self.servicer is not None:
            self._servicer.gate.on_load(report)

    def _want_resync(self, worker_id: str) -> None:
        self._resync_wanted.add(worker_id)
        self._resync_wake.set()

    async def _snapshot(self, channels: WorkerChannels, worker_id: str) -> bool:
        """Load one worker's KvSnapshot into the index; False if it failed (try again later)."""
        registration = self._servicer.registrations.get(worker_id)
        if registration is None:
            return True
        try:
            snapshot = await channels.stub(registration.address).KvSnapshot(
                worker_pb2.KvSnapshotRequest(), timeout=self.config.snapshot_timeout_s
            )
        except grpc.aio.AioRpcError as error:
            log.info("KvSnapshot of %s failed (%s); retrying", worker_id, error.code().name)
            return False
        if worker_id not in self._servicer.registrations:
            return True
        self.metrics.kv_resyncs.inc()
        if self.table.load_kv_snapshot(worker_id, snapshot.sequence, [b.block_hash for b in snapshot.blocks]):
            self._want_resync(worker_id)
        return True

    async def _snapshot_wanted(self, channels: WorkerChannels) -> set[str]:
        """Snapshot every worker that wants a re-sync, concurrently; returns those that failed."""
        pending, self._resync_wanted = set(self._resync_wanted), set()
        results = await asyncio.gather(*(self._snapshot(channels, w) for w in pending))
        return {w for w, ok in zip(pending, results, strict=True) if not ok}

    async def _initial_sync(self, channels: WorkerChannels) -> None:
        """Snapshot every known worker before serving, retrying failures until ready_timeout_s."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        backoff = Backoff(initial=0.05, cap=1.0)
        while self._resync_wanted and time.monotonic() < deadline:
            failed = await self._snapshot_wanted(channels)
            self._resync_wanted |= failed
            if failed:
                await asyncio.sleep(backoff.next())
        if self._resync_wanted:
            log.warning("serving without KV snapshots of %s (they did not answer)", sorted(self._resync_wanted))
            self._resync_wake.set()

    async def _resync_loop(self, channels: WorkerChannels) -> None:
        backoff = Backoff(initial=0.05, cap=2.0)
        while True:
            await self._resync_wake.wait()
            self._resync_wake.clear()
            failed = await self._snapshot_wanted(channels)
            if failed:
                await asyncio.sleep(backoff.next())
                for worker_id in failed:
                    if worker_id in self._servicer.registrations:
                        self._want_resync(worker_id)
            else:
                backoff.reset()

    # -- the fleet's tenant limits ---------------------------------------------------
    async def _on_usage_report(self, report: common_pb2.TenantUsageReport, subject: str, context) -> None:
        taken = self.admission.on_peer_report(UsageReport(
            report.router_id, report.incarnation, report.interval_s,
            {u.tenant: TenantUsage(u.streams, u.tokens_charged, u.tokens_recent) for u in report.tenants},
        ))
        for tenant, tokens in taken.items():
            self.metrics.fleet_tokens.labels(tenant=tenant_label(tenant, self.admission.tenant_names)).inc(tokens)

    async def _publish_usage(self, bus: EventBus) -> None:
        report = common_pb2.TenantUsageReport(
            router_id=self.router_id, incarnation=self._incarnation, interval_s=self.config.tenant_usage_interval_s,
            tenants=[
                common_pb2.TenantUsage(tenant=tenant, streams=u.streams, tokens_charged=u.tokens_charged, tokens_recent=u.tokens_recent)
                for tenant, u in sorted(self.admission.usage().items())
            ],
        )
        try:
            await bus.publish(TENANT_USAGE_SUBJECT, report)
        except MessageTooLargeError as error:
            # Thousands of tenants with usage: the others stop counting this router (it still holds every limit itself)
            # rather than it losing its routing loops.
            log.error("tenant usage report not sent: %s", error)

    async def _usage_loop(self, bus: EventBus) -> None:
        """Reports this router's usage every interval, and early (at most every _EAGER_FRACTION of it) after it admitted a
        stream: the others hear of new streams within milliseconds unless a burst reaches them at the same moment."""
        assert self.fleet is not None
        names = self.admission.tenant_names
        interval = self.config.tenant_usage_interval_s
        while True:
            self._usage_wake.clear()
            await self._publish_usage(bus)
            now = time.monotonic()
            self.fleet.prune(now)
            self.metrics.fleet_peers.set(len(self.fleet.live(now)))
            elsewhere = self.fleet.per_tenant(now)
            for tenant in names:
                self.metrics.fleet_streams.labels(tenant=tenant).set(elsewhere.get(tenant, 0))
            await asyncio.sleep(interval * _EAGER_FRACTION)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._usage_wake.wait(), timeout=interval * (1 - _EAGER_FRACTION))

    async def _gauges_loop(self) -> None:
        while True:
            views = self.table.workers()
            self.metrics.workers.set(len(views))
            self.metrics.indexed_blocks.set(sum(v.indexed_blocks for v in views))
            await asyncio.sleep(1.0)
