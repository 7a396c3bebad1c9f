"""What the elected health instance does: check every worker, classify, write, drain, degrade.

Per registered worker two tasks run: a checker (canaries through the
worker's normal scheduler, every interval with jitter, sooner after a
failure, per the circuit breaker; its latency judged against the worker's own
load, from its NATS load reports: health/load.py) and a liveness watch (a grpc.health Watch
stream that breaks the moment the process dies; a failed probe then marks it
DEAD without waiting for a canary or for its lease). Routers report broken
streams on NATS and get the same probe. Every change is written to etcd in
a transaction fenced by the leadership key, then announced on NATS. The
degradation level is kept beside it (health/level.py), from the workers'
weights this monitor tracks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from contextlib import aclosing

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from phalanx._proto import common_pb2, worker_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EtcdDirectory, WorkerDirectory, encode_json
from phalanx.common.events import EventBus, check_load_report
from phalanx.common.leadership import LeaderElection, LeadershipLostError
from phalanx.common.lease import Backoff
from phalanx.common.subjects import (
    CANARY_PREFIX,
    HEALTH_PREFIX,
    HEALTH_REPORTS_ALL,
    LOAD_ALL,
    health_events_subject,
    health_key,
)
from phalanx.common.tls import open_channel
from phalanx.health.calibration import Calibrator
from phalanx.health.canary import CANDIDATE_PROMPTS, CanaryGroup, judge
from phalanx.health.config import DegradationConfig, HealthConfig
from phalanx.health.level import DegradationKeeper, RoutedWorker
from phalanx.health.load import FleetLoad, LoadPolicy
from phalanx.health.metrics import HealthMetrics
from phalanx.health.schedule import (
    CanaryDone,
    CheckPurpose,
    CheckRound,
    CheckSchedule,
    Deadline,
    EngineSample,
    Paused,
    Record,
    SchedulePolicy,
    SendCanary,
    StatsTaken,
    TakeStats,
)
from phalanx.health.state import CheckOutcome, CheckResult, FailureReason, Health, TrackerPolicy, Transition, WorkerTracker
from phalanx.health.tracked import TrackedWorker

log = logging.getLogger(__name__)
_RETENTION_SWEEP_S = 10.0
# How often a canary given the whole timeout because the worker's steps move (a confirming check, a latency recheck) looks
# whether they still do.
_PROGRESS_POLL_S = 0.05
_INCONCLUSIVE_CODES = {
    # The checker's own mistake, or deliberate backpressure: never the worker's fault.
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


class FleetMonitor:
    def __init__(
        self, config: HealthConfig, degradation: DegradationConfig, etcd_config: EtcdConfig, election: LeaderElection,
        bus: EventBus, metrics: HealthMetrics,
    ) -> None:
        self.config = config
        self.degradation_config = degradation
        self.etcd_config = etcd_config
        self.election = election
        self.bus = bus
        self.metrics = metrics
        self.policy = TrackerPolicy.from_config(config)
        self.schedule = SchedulePolicy.from_config(config)
        self.load = FleetLoad(LoadPolicy.from_config(config))
        self.workers: dict[str, TrackedWorker] = {}
        self.gone: dict[str, WorkerTracker] = {}  # DEAD and deregistered, kept for dead_retention_s
        self.calibrator = Calibrator(config, metrics, self.workers, self._fenced, self._observe)
        self.level = DegradationKeeper(degradation, etcd_config, bus, metrics, self._fenced)
        self._records: dict[str, common_pb2.WorkerHealthRecord] = {}
        self._tasks: asyncio.TaskGroup | None = None
        # False until this term has adopted every registered worker: a new leader's memory holds a part of the fleet
        # before then, so ListWorkerHealth answers from etcd (the previous leader's records) meanwhile.
        self.ready = False

    # -- the leader's life ----------------------------------------------------------
    async def run(self) -> None:
        """Monitor until cancelled (common.leadership cancels a term whose lease lapsed); raises LeadershipLostError when a
        fenced write is refused."""
        workers = WorkerDirectory(self.etcd_config)
        records = EtcdDirectory(self.etcd_config, prefix=HEALTH_PREFIX, message_type=common_pb2.WorkerHealthRecord)
        canaries = EtcdDirectory(self.etcd_config, prefix=CANARY_PREFIX, message_type=common_pb2.CanaryCalibration)
        report_subscription = load_subscription = None
        try:
            self._records = await records.list()
            self.calibrations.update({CanaryGroup.of_calibration(c): c for c in (await canaries.list()).values()})
            await self.level.start()
            registered = await workers.list()
            report_subscription = await self.bus.subscribe(HEALTH_REPORTS_ALL, common_pb2.WorkerStreamBroken, self._on_report)
            load_subscription = await self.bus.subscribe(LOAD_ALL, common_pb2.LoadReport, self._on_load, check=check_load_report)
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                for worker_id, registration in registered.items():
                    await self._on_registered(worker_id, registration)
                await self._bury_unregistered(set(registered))
                self.ready = True
                tasks.create_task(self._follow_workers(workers))
                tasks.create_task(self.calibrator.run())
                tasks.create_task(self._retention_loop())
                tasks.create_task(self.level.run(self._routed))
        finally:
            self.ready = False
            for subscription in (report_subscription, load_subscription):
                if subscription is not None:
                    with contextlib.suppress(Exception):
                        await subscription.unsubscribe()
            await self.level.close()
            for w in self.workers.values():
                for task in w.tasks:
                    task.cancel()
                await w.channel.close()
            self.workers.clear()
            for directory in (workers, records, canaries):
                await directory.close()

    @property
    def _group(self) -> asyncio.TaskGroup:
        """The task group of the running leader term, which every per-worker task joins."""
        assert self._tasks is not None, "used outside run()"
        return self._tasks

    async def _follow_workers(self, directory: WorkerDirectory) -> None:
        async with aclosing(directory.watch()) as events:
            async for kind, worker_id, registration in events:
                if kind == "delete":
                    await self._on_deregistered(worker_id)
                else:
                    assert registration is not None  # a put carries its message
                    await self._on_registered(worker_id, registration)

    # -- membership -----------------------------------------------------------------
    async def _on_registered(self, worker_id: str, registration: common_pb2.WorkerRegistration) -> None:
        known = self.workers.get(worker_id)
        if known is not None and known.registration.started_at == registration.started_at and known.tracker.health is not Health.DEAD:
            known.registration = registration
            return
        if known is not None:
            await self._stop_worker(worker_id)
        tracker = self._tracker_for(worker_id, registration)
        self.gone.pop(worker_id, None)
        w = self.workers[worker_id] = TrackedWorker(registration, tracker, _channel(registration.address))
        w.persisted_baseline = tracker.baseline_s
        self.metrics.set_worker(worker_id, tracker.health, tracker.weight, tracker.circuit)
        record = self._records.get(worker_id)
        if record is not None and record.worker_started_at == registration.started_at:
            self.load.seed(worker_id, registration.model_version, record.usual_step_s)
            w.persisted_steps = dict(record.usual_step_s)
        if record is None or record.version != tracker.version or record.worker_started_at != registration.started_at:
            await self._write(w)
        log.info("watching worker %s (%s, %s) as %s", worker_id, registration.address, registration.model_version, tracker.health.label)
        w.tasks = [
            self._group.create_task(self._check_loop(w)),
            self._group.create_task(self._liveness_loop(w)),
        ]
        if CanaryGroup.of_worker(registration) not in self.calibrations:
            self.calibrator.wake.set()

    def _tracker_for(self, worker_id: str, registration: common_pb2.WorkerRegistration) -> WorkerTracker:
        """The stored state if it judges this very process (a new leader resuming), else a fresh start."""
        record = self._records.get(worker_id)
        if record is not None and record.worker_started_at == registration.started_at and int(record.health) != Health.DEAD:
            return WorkerTracker.from_record(record, self.policy)
        tracker = WorkerTracker(worker_id, self.policy, worker_started_at=registration.started_at)
        if record is not None:
            tracker.version = record.version + 1  # routers must not take the new record for an old one
            if record.worker_started_at == registration.started_at:
                tracker.baseline_s = record.latency_baseline_s
                tracker.reason = "registered again"
        tracker.updated_at = time.time()
        return tracker

    async def _on_deregistered(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        if w.stopping:
            reason = "deregistered: the worker shut down"
        else:
            reason = "etcd lease expired or revoked: the worker is gone"
            self.metrics.liveness_deaths.labels(signal="lease").inc()
        await self._transition(w, w.tracker.mark_dead(reason))
        await self._stop_worker(worker_id)
        self.gone[worker_id] = w.tracker

    async def _stop_worker(self, worker_id: str) -> None:
        w = self.workers.pop(worker_id, None)
        self.load.forget(worker_id)
        if w is None:
            return
        current = asyncio.current_task()
        for task in w.tasks:
            if task is not current:
                task.cancel()
        await w.channel.close()

    async def _bury_unregistered(self, registered: set[str]) -> None:
        """Records of workers that vanished while no instance was leading: DEAD now."""
        for worker_id, record in list(self._records.items()):
            if worker_id in registered:
                continue
            tracker = WorkerTracker.from_record(record, self.policy)
            if tracker.mark_dead("not registered when this health instance took over") is not None:
                await self._store(tracker.to_record())
            self.gone[worker_id] = tracker

    # -- checks ---------------------------------------------------------------------
    async def _check_loop(self, w: TrackedWorker) -> None:
        schedule = CheckSchedule(self.schedule, w.tracker)
        delay = schedule.first_delay()
        while w.tracker.health is not Health.DEAD:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await w.wake.wait()
            w.wake.clear()
            held = schedule.hold_off(time.time(), stopping=w.stopping)
            if held is not None:
                delay = held
                continue
            rounds = [schedule.begin(slo_factor=self._slo_factor()) for _ in range(schedule.rounds_due())]
            for outcome in await asyncio.gather(*(self._run_round(w, checks) for checks in rounds)):
                await self._observe(w, outcome)
                delay = schedule.finish(outcome)

    async def _run_round(self, w: TrackedWorker, checks: CheckRound) -> CheckOutcome:
        """Executes one round's effects (see phalanx.health.schedule) until it names the outcome to record."""
        effect = checks.start(self._fleet_slowdown(w), self._load_factor(w))
        while not isinstance(effect, Record):
            event: StatsTaken | CanaryDone | Paused
            if isinstance(effect, TakeStats):
                sample = await self._engine_sample(w)
                event = StatsTaken(
                    sample, self._fleet_slowdown(w), self._load_factor(w), self._progressing(w),
                    self.load.host_stalled(w.registration.worker_id, time.monotonic()),
                )
            elif isinstance(effect, SendCanary):
                if effect.purpose is CheckPurpose.TIMEOUT_RECHECK:
                    self.metrics.timeout_rechecks.inc()
                elif effect.purpose is CheckPurpose.LATENCY_RECHECK:
                    self.metrics.latency_rechecks.inc()
                if effect.while_progressing_from_s is None:
                    outcome = await self.check(w, effect.deadline_s)
                else:
                    outcome = await self._check_while_progressing(w, effect.deadline_s, effect.while_progressing_from_s)
                event = CanaryDone(outcome, self._fleet_slowdown(w), self._load_factor(w), self._progressing(w))
            else:
                await asyncio.sleep(effect.seconds)
                event = Paused(self._fleet_slowdown(w), self._load_factor(w), self._progressing(w))
            effect = checks.on(event)
        return effect.outcome

    async def _observe(self, w: TrackedWorker, outcome: CheckOutcome) -> None:
        worker_id = w.registration.worker_id
        slowdown, slo_factor, load_factor = self._fleet_slowdown(w), self._slo_factor(), self._load_factor(w)
        self.metrics.load_allowance.labels(worker=worker_id).set(max(load_factor, outcome.load_factor))
        judged = w.tracker.judge_latency(outcome, slowdown, slo_factor, load_factor)
        unloaded = dataclasses.replace(outcome, load_factor=1.0)
        if judged.result is CheckResult.PASS and w.tracker.judge_latency(unloaded, slowdown, slo_factor).result is CheckResult.FAIL:
            self.metrics.busy_passes.inc()
            log.info(
                "worker %s is busy, not broken: its canary earned x%.1f for the load it met; its reports say %s", worker_id,
                outcome.load_factor, self.load.verdict(worker_id, time.monotonic()).describe(),
            )
        outcome = judged
        self.metrics.checks.labels(result=outcome.result.value).inc()
        if outcome.result is CheckResult.FAIL:
            self.metrics.canary_failures.labels(worker=worker_id, reason=outcome.reason).inc()
        if outcome.latency_s is not None:
            self.metrics.check_duration.labels(worker=worker_id, result=outcome.result.value).observe(outcome.latency_s)
        if outcome.result is CheckResult.FAIL:
            log.warning("worker %s failed a check: %s: %s", worker_id, outcome.reason, outcome.detail)
        transition = w.tracker.observe(outcome, fleet_slowdown=slowdown, slo_factor=slo_factor, load_factor=load_factor)
        if transition is None and (_drifted(w.tracker.baseline_s, w.persisted_baseline)
                                   or _steps_drifted(self.load.usual_steps(worker_id), w.persisted_steps)):
            # Keep the baseline and the usual steps it is stretched by for a successor.
            transition = Transition(w.tracker.health, w.tracker.health, w.tracker.reason)
            w.tracker.version += 1
        await self._transition(w, transition)

    def _fleet_slowdown(self, w: TrackedWorker) -> float:
        """Median of how much slower than usual the worker's healthy peers answered their latest canaries."""
        recent = time.time() - (3 * self.config.check_interval_s + 1.0)
        ratios = sorted(
            p.tracker.last_ratio for p in self.workers.values()
            if p is not w and p.registration.model_version == w.registration.model_version
            and p.tracker.health is Health.HEALTHY and p.tracker.last_ratio_at >= recent
        )
        if not ratios:
            return 1.0
        return min(10.0, max(1.0, ratios[len(ratios) // 2]))

    def _load_factor(self, w: TrackedWorker) -> float:
        """How much the worker's own load and its host's slow its steps right now (1.0: not at all, or not known)."""
        return self.load.verdict(w.registration.worker_id, time.monotonic()).stretch

    async def _check_while_progressing(self, w: TrackedWorker, timeout: float, short_s: float) -> CheckOutcome:
        """A canary with `timeout` while the worker's steps move, cut short once `short_s` passed and they stopped: a hang
        that began within the round then counts at the round's own deadline (waited out, one took 6.2 s to detect)."""
        started = time.perf_counter()
        canary = asyncio.ensure_future(self.check(w, timeout))
        try:
            while True:
                done, _ = await asyncio.wait({canary}, timeout=_PROGRESS_POLL_S)
                if done:
                    return canary.result()
                waited = time.perf_counter() - started
                if waited >= short_s and not self._progressing(w):
                    return CheckOutcome.failed(FailureReason.TIMEOUT, f"no answer within {waited:.2f} s, and its steps stopped", waited)
        finally:
            canary.cancel()

    def _progressing(self, w: TrackedWorker) -> bool:
        return self.load.progressing(w.registration.worker_id, time.monotonic())

    async def _on_load(self, report: common_pb2.LoadReport, subject: str, context) -> None:
        w = self.workers.get(report.worker_id)
        if w is not None:
            self.load.on_report(
                report.worker_id, w.registration.model_version, step_s=report.step_time_ms / 1e3,
                held=report.running_seqs + report.queue_depth, now=time.monotonic(),
            )

    def _slo_factor(self) -> float:
        """The latency SLO relaxation of the level in force (x2 from level 3 on): canary latency limits stretch by it."""
        return self.level.slo_factor

    async def _engine_sample(self, w: TrackedWorker) -> EngineSample | None:
        """The worker's engine counters (None: no answer within the probe timeout)."""
        try:
            stats = await w.stub.Stats(worker_pb2.StatsRequest(), timeout=self.config.probe_timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return EngineSample(stats.computed_tokens_total, stats.queue_depth + stats.running_seqs)

    async def check(self, w: TrackedWorker, timeout: float | None = None) -> CheckOutcome:
        """One canary with deadline (a routine one by default) and retries of failed connects, judged against the calibration."""
        case = self.calibrator.next_case(w)
        max_tokens = len(case.expected_token_ids) if case is not None else self.config.canary_max_tokens
        request = worker_pb2.CanaryRequest(max_tokens=max_tokens)
        if case is not None and not case.prompt_text:
            request.tokens.ids.extend(case.prompt_token_ids)
        else:
            request.text = case.prompt_text if case is not None else CANDIDATE_PROMPTS[0]
        if timeout is None:
            timeout = self.schedule.deadline_s(Deadline.ROUTINE, w.tracker)
        backoff = Backoff(initial=0.05, cap=0.2)
        for attempt in range(self.config.check_retries + 1):
            start = time.perf_counter()
            try:
                response = await w.stub.Canary(request, timeout=timeout)
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return CheckOutcome.failed(FailureReason.TIMEOUT, f"no answer within {timeout:.2f} s", time.perf_counter() - start)
                if code in _INCONCLUSIVE_CODES:
                    return CheckOutcome.inconclusive(f"{code.name}: {error.details()}")
                if code == grpc.StatusCode.UNAVAILABLE and attempt < self.config.check_retries:
                    await asyncio.sleep(backoff.next())
                    continue
                reason = FailureReason.UNREACHABLE if code == grpc.StatusCode.UNAVAILABLE else FailureReason.ERROR
                return CheckOutcome.failed(reason, f"{code.name}: {error.details()}")
            latency = time.perf_counter() - start
            outcome = CheckOutcome.passed(latency) if case is None else judge(
                case, response.token_ids, response.top_logits, latency, tolerance=self.config.logit_tolerance
            )
            # Judged by the load it met, as the worker says with its answer: a batch that began just before outruns
            # the load reports (health/load.py).
            met = self.load.canary_verdict(
                w.registration.worker_id, step_s=response.step_s, held=response.held_requests, now=time.monotonic()
            )
            return dataclasses.replace(outcome, load_factor=met.stretch)
        raise AssertionError("unreachable")

    # -- liveness -------------------------------------------------------------------
    async def _liveness_loop(self, w: TrackedWorker) -> None:
        stub = health_pb2_grpc.HealthStub(w.channel)
        backoff = Backoff(initial=0.05, cap=2.0)
        while w.tracker.health is not Health.DEAD:
            why = "its health stream ended"
            try:
                async for status in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    backoff.reset()
                    await self._on_serving_status(w, status.status)
            except grpc.aio.AioRpcError as error:
                why = f"its health stream broke ({error.code().name})"
            if await self.probe(w, why):
                return
            await asyncio.sleep(backoff.next())

    async def _on_serving_status(self, w: TrackedWorker, status: int) -> None:
        if status == health_pb2.HealthCheckResponse.NOT_SERVING and not w.stopping:
            w.stopping = w.tracker.health in (Health.HEALTHY, Health.SUSPICIOUS)
            if w.stopping:
                await self._transition(w, w.tracker.worker_stopping())
        elif status == health_pb2.HealthCheckResponse.SERVING and w.stopping:
            w.stopping = False
            await self._transition(w, w.tracker.worker_serving())

    async def probe(self, w: TrackedWorker, why: str) -> bool:
        """Is the process still there? Marks it DEAD (returns True) when it refuses connections."""
        if w.probing or w.tracker.health is Health.DEAD:
            return w.tracker.health is Health.DEAD
        w.probing = True
        try:
            await health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=self.config.probe_timeout_s)
            return False
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                detail = f"{why}; no liveness answer within {self.config.probe_timeout_s} s"
                if self._progressing(w):
                    # Its load reports are fresh and its engine steps: busy, and the canaries judge the rest.
                    await self._observe(w, CheckOutcome.inconclusive(f"{detail}, but it reports progress"))
                    return False
                # Up but unresponsive: evidence of a fault, not of death.
                outcome = CheckOutcome.failed(FailureReason.PROBE_TIMEOUT, detail)
                await self._observe(w, outcome)
                return False
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                return False
            self.metrics.liveness_deaths.labels(signal="stream").inc()
            await self._transition(w, w.tracker.mark_dead(f"{why}, then it refused connections ({error.details()})"))
            return True
        finally:
            w.probing = False

    async def _on_report(self, report: common_pb2.WorkerStreamBroken, subject: str, context) -> None:
        w = self.workers.get(report.worker_id)
        if w is not None and w.tracker.health is not Health.DEAD:
            self._group.create_task(self.probe(w, f"router {report.router_id} saw its stream break ({report.code})"))

    # -- writing --------------------------------------------------------------------
    async def _transition(self, w: TrackedWorker, transition: Transition | None) -> None:
        if transition is None:
            return
        worker_id = w.registration.worker_id
        tracker = w.tracker
        if transition.new is not transition.old:
            self.metrics.transitions.labels(from_status=transition.old.label, to_status=transition.new.label).inc()
            level = logging.INFO if transition.new in (Health.HEALTHY, Health.DRAINING) else logging.WARNING
            log.log(level, "worker %s: %s -> %s (%s)", worker_id, transition.old.label, transition.new.label, transition.reason)
        self.metrics.set_worker(worker_id, tracker.health, tracker.weight, tracker.circuit)
        if transition.undrain:
            # Re-admitting before the record says HEALTHY: a router that acts on the record at once must find the
            # worker admitting (a record first left a window in which its requests were refused by a quarantine).
            await self._release(w)
        await self._write(w)
        if transition.drain:
            self._group.create_task(self._quarantine(w))

    async def _write(self, w: TrackedWorker) -> None:
        async with w.write_lock:  # one write at a time per worker, always of the latest state
            record = w.tracker.to_record()
            record.usual_step_s.update(self.load.usual_steps(w.registration.worker_id))
            await self._store(record)
            w.persisted_baseline = record.latency_baseline_s
            w.persisted_steps = dict(record.usual_step_s)

    async def _store(self, record: common_pb2.WorkerHealthRecord) -> None:
        """etcd first (fenced: the authority), then the NATS notification routers act on at once."""
        await self._fenced(health_key(record.worker_id), encode_json(record))
        self._records[record.worker_id] = record
        await self.bus.publish(health_events_subject(record.worker_id), record)

    async def _fenced(self, key: str, value: bytes) -> None:
        if not await self.election.fenced_put(key, value):
            raise LeadershipLostError(f"another health instance leads (write of {key} refused)")

    async def _quarantine(self, w: TrackedWorker) -> None:
        """Drain an UNHEALTHY worker: its requests finish or are handed back; it stays up for the half-open canary."""
        grace = self.config.drain_grace_s
        try:
            result = await w.stub.Drain(worker_pb2.DrainRequest(grace_s=grace, keep_running=True), timeout=grace + 10)
            log.info("drained unhealthy worker %s: %d finished, %d handed back", w.registration.worker_id, result.finished, result.handed_back)
        except grpc.aio.AioRpcError as error:
            log.warning("drain of unhealthy worker %s failed: %s", w.registration.worker_id, error.code().name)
        if w.tracker.health is Health.UNHEALTHY:
            await self._transition(w, w.tracker.draining())

    async def _release(self, w: TrackedWorker) -> None:
        try:
            await w.stub.Undrain(worker_pb2.UndrainRequest(), timeout=self.config.check_timeout_s)
        except grpc.aio.AioRpcError as error:
            log.warning("undrain of recovered worker %s failed: %s", w.registration.worker_id, error.code().name)

    # -- calibration (health/calibration.py) -------------------------------------------
    @property
    def calibrations(self) -> dict[CanaryGroup, common_pb2.CanaryCalibration]:
        return self.calibrator.calibrations

    def recalibrate(self, model_version: str = "") -> None:
        """Forget stored expectations (one version's, in every dtype, or all) and calibrate again."""
        self.calibrator.recalibrate(model_version)

    # -- degradation ----------------------------------------------------------------
    @property
    def degradation(self) -> common_pb2.DegradationState | None:
        """The level in force (health/level.py keeps it)."""
        return self.level.state

    def _routed(self) -> list[RoutedWorker]:
        return [RoutedWorker(worker_id, w.tracker.weight, w.stopping) for worker_id, w in self.workers.items()]

    # -- housekeeping ---------------------------------------------------------------
    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(min(_RETENTION_SWEEP_S, max(0.5, self.config.dead_retention_s)))
            cutoff = time.time() - self.config.dead_retention_s
            for worker_id, tracker in list(self.gone.items()):
                if tracker.updated_at < cutoff and worker_id not in self.workers:
                    if not await self.election.fenced_delete(health_key(worker_id)):
                        raise LeadershipLostError("another health instance leads (delete refused)")
                    del self.gone[worker_id]
                    self._records.pop(worker_id, None)
                    self.metrics.forget_worker(worker_id)

    def records(self) -> list[common_pb2.WorkerHealthRecord]:
        live = [w.tracker.to_record() for w in self.workers.values()]
        return live + [t.to_record() for t in self.gone.values()]


def _channel(address: str) -> grpc.aio.Channel:
    return open_channel(
        address,
        options=[
            # Notice a silent peer on the Watch stream, and reconnect fast once it is back.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
        ],
    )


def _drifted(value: float, persisted: float) -> bool:
    return abs(value - persisted) > 0.1 * max(persisted, 1e-3)


def _steps_drifted(usual: dict[int, float], persisted: dict[int, float]) -> bool:
    """A load level learned since the last write, or one whose usual step moved by over 10 %."""
    return any(level not in persisted or _drifted(step, persisted[level]) for level, step in usual.items())
