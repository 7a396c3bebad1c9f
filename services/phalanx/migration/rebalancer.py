"""The migration service's rebalancer: moves running requests off loaded workers onto new capacity.

It carries out `rebalance_policy.RebalancePolicy`'s moves with the drain's path, nothing of its own: it asks the loaded
worker to park a few requests it picks (`Park` with a limit: their KV stays there), and the router relaying each one
sees it handed back and asks the migration service to move it, as after a drain. That call is where the planned
target comes in: `target_for` tells the Migrator which worker the rebalance meant it for (it waits for the Park call
to answer, should the router be faster), and the Migrator restores it there (the usual choice if that worker
cannot take it). The router then re-attaches the client's stream on the target from the next index.

What it knows of the fleet: the workers' NATS load reports (the Migrator's), and two etcd watches, worker
registrations and hot-spare marks, for when each worker became routable: a worker registered while this service
runs (not a spare) at its registration, a spare at its promotion. Only capacity that came while some worker was
loaded, or shortly before the load reports showed one (the policy's arrival window: they average over steps and lag
a burst), is new capacity (a fleet starting up, or growing well ahead of its load, is left to routing); the workers
there at the start count as old.
With several migration instances only the one with the smallest instance id rebalances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

import grpc

from phalanx._proto import common_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EtcdDirectory, MigrationDirectory, WorkerDirectory
from phalanx.common.grpc_channels import GrpcChannels
from phalanx.common.roles import serves_requests
from phalanx.common.subjects import SPARES_PREFIX
from phalanx.migration.config import MigrationConfig
from phalanx.migration.metrics import MigrationMetrics
from phalanx.migration.rebalance_policy import Move, RebalancePolicy, RebalanceSettings, WorkerLoad

log = logging.getLogger(__name__)

# A load report older than this is no view of the worker (they report every 0.1 s).
_REPORT_MAX_AGE_S = 1.0
_PARK_TIMEOUT_S = 2.0


class Rebalancer:
    def __init__(
        self, config: MigrationConfig, etcd_config: EtcdConfig, metrics: MigrationMetrics, instance_id: str,
        loads: Callable[[], Mapping[str, tuple[common_pb2.LoadReport, float]]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.instance_id = instance_id
        self.policy = RebalancePolicy(RebalanceSettings(
            itl_target_s=config.rebalance_itl_target_s, new_capacity_s=config.rebalance_new_capacity_s,
            target_load=config.rebalance_target_load, max_moves_per_worker=config.rebalance_max_moves_per_worker,
            cooldown_s=config.rebalance_cooldown_s, request_memory_s=config.rebalance_request_memory_s,
            arrival_window_s=config.rebalance_arrival_window_s,
        ))
        self._loads = loads  # the Migrator's: worker id -> (latest load report, monotonic time it came)
        self._workers = WorkerDirectory(etcd_config)
        self._spare_marks = EtcdDirectory(etcd_config, prefix=SPARES_PREFIX, message_type=common_pb2.HotSpareRecord)
        self._instances = MigrationDirectory(etcd_config)
        self._channels = GrpcChannels([], traced=False)
        self.registrations: dict[str, common_pb2.WorkerRegistration] = {}
        self._spares: set[str] = set()
        # Source worker -> its Park call of a rebalance in progress; request id -> (source, target, claim expiry).
        self._parking: dict[str, asyncio.Future[None]] = {}
        self._claims: dict[str, tuple[str, str, float]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        # Spares first: a spare's registration must not count as new capacity, not even for a round.
        self._spares = set(await self._spare_marks.list())
        self.registrations = await self._workers.list()  # old: the policy knows no arrival of theirs
        self._tasks = [
            asyncio.create_task(self._spare_marks.follow(self._on_spare), name="rebalance spares"),
            asyncio.create_task(self._workers.follow(self._on_worker), name="rebalance workers"),
            asyncio.create_task(self._loop(), name="rebalance"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for parking in self._parking.values():
            if not parking.done():
                parking.set_result(None)
        await self._channels.close()
        for directory in (self._workers, self._spare_marks, self._instances):
            await directory.close()

    # -- the fleet ------------------------------------------------------------------------
    def _on_spare(self, kind: str, worker_id: str, _mark: object) -> None:
        if kind == "put":
            self._spares.add(worker_id)
        elif worker_id in self._spares:
            self._spares.discard(worker_id)
            self.policy.arrived(worker_id, self.snapshot())  # promoted: routable from now on

    def _on_worker(self, kind: str, worker_id: str, registration: object) -> None:
        if kind == "delete":
            self.registrations.pop(worker_id, None)
            self.policy.left(worker_id)
            return
        assert isinstance(registration, common_pb2.WorkerRegistration)
        known = self.registrations.get(worker_id)
        self.registrations[worker_id] = registration
        if known is None or known.started_at != registration.started_at:
            self.policy.arrived(worker_id, self.snapshot())

    def snapshot(self, now: float | None = None) -> list[WorkerLoad]:
        """Every registered worker with a fresh load report, as the policy sees it."""
        now = time.monotonic() if now is None else now
        found = []
        reports = self._loads()
        for worker_id, registration in self.registrations.items():
            if not serves_requests(registration.role):
                continue  # a prefill worker hands every request on after its first token: nothing to move off or onto it
            entry = reports.get(worker_id)
            if entry is None or now - entry[1] > _REPORT_MAX_AGE_S:
                continue
            report = entry[0]
            found.append(WorkerLoad(
                worker_id=worker_id, running=report.running_seqs, queued=report.queue_depth, step_time_s=report.step_time_ms / 1e3,
                routable_since=self.policy.new_since(worker_id), draining=report.draining,
                spare=worker_id in self._spares,
            ))
        return found

    # -- rounds ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.rebalance_interval_s)
            try:
                await self.round()
            except Exception:
                log.exception("rebalance round failed")

    async def round(self) -> list[Move]:
        """Plans and carries out one round of moves (only on the leading instance); returns them."""
        # First whether capacity that came shortly before this report showed load is new capacity, then the moves.
        self.policy.observe(self.snapshot())
        moves = self.policy.plan(self.snapshot())
        if not moves or not await self._leading():
            return []
        self.policy.started(moves)
        await asyncio.gather(*(self._carry_out(move) for move in moves))
        return moves

    async def _leading(self) -> bool:
        instances = await self._instances.list()
        return not instances or min(instances) == self.instance_id

    async def _carry_out(self, move: Move) -> None:
        source = self.registrations.get(move.source)
        if source is None:
            return
        parking = self._parking[move.source] = asyncio.get_running_loop().create_future()
        try:
            reply = await worker_pb2_grpc.WorkerServiceStub(self._channels.get(source.address)).Park(
                worker_pb2.ParkRequest(
                    limit=move.count, exclude_request_ids=sorted(self.policy.recently_moved()),
                    min_remaining_tokens=self.config.rebalance_min_remaining_tokens, ttl_s=self.config.rebalance_park_ttl_s,
                ),
                timeout=_PARK_TIMEOUT_S,
            )
            moved = [p.state.request_id for p in reply.parked]
            expiry = time.monotonic() + self.config.rebalance_park_ttl_s
            for request_id in moved:
                self._claims[request_id] = (move.source, move.target, expiry)
            self.policy.moved(moved)
            self.metrics.rebalanced.inc(len(moved))
            if moved:
                log.info("rebalance: %d requests of %s (asked %d) go to %s", len(moved), move.source, move.count, move.target)
        except grpc.aio.AioRpcError as error:
            self.metrics.rebalance_failures.inc()
            log.warning("rebalance: %s did not park requests: %s %s", move.source, error.code().name, error.details())
        finally:
            parking.set_result(None)
            self._parking.pop(move.source, None)

    # -- the Migrator's question -------------------------------------------------------------
    async def target_for(self, request_id: str, source: str) -> str | None:
        """The worker a rebalance meant `request_id` (handed back by `source`) for; None if it was no rebalance's."""
        parking = self._parking.get(source)
        if parking is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(parking), _PARK_TIMEOUT_S)
        now = time.monotonic()
        self._claims = {r: c for r, c in self._claims.items() if c[2] > now}
        claim = self._claims.pop(request_id, None)
        return claim[1] if claim is not None and claim[0] == source else None
