"""The `local` connector: the planner's decisions carried out by `phalanx up`'s supervisor, on this machine's processes.

Like the kubernetes connector scales a StatefulSet, this one scales the workers a supervisor runs (`WorkerPool`, a
narrow view of phalanx.launch.supervisor), and it speaks the same `Connector` protocol (phalanx.planner.connectors):
`publish` hands it a decision, `acknowledged` steps the fleet toward the targets and gives the ack once it matches.
`follow` relays between it and the planner process through etcd (the virtual connector's keys): it reads the decision
the planner wrote at PLANNER_DECISION_KEY and writes the ack at PLANNER_ACK_KEY.

It starts workers (as a replacement is started) until the count reaches the target, cancels the newest starts and
then SIGTERMs the newest surplus workers (they drain: their requests move through the migration service, no token
lost). One rule keeps it and the supervisor from doubling up: the supervisor still restarts a crashed worker at once,
and a worker being restarted counts toward the target; the planner only changes the target. A restoration decision
(health marked a worker DEAD) thus starts nothing more; if the DEAD worker's process still runs (hung), it is
SIGKILLed and the restart path replaces it.

Hot spares: each is marked a spare in etcd (common.subjects.SPARES_PREFIX) before it starts, so routers never route to
it. When a worker dies, nothing is started for it: the planner's PROMOTE_SPARE decision (within _PROMOTION_WAIT_S)
deletes the spare's mark (routers route to it from then on, capacity is back at once), and the spare counts as a
worker and a new spare starts in the background. Without a ready spare the planner's REPLACE_DEAD decision makes it
start a worker instead.

Pools: a disaggregated fleet's decision (`DecisionRecord.disaggregated`) has two targets, and each pool is matched on its
own: the prefill pool counts the workers of role `prefill` (started with `--role prefill`), the routed pool every other
worker (started with the fleet's default role: `phalanx up --prefill-workers` makes that decode). Starts, drains, spares
(`hot_spares` for the routed pool, `prefill_hot_spares` for the prefill pool) and dead workers awaiting a promotion
are each counted in their pool; a dead worker's spare is one of its own pool. An aggregated decision is one pool of
every worker, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.common.children import describe_exit
from phalanx.common.roles import PREFILL
from phalanx.planner.connectors import AckRecord, DecisionRecord, read_decision, write_ack

if TYPE_CHECKING:
    from phalanx.common.config import EtcdConfig

__all__ = ["LocalConnector", "WorkerPool", "clear_spare_marks"]

# How long a dead worker's slot waits for the planner to promote a hot spare before a worker is started for it.
_PROMOTION_WAIT_S = 5.0

# The pools a decision targets: the workers requests are routed to (aggregated, or decode), and prefill workers.
ROUTED = ""


class WorkerPool(Protocol):
    """What the local connector drives: the engine workers of a supervised fleet (phalanx.launch.supervisor.Supervisor)."""

    @property
    def workers(self) -> dict[str, Any]:
        """The serving workers by id (handles with worker_id, address and process): the pool's own, which this changes."""
        ...

    @property
    def replacing_workers(self) -> set[str]:
        """Dead workers whose replacement the supervisor is starting."""
        ...

    @property
    def crash_loop(self) -> Exception | None: ...

    @property
    def etcd_config(self) -> EtcdConfig: ...

    @property
    def retry_pause_s(self) -> float:
        """How long to wait before trying again after a start failed."""
        ...

    def new_worker_id(self) -> str: ...

    async def start_worker(self, worker_id: str, role: str | None = None) -> Any:
        """A worker process (of ``role``, else the fleet's default) that serves, not yet one of ``workers``."""
        ...

    async def new_worker(self, role: str | None = None) -> tuple[str, int | None]:
        """A worker under a new id (of ``role``, else the fleet's default), one of ``workers`` once it serves."""
        ...

    def role_of(self, name: str) -> str:
        """A worker's role ("" for the fleet's default)."""
        ...

    def watch(self, name: str) -> None:
        """The supervisor restarts ``name`` from now on when it dies."""
        ...

    def unwatch(self, name: str) -> None: ...

    def record(self, process: str, pid: int | None, what: str) -> None: ...

    def show(self, name: str, state: str, address: str = "", pid: int | None = None, *, note: str = "") -> None: ...

    def forget(self, name: str) -> None: ...


async def clear_spare_marks(etcd_config: EtcdConfig) -> None:
    """Deletes every hot spare mark (an earlier stack's, in an external etcd: worker ids repeat, and a mark keeps routers off)."""
    from phalanx.common.lease import connect_etcd
    from phalanx.common.subjects import SPARES_PREFIX

    client = connect_etcd(etcd_config)
    try:
        await client.delete_prefix(SPARES_PREFIX.encode())
    finally:
        with contextlib.suppress(Exception):
            await client.close()


def _number(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 1)[1])


class LocalConnector:
    """Carries the planner's decisions out on a `WorkerPool`; also the pool's `WorkerOwner` for spares and dead workers."""

    name = "local"

    def __init__(self, pool: WorkerPool, *, hot_spares: int, planner_id: str, orchestrator: str, prefill_hot_spares: int = 0) -> None:
        self.pool = pool
        self.hot_spares = hot_spares
        self.prefill_hot_spares = prefill_hot_spares
        self.planner_id = planner_id  # the name its events go under
        self.orchestrator = orchestrator  # what its acks say carried the decision out
        self.started_at = time.time()
        self.decision: DecisionRecord | None = None
        self.acked_id = 0
        self.error = ""
        # Workers being started to reach the target, by a key never reused (a cancelled start's cleanup must not remove a
        # newer one), and workers draining after a scale-down.
        self.scaling: dict[int, asyncio.Task] = {}
        self._scale_keys = itertools.count(1)
        self.retiring: dict[str, Any] = {}
        # Hot spares: warm, marked in etcd, not routed to; spares being started; dead workers (by name, since when) whose
        # capacity a spare's promotion by the planner is to restore.
        self.spares: dict[str, Any] = {}
        self.spare_starts: dict[int, asyncio.Task] = {}
        self.awaiting_promotion: dict[str, float] = {}
        self._unmarking: set[asyncio.Task] = set()
        # The pool of each start in flight (by key) and of every worker or spare seen (a dead worker's role is gone from
        # the pool by the time it is counted as being replaced).
        self._start_pool: dict[int, str] = {}
        self._spare_start_pool: dict[int, str] = {}
        self._roles: dict[str, str] = {}
        self._etcd_client: Any = None

    # --- the relay through etcd ----------------------------------------------------------------------------------

    async def follow(self) -> None:
        """One step of following the planner: read its decision, carry it out, acknowledge once the fleet matches. Called
        every poll; etcd trouble is kept in ``error`` (shown) and retried at the next poll."""
        try:
            decision = await read_decision(self._etcd())
        except Exception as error:  # noqa: BLE001 - etcd restarting, a foreign value: say so, try again
            self.error = f"reading the decision: {error or type(error).__name__}"
            return
        self.error = ""
        self._keep_spares()
        if decision is not None:
            await self.publish(decision)
        ack = await self.acknowledged()
        if ack is None:
            return
        try:
            await write_ack(self._etcd(), ack)
        except Exception as error:  # noqa: BLE001 - as above
            self.error = f"acknowledging: {error or type(error).__name__}"
            return
        self.acked_id = ack.id
        self.pool.record(self.planner_id, None, f"decision {ack.id} carried out: {ack.workers} workers")

    # --- the Connector protocol ----------------------------------------------------------------------------------

    async def publish(self, record: DecisionRecord) -> bool:
        """Carry ``record`` out from now on (non-blocking); False for a decision from before this connector started (an
        external etcd that served an earlier stack): not ours to follow."""
        if record.issued_at < self.started_at:
            return False
        if self.decision is None or record.id != self.decision.id:
            self._adopt(record)
        return True

    async def acknowledged(self) -> AckRecord | None:
        """One step toward the decision's targets; the ack to give once the fleet matches them and it was not given yet."""
        self._reap_retired()
        if self.decision is None or self.pool.crash_loop is not None:
            return None
        self._keep_spares()
        pool, decision = self.pool, self.decision
        for name in pool.workers:
            self._roles[name] = pool.role_of(name) or self._roles.get(name, "")
        for key, target in self._worker_targets().items():
            count = len(self._of(key, [*pool.workers, *pool.replacing_workers, *self.awaiting_promotion])) + self._starting(key)
            for _ in range(target - count):
                self._scale_up(target, key)
            if count > target:
                self._scale_down(count - target, target, key)
        settled = (all(len(self._of(key, pool.workers)) == target for key, target in self._worker_targets().items())
                   and not self.scaling and not pool.replacing_workers and not self.retiring and not self.awaiting_promotion
                   and all(len(self._of(key, self.spares)) + self._spares_starting(key) == target
                           for key, target in self._spare_targets().items())
                   and not any(dead in pool.workers for dead in decision.replaces))
        if not settled or decision.id <= self.acked_id:
            return None
        return AckRecord(id=decision.id, workers=len(self._of(ROUTED, pool.workers)), at=time.time(), orchestrator=self.orchestrator,
                         prefill_workers=len(self._of(PREFILL, pool.workers)))

    async def close(self) -> None:
        """Unmarks the spares (a later stack on the same etcd may reuse the ids) and closes the etcd client."""
        if self._etcd_client is None:
            return
        for name in self.spares:
            self._unmark_spare(name)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._unmarking, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._etcd_client.close()

    # --- the supervisor's WorkerOwner ----------------------------------------------------------------------------

    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: handle.process for name, handle in self.spares.items()}

    def stopping(self) -> dict[str, subprocess.Popen]:
        return {name: handle.process for name, handle in (*self.retiring.items(), *self.spares.items())}

    def worker_exited(self, name: str, pid: int | None, code: int | None) -> bool:
        """A dead spare is gone (the next step starts another); a dead worker's capacity is a spare's promotion's to restore."""
        if name in self.spares:
            self._spare_gone(self.spares.pop(name), f"exited with {describe_exit(code)}")
            return True
        if name in self.pool.workers:
            self._roles[name] = self.pool.role_of(name) or self._roles.get(name, "")
        if self._wants_spares(name) and name in self.pool.workers:
            self.pool.unwatch(name)
            self.pool.workers.pop(name)
            self.awaiting_promotion[name] = time.monotonic()
            self.pool.record(name, pid, f"exited with {describe_exit(code)}; waiting for the planner to promote a hot spare")
            return True
        return False

    async def cancel_starts(self) -> None:
        for task in [*self.scaling.values(), *self.spare_starts.values()]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self.scaling.values(), *self.spare_starts.values(), *self._unmarking, return_exceptions=True)

    def state(self, min_workers: int, max_workers: int) -> dict[str, Any]:
        """What `phalanx status --json` shows of the planner: its bounds, the decision followed and the last acknowledged."""
        decision = self.decision
        return {
            "min_workers": min_workers, "max_workers": max_workers,
            "target_workers": decision.workers if decision else None, "decision_id": decision.id if decision else None,
            "target_prefill_workers": decision.prefill_workers if decision else None,
            "prefill_workers": len(self._of(PREFILL, self.pool.workers)),
            "reason": decision.reason if decision else "", "acked_id": self.acked_id, "workers": len(self.pool.workers),
            "starting": len(self.scaling) + len(self.pool.replacing_workers), "draining": sorted(self.retiring), "error": self.error,
            "hot_spares": self._target_spares, "spares": [{"worker_id": w.worker_id, "address": w.address, "pid": w.process.pid}
                                                          for w in self.spares.values()],
            "spares_starting": len(self.spare_starts), "awaiting_promotion": sorted(self.awaiting_promotion),
        }

    # --- carrying a decision out ---------------------------------------------------------------------------------

    def _adopt(self, decision: DecisionRecord) -> None:
        self.decision = decision
        why = f"; {', '.join(decision.replaces)} DEAD" if decision.replaces else ""
        pools = f" + {decision.prefill_workers} prefill" if decision.prefill_workers is not None else ""
        self.pool.record(self.planner_id, None, f"decision {decision.id} ({decision.reason}): {decision.workers} workers{pools}{why}")
        for dead in decision.replaces:
            self.awaiting_promotion.pop(dead, None)  # promoted below, or (REPLACE_DEAD) started as a worker by the count
        spare = self.spares.pop(decision.promote, None) if decision.promote else None
        if spare is not None:
            self.pool.workers[spare.worker_id] = spare
            self.pool.show(spare.worker_id, "ready", spare.address, spare.process.pid, note="promoted hot spare")
            self.pool.record(spare.worker_id, spare.process.pid, f"promoted: hot spare now routed to (decision {decision.id})")
            self._unmark_spare(spare.worker_id)  # the planner deleted the mark already; again in case it could not
        for dead in decision.replaces:
            handle = self.pool.workers.get(dead)
            if handle is None:
                continue
            if handle.process.poll() is None:
                # Health judged it DEAD but its process runs (hung): kill it. Without spares the restart path replaces it.
                self.pool.record(dead, handle.process.pid, "marked DEAD by health while its process runs: killing it")
                handle.process.kill()
            if self._wants_spares(dead):
                # Health judged it DEAD before the supervisor saw its process exit: out of the count now, or the promoted
                # spare would count as a surplus worker; reaped as retired.
                self.pool.unwatch(dead)
                self.retiring[dead] = self.pool.workers.pop(dead)

    @property
    def _target_spares(self) -> int:
        return sum(self._spare_targets().values())

    def _pool_of(self, name: str) -> str:
        """A worker's pool: PREFILL for a prefill worker (unless the decision followed is aggregated), ROUTED otherwise."""
        if self.decision is not None and not self.decision.disaggregated:
            return ROUTED
        return PREFILL if self._roles.get(name, "") == PREFILL else ROUTED

    def _of(self, key: str, names: Any) -> list[str]:
        return [name for name in names if self._pool_of(name) == key]

    def _starting(self, key: str) -> int:
        return sum(1 for start in self.scaling if self._start_pool.get(start, ROUTED) == key)

    def _spares_starting(self, key: str) -> int:
        return sum(1 for start in self.spare_starts if self._spare_start_pool.get(start, ROUTED) == key)

    def _worker_targets(self) -> dict[str, int]:
        decision = self.decision
        assert decision is not None
        if decision.prefill_workers is None:
            return {ROUTED: decision.workers}
        return {ROUTED: decision.workers, PREFILL: decision.prefill_workers}

    def _spare_targets(self) -> dict[str, int]:
        decision = self.decision
        if decision is None:
            return {ROUTED: self.hot_spares, **({PREFILL: self.prefill_hot_spares} if self.prefill_hot_spares else {})}
        if decision.prefill_workers is None:
            return {ROUTED: decision.spares}
        return {ROUTED: decision.spares, PREFILL: decision.prefill_spares}

    def _wants_spares(self, name: str) -> bool:
        """Whether the pool of ``name`` keeps hot spares (so a dead worker's capacity waits for a promotion)."""
        if self._pool_of(name) == PREFILL:
            return self.prefill_hot_spares > 0
        return self.hot_spares > 0

    def _keep_spares(self) -> None:
        """Start spares up to the target; stop surplus ones (the newest) once no dead worker awaits a promotion."""
        now = time.monotonic()
        for dead, since in list(self.awaiting_promotion.items()):
            if now - since > _PROMOTION_WAIT_S:
                # No promotion came (no planner, no spare): the worker count falls short and a worker starts instead.
                del self.awaiting_promotion[dead]
                self.pool.record(dead, None, "no hot spare promoted for it: starting a worker instead")
                if self.decision is None:
                    # No decision to count against yet (a planner that never decided): start the worker here.
                    self._scale_up(len(self.pool.workers) + len(self.scaling) + 1)
        if self.pool.crash_loop is not None:
            return
        for key, target in self._spare_targets().items():
            self._keep_pool_spares(key, target)

    def _keep_pool_spares(self, key: str, target: int) -> None:
        spares = self._of(key, self.spares)
        for _ in range(target - len(spares) - self._spares_starting(key)):
            self._start_spare(key)
        surplus = len(spares) - target
        if surplus > 0 and not self.awaiting_promotion:
            for name in sorted(spares, key=_number, reverse=True)[:surplus]:
                handle = self.spares.pop(name)
                self.retiring[name] = handle
                handle.process.send_signal(signal.SIGTERM)
                self._unmark_spare(name)
                self.pool.show(name, "draining", handle.address, handle.process.pid, note=f"planner target {target} spares")
                self.pool.record(name, handle.process.pid, f"draining: planner target {target} spares")

    def _etcd(self) -> Any:
        from phalanx.common.lease import connect_etcd

        if self._etcd_client is None:
            self._etcd_client = connect_etcd(self.pool.etcd_config)
        return self._etcd_client

    def _start_spare(self, pool_key: str = ROUTED) -> None:
        from phalanx._proto import common_pb2
        from phalanx.common.discovery import encode_json
        from phalanx.common.subjects import spare_key

        key = max(self.spare_starts, default=0) + 1
        worker_id = self.pool.new_worker_id()
        self._roles[worker_id] = pool_key
        self._spare_start_pool[key] = pool_key

        async def start() -> None:
            try:
                # The mark goes first: routers must never route to the spare, not even between its registration and the mark.
                record = common_pb2.HotSpareRecord(worker_id=worker_id, since=time.time(), orchestrator=self.orchestrator)
                await self._etcd().put(spare_key(worker_id).encode(), encode_json(record))
                self.pool.show(worker_id, "starting", note="hot spare")
                handle = await (self.pool.start_worker(worker_id, PREFILL) if pool_key == PREFILL else self.pool.start_worker(worker_id))
            except Exception as error:  # noqa: BLE001 - the next poll tries again, after a pause
                self.pool.forget(worker_id)
                self._unmark_spare(worker_id)
                self.pool.record(self.planner_id, None, f"could not start a hot spare: {error or type(error).__name__}")
                await asyncio.sleep(self.pool.retry_pause_s)
                return
            finally:
                self.spare_starts.pop(key, None)
                self._spare_start_pool.pop(key, None)
            self.spares[worker_id] = handle
            self.pool.show(worker_id, "spare", handle.address, handle.process.pid, note="hot spare: warm, not routed to")
            self.pool.record(worker_id, handle.process.pid, "started: hot spare")

        self.spare_starts[key] = asyncio.create_task(start())

    def _spare_gone(self, handle: Any, why: str) -> None:
        self.pool.forget(handle.worker_id)
        self._unmark_spare(handle.worker_id)
        self.pool.record(handle.worker_id, handle.process.pid, f"hot spare {why}")

    def _unmark_spare(self, worker_id: str) -> None:
        from phalanx.common.subjects import spare_key

        async def unmark() -> None:
            with contextlib.suppress(Exception):  # etcd away: a mark of a worker that is gone routes nobody anywhere
                await self._etcd().delete(spare_key(worker_id).encode())

        task = asyncio.get_running_loop().create_task(unmark())
        self._unmarking.add(task)
        task.add_done_callback(self._unmarking.discard)

    def _scale_up(self, target: int, pool_key: str = ROUTED) -> None:
        key = next(self._scale_keys)
        what = "prefill workers" if pool_key == PREFILL else "workers"

        async def start() -> None:
            try:
                name, pid = await (self.pool.new_worker(PREFILL) if pool_key == PREFILL else self.pool.new_worker())
            except Exception as error:  # noqa: BLE001 - the next poll tries again, after a pause
                self.pool.record(self.planner_id, None, f"could not start a worker: {error or type(error).__name__}")
                await asyncio.sleep(self.pool.retry_pause_s)
                return
            finally:
                self.scaling.pop(key, None)
                self._start_pool.pop(key, None)
            self._roles[name] = pool_key
            self.pool.unwatch(name)
            self.pool.watch(name)
            self.pool.record(name, pid, f"started: planner target {target} {what}")

        self._start_pool[key] = pool_key
        self.scaling[key] = asyncio.create_task(start())

    def _scale_down(self, surplus: int, target: int, pool_key: str = ROUTED) -> None:
        """Cancel the newest starts first (a process not yet registered holds no request: it is killed, nothing moves; a surge
        withdrawn at once costs little), then SIGTERM the newest `surplus` left of the workers: they stop taking requests and
        drain (their requests move through migration)."""
        what = "prefill workers" if pool_key == PREFILL else "workers"
        cancelled = sorted((key for key in self.scaling if self._start_pool.get(key, ROUTED) == pool_key), reverse=True)[:surplus]
        for key in cancelled:
            self.scaling.pop(key).cancel()  # out of the count now: the next poll must not take another worker for it
            self._start_pool.pop(key, None)
        if cancelled:
            self.pool.record(self.planner_id, None, f"{len(cancelled)} worker start(s) cancelled: planner target {target} {what}")
        surplus -= len(cancelled)
        for name in sorted(self._of(pool_key, self.pool.workers), key=_number, reverse=True)[:max(surplus, 0)]:
            handle = self.pool.workers.pop(name)
            self.retiring[name] = handle
            handle.process.send_signal(signal.SIGTERM)
            self.pool.show(name, "draining", handle.address, handle.process.pid, note=f"planner target {target}")
            self.pool.record(name, handle.process.pid, f"draining: planner target {target} {what}")

    def _reap_retired(self) -> None:
        for name, handle in list(self.retiring.items()):
            if handle.process.poll() is not None:
                del self.retiring[name]
                self.pool.forget(name)
                self.pool.record(name, handle.process.pid, f"stopped after draining ({describe_exit(handle.process.returncode)})")
