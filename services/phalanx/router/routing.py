"""Picks the worker for a request: KV-cache overlap against load, as an estimate of time to first token.

Per routable worker (lower is better), in seconds:

    cost = ( (uncached + routed_tokens) / prefill_rate
           + (1 + queue_depth + routed) * step_time
           + RUNNING_SEQ_STEPS * running_seqs * step_time
           + (stale_penalty_s if the last load report is older than load_stale_s) ) / weight

- `uncached / prefill_rate`: prefilling the prompt tokens the worker does not
  hold yet (prompt length minus its matched leading blocks times the block
  size). The prefix-overlap term: this is what makes a cache holder cheap.
- `queue_depth * step_time`: every request waiting ahead of this one needs
  at least a step before ours is admitted (the worker admits first come,
  first served). The `1 +` is our own first step; it also keeps the cost
  above zero so that a weight below 1 always counts.
- `routed`, `routed_tokens`: requests (and their uncached prompt tokens)
  this router sent to the worker since its last load report. Reports come
  about every 100 ms; without these a burst of requests would all land on
  the worker that looked idlest in the last report. A report resets them
  (the requests show in its queue_depth / running_seqs from then on).
- `RUNNING_SEQ_STEPS * running_seqs * step_time`: a quarter of a queued
  request per running sequence. Decoding sequences slow each step and keep
  holding KV memory; step_time shows that only late (the engine averages it
  over about ten steps, seconds when steps are slow), and the running count
  is what spreads decodes, whose ITL grows with every sequence beside them.
  At a tenth, the offline model of the planner bench's fleet
  (phalanx.bench.route_balance, six seeds) attained 98.4 % mean (93.9 %
  worst) at 0.36 s mean ITL; at a quarter 99.1 % (94.5 %) at 0.32 s, and
  with prompts on 16 system prompts over bounded caches 97.3 -> 99.2 % at
  the same prefix hit share, 78-79 % (docs/results/, the twelfth planner pass).
- `stale_penalty_s`: a worker silent for longer than load_stale_s may be
  dead with its lease not lapsed yet; it stays routable (it may be fine, and
  if every worker is silent the router must still route) but loses to any
  worker with less than that much estimated wait.
- `/ weight`: the health service's routing weight (0.5 suspicious: its
  estimate counts double). Weight 0, a draining report, or health DRAINING /
  DEAD take a worker out of routing.

A worker that has not measured a rate (never reported, or reported 0:
"unknown") is priced at the median of the rates the other workers measured,
or at the configured defaults while none has: a newcomer is as fast as its
peers, not as fast as the defaults say. Its registration time counts as its
last report, so it is fresh for load_stale_s and penalised afterwards.

Ties (equal cost: identical idle workers) go to the fewest routed since the
last report, then to the first worker in an order that rotates by one on
each route() call: deterministic, and not always the same worker.

The prompt is hashed once per route() call, and only its first
(len - 1) // block_size blocks: a worker recomputes at least the prompt's
last token, so a cached final block saves nothing more (the worker's own
prefix matching works the same way).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from phalanx._proto import common_pb2
from phalanx.common.block_hash import MediaSpan, prefix_block_hashes, prefix_block_hashes_with_media
from phalanx.common.roles import serves_requests
from phalanx.router.index import KvIndex

RUNNING_SEQ_STEPS = 0.25

_NOT_ROUTABLE_HEALTH = frozenset({common_pb2.WORKER_HEALTH_DRAINING, common_pb2.WORKER_HEALTH_DEAD})


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: str
    cached_tokens: int  # prompt tokens the worker already holds (matched blocks * block_size)
    cost_s: float  # estimated seconds until this request's first token there
    candidates: int  # workers considered (routable and not excluded)


@dataclass(frozen=True, slots=True)
class WorkerEstimate:
    """One routable worker's terms of the estimate, for a caller that adds terms of its own (joint media routing).

    The worker's cost for n prompt tokens of which it caches `cached_tokens` is
    ``wait_s + (n - cached_tokens) * s_per_token`` (the route() cost, weight and staleness included).
    """

    worker_id: str
    wait_s: float
    s_per_token: float
    cached_tokens: int
    step_s: float = 0.0  # one engine step there (its report, else the default)
    queue_depth: int = 0  # its last report's
    running_seqs: int = 0
    free_blocks: int | None = None  # None: it has not reported yet


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One routable worker's load as this router knows it now, for SLO-aware admission (phalanx.router.overload)."""

    worker_id: str
    batch: int  # sequences it runs or queues: its last report's, plus those routed there since, minus those finished since
    running: int  # running sequences in its last report
    queue_depth: int  # requests waiting in its last report
    step_s: float  # its step time (0: never measured)
    prefill_tokens_per_s: float  # its measured prefill rate, else the fleet's (0: none measured)
    pending_prefill_tokens: int  # uncached prompt tokens routed there since its last report


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as routing sees it, for ListWorkers and gauges."""

    worker_id: str
    address: str
    pid: int
    model: str
    health: int  # common_pb2.WorkerHealth
    weight: float
    routable: bool
    draining: bool
    queue_depth: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    step_time_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    indexed_blocks: int
    load_age_s: float  # since the last load report, or since registration if none came
    reported: bool
    routed_since_report: int
    spare: bool = False  # a hot spare: registered, not routed to until promoted
    role: str = ""  # its registered role (common/roles.py); a prefill worker is routable only for prefills


class _Worker:
    __slots__ = (
        "worker_id", "address", "pid", "model", "slot", "role",
        "queue_depth", "running_seqs", "free_blocks", "total_blocks", "step_time_ms", "prefill_tokens_per_s",
        "decode_tokens_per_s", "draining", "report_at", "reported", "routed", "routed_tokens", "finished",
        "inv_rate", "base_s",
    )

    def __init__(self, worker_id: str, slot: int, now: float) -> None:
        self.worker_id = worker_id
        self.address = ""
        self.pid = 0
        self.model = ""
        self.role = ""
        self.slot = slot
        self.queue_depth = 0
        self.running_seqs = 0
        self.free_blocks = 0
        self.total_blocks = 0
        self.step_time_ms = 0.0
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        self.draining = False
        self.report_at = now
        self.reported = False
        self.routed = 0
        self.routed_tokens = 0
        self.finished = 0  # streams of this router that ended there since its last report
        # Derived by RoutingTable._refresh: the per-request cost is base_s + uncached * inv_rate.
        self.inv_rate = 0.0
        self.base_s = 0.0


class RoutingTable:
    """Workers, their load and KV residency; route() picks the cheapest for a prompt. Not thread-safe."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        default_prefill_tokens_per_s: float = 4000.0,
        default_step_time_s: float = 0.02,
        load_stale_s: float = 2.0,
        stale_penalty_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        index: KvIndex | None = None,
        running_seq_steps: float = RUNNING_SEQ_STEPS,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not (default_prefill_tokens_per_s > 0 and default_step_time_s > 0 and load_stale_s > 0 and stale_penalty_s >= 0):
            raise ValueError("default rates, step time and load_stale_s must be > 0, stale_penalty_s >= 0")
        self.block_size = block_size
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.default_step_time_s = default_step_time_s
        self.load_stale_s = load_stale_s
        self.stale_penalty_s = stale_penalty_s
        self.running_seq_steps = running_seq_steps  # the running-sequence term's weight (phalanx.bench.route_balance weighs it)
        self.clock = clock
        self.index = index if index is not None else KvIndex()
        self._workers: dict[str, _Worker] = {}
        # Health records may arrive before registrations and outlive them: kept apart.
        self._weights: dict[str, tuple[float, int]] = {}
        # Hot spares (etcd SPARES_PREFIX): never routed to until promoted. Like health records, the mark may come first.
        self._spares: set[str] = set()
        # (worker, 1 / weight) of routable workers, sorted by id; rebuilt when routability changes. Prefill workers
        # (common/roles.py) apart: new requests never go to them, only prompts to prefill (router/disagg.py).
        self._routable: list[tuple[_Worker, float]] = []
        self._prefill_routable: list[tuple[_Worker, float]] = []
        # The medians of the rates the workers measured (None: nobody has): what a worker that has measured nothing yet
        # is priced at, rather than the configured defaults, which on a slow box make it look far faster than the
        # measured workers (an idle newcomer would beat a prefix holder however much the holder's cache saves).
        self._fleet_prefill_tokens_per_s: float | None = None
        self._fleet_step_time_s: float | None = None
        self._turn = 0

    # -- membership -------------------------------------------------------------
    def upsert_worker(
        self, worker_id: str, address: str, *, pid: int = 0, model: str = "", total_blocks: int = 0, role: str = "",
    ) -> bool:
        """Adds or updates a registration. True: new, or its process changed (pid); the caller
        fetches a KvSnapshot and calls load_kv_snapshot."""
        w = self._workers.get(worker_id)
        new = w is None
        if w is None:
            w = self._workers[worker_id] = _Worker(worker_id, self.index.add_worker(worker_id), self.clock())
            self.index.mark_resync(worker_id)
        restarted = not new and pid != w.pid
        if restarted:
            # A new process starts with an empty cache and no load yet.
            self.index.mark_resync(worker_id, clear=True)
            w.report_at = self.clock()
            w.reported = False
        w.address, w.pid, w.model = address, pid, model
        if total_blocks and not w.reported:
            w.total_blocks = total_blocks
        role_changed, w.role = role != w.role, role
        if new or restarted:
            self._refresh(w)
        if new or restarted or role_changed:
            self._rebuild_routable()  # once: a new worker's role is set with it
        return new or restarted

    def remove_worker(self, worker_id: str) -> None:
        if self._workers.pop(worker_id, None) is not None:
            self.index.remove_worker(worker_id)
            self._rebuild_routable()
            self._update_fleet_rates()

    def set_weight(self, worker_id: str, weight: float, *, health: int = common_pb2.WORKER_HEALTH_UNSPECIFIED) -> None:
        """Routing weight in [0, 1] from the health service (default 1.0; 0 takes the worker out of
        routing), with its health classification if known. May come before the worker registers.
        The value comes from etcd, so it is clamped into [0, 1] (NaN reads as 0) rather than refused."""
        weight = 0.0 if math.isnan(weight) else min(1.0, max(0.0, weight))
        if weight == 1.0 and health == common_pb2.WORKER_HEALTH_UNSPECIFIED:
            self._weights.pop(worker_id, None)
        else:
            self._weights[worker_id] = (weight, health)
        if worker_id in self._workers:
            self._rebuild_routable()

    def set_spare(self, worker_id: str, spare: bool) -> None:
        """Mark a worker as a hot spare (out of routing) or promote it (routable from now on). May come before it registers."""
        if spare == (worker_id in self._spares):
            return
        if spare:
            self._spares.add(worker_id)
        else:
            self._spares.discard(worker_id)
        if worker_id in self._workers:
            self._rebuild_routable()

    # -- events -------------------------------------------------------------------
    def update_load(self, report: common_pb2.LoadReport) -> None:
        """Takes a worker's load report (ignored for unknown workers); resets its routed-since-report count."""
        w = self._workers.get(report.worker_id)
        if w is None:
            return
        # The router's own clock, not report.timestamp: worker clocks may disagree with ours.
        w.report_at = self.clock()
        w.reported = True
        w.queue_depth = report.queue_depth
        w.running_seqs = report.running_seqs
        w.free_blocks = report.free_blocks
        w.total_blocks = report.total_blocks or w.total_blocks
        w.step_time_ms = report.step_time_ms
        w.prefill_tokens_per_s = report.prefill_tokens_per_s
        w.decode_tokens_per_s = report.decode_tokens_per_s
        w.routed = 0
        w.routed_tokens = 0
        w.finished = 0
        self._refresh(w)
        self._update_fleet_rates()
        if report.draining != w.draining:
            w.draining = report.draining
            self._rebuild_routable()

    def on_kv_event(self, event: common_pb2.KvEvent) -> bool:
        """True: fetch a KvSnapshot of event.worker_id and call load_kv_snapshot (see KvIndex.apply_event)."""
        return self.index.apply_event(event)

    def load_kv_snapshot(self, worker_id: str, sequence: int, block_hashes: Iterable[int]) -> bool:
        """True: fetch another snapshot (see KvIndex.load_snapshot)."""
        return self.index.load_snapshot(worker_id, sequence, block_hashes)

    def note_routed(self, worker_id: str, prompt_tokens: int) -> None:
        """The router just sent a request there; `prompt_tokens` are those it must prefill
        (the prompt minus RouteDecision.cached_tokens)."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.routed += 1
            w.routed_tokens += max(0, prompt_tokens)
            self._refresh(w)

    def note_finished(self, worker_id: str) -> None:
        """A stream this router relayed from the worker ended: its slot is free before the next load report says so."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.finished += 1

    def running(self, worker_id: str) -> int:
        """Sequences the worker ran at its last load report (0 for an unknown worker)."""
        w = self._workers.get(worker_id)
        return 0 if w is None else w.running_seqs

    def loads(self) -> list[WorkerLoad]:
        """Every routable worker's load (by worker id), for admission."""
        fleet_rate = self._fleet_prefill_tokens_per_s or 0.0
        return [
            WorkerLoad(
                w.worker_id, max(0, w.running_seqs + w.queue_depth + w.routed - w.finished), w.running_seqs, w.queue_depth,
                w.step_time_ms / 1e3, w.prefill_tokens_per_s or fleet_rate, w.routed_tokens,
            )
            for w, _ in self._routable
        ]

    # -- the decision -----------------------------------------------------------------
    def route(
        self, prompt_ids: list[int], *, exclude: frozenset[str] | set[str] = frozenset(), media: Sequence[MediaSpan] = (),
        prefer: str | None = None, prefill: bool = False,
    ) -> RouteDecision | None:
        """The cheapest routable worker for the prompt; None if no worker is routable (after `exclude`).

        `media`: the prompt's media runs; the blocks holding them hash with the media's bytes, as workers hash them.
        `prefer`: that worker if it is routable and not excluded, whatever the others cost (it was chosen already,
        e.g. it holds the request's text prefix, computed while the media were encoded, and its KV events may not
        have reached the index yet).
        `prefill`: among the prefill workers instead (router/disagg.py prices them as prefills elsewhere).
        """
        routable = self._prefill_routable if prefill else self._routable
        if not routable:
            return None
        n = len(prompt_ids)
        matched = self._matched(prompt_ids, media)
        bs = self.block_size
        stale_before = self.clock() - self.load_stale_s
        penalty = self.stale_penalty_s
        turn = self._turn % len(routable)
        self._turn += 1
        best: _Worker | None = None
        best_cost = math.inf
        candidates = 0
        for w, inv_weight in routable[turn:] + routable[:turn]:
            if exclude and w.worker_id in exclude:
                continue
            candidates += 1
            if w.worker_id == prefer:
                best, best_cost = w, (w.base_s + (n - matched.get(w.slot, 0) * bs) * w.inv_rate) * inv_weight
                break
            cost = w.base_s + (n - matched.get(w.slot, 0) * bs) * w.inv_rate
            if w.report_at < stale_before:
                cost += penalty
            cost *= inv_weight
            if cost < best_cost or (cost == best_cost and best is not None and w.routed < best.routed):
                best, best_cost = w, cost
        if best is None:
            return None
        return RouteDecision(best.worker_id, matched.get(best.slot, 0) * bs, best_cost, candidates)

    def estimates(
        self, prompt_ids: list[int], *, exclude: frozenset[str] | set[str] = frozenset(), media: Sequence[MediaSpan] = (),
        prefill: bool = False,
    ) -> list[WorkerEstimate]:
        """Every routable worker's cost terms for `prompt_ids` (by worker id), for joint (encoder, worker) routing and
        the disaggregation policy; `media`: the prompt's media runs, hashed as `route` hashes them; `prefill`: the
        prefill workers' instead."""
        matched = self._matched(prompt_ids, media)
        stale_before = self.clock() - self.load_stale_s
        out = []
        for w, inv_weight in self._prefill_routable if prefill else self._routable:
            if w.worker_id in exclude:
                continue
            wait = w.base_s + (self.stale_penalty_s if w.report_at < stale_before else 0.0)
            step = self._step_s(w)
            out.append(WorkerEstimate(
                w.worker_id, wait * inv_weight, w.inv_rate * inv_weight, matched.get(w.slot, 0) * self.block_size, step * inv_weight,
                queue_depth=w.queue_depth + w.routed, running_seqs=w.running_seqs, free_blocks=w.free_blocks if w.reported else None,
            ))
        return out

    def _matched(self, prompt_ids: list[int], media: Sequence[MediaSpan]) -> dict[int, int]:
        """Leading blocks of the prompt each worker slot holds; the last token is always computed, so not hashed."""
        n, bs = len(prompt_ids), self.block_size
        hashes = (
            prefix_block_hashes_with_media(prompt_ids, bs, media, limit_tokens=n - 1) if media
            else prefix_block_hashes(prompt_ids, bs, limit_tokens=n - 1)
        )
        return self.index.match_slots(hashes) if hashes else {}

    # -- views ------------------------------------------------------------------------
    def workers(self) -> list[WorkerView]:
        now = self.clock()
        routable = {w.worker_id for w, _ in self._routable + self._prefill_routable}
        views = []
        for w in sorted(self._workers.values(), key=lambda w: w.worker_id):
            weight, health = self._weights.get(w.worker_id, (1.0, common_pb2.WORKER_HEALTH_UNSPECIFIED))
            views.append(
                WorkerView(
                    worker_id=w.worker_id, address=w.address, pid=w.pid, model=w.model, health=self._health(w, weight, health),
                    weight=weight, routable=w.worker_id in routable, draining=w.draining, queue_depth=w.queue_depth,
                    running_seqs=w.running_seqs, free_blocks=w.free_blocks, total_blocks=w.total_blocks, step_time_ms=w.step_time_ms,
                    prefill_tokens_per_s=w.prefill_tokens_per_s, decode_tokens_per_s=w.decode_tokens_per_s,
                    indexed_blocks=self.index.indexed_blocks(w.worker_id), load_age_s=max(0.0, now - w.report_at),
                    reported=w.reported, routed_since_report=w.routed, spare=w.worker_id in self._spares, role=w.role,
                )
            )
        return views

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    # -- internals ---------------------------------------------------------------------
    def _refresh(self, w: _Worker) -> None:
        rate = w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else self._fleet_prefill_tokens_per_s or self.default_prefill_tokens_per_s
        step = self._step_s(w)
        w.inv_rate = 1.0 / rate
        w.base_s = w.routed_tokens / rate + (1 + w.queue_depth + w.routed) * step + self.running_seq_steps * w.running_seqs * step

    def _step_s(self, w: _Worker) -> float:
        return w.step_time_ms / 1e3 if w.step_time_ms > 0 else self._fleet_step_time_s or self.default_step_time_s

    def _update_fleet_rates(self) -> None:
        """The fleet's median measured rates; the workers that measured none are priced again when they change."""
        prefill = _median([w.prefill_tokens_per_s for w in self._workers.values() if w.prefill_tokens_per_s > 0])
        step_ms = _median([w.step_time_ms for w in self._workers.values() if w.step_time_ms > 0])
        step = step_ms / 1e3 if step_ms is not None else None
        if (prefill, step) == (self._fleet_prefill_tokens_per_s, self._fleet_step_time_s):
            return
        self._fleet_prefill_tokens_per_s, self._fleet_step_time_s = prefill, step
        for w in self._workers.values():
            if w.prefill_tokens_per_s <= 0 or w.step_time_ms <= 0:
                self._refresh(w)

    def _rebuild_routable(self) -> None:
        routable: list[tuple[_Worker, float]] = []
        prefill: list[tuple[_Worker, float]] = []
        for worker_id in sorted(self._workers):
            w = self._workers[worker_id]
            weight, health = self._weights.get(worker_id, (1.0, common_pb2.WORKER_HEALTH_UNSPECIFIED))
            if weight > 0 and not w.draining and health not in _NOT_ROUTABLE_HEALTH and worker_id not in self._spares:
                (routable if serves_requests(w.role) else prefill).append((w, 1.0 / weight))
        self._routable, self._prefill_routable = routable, prefill

    def has_prefill_workers(self) -> bool:
        """Whether any prefill worker is routable (disaggregation has somewhere to send prompts)."""
        return bool(self._prefill_routable)

    @staticmethod
    def _health(w: _Worker, weight: float, health: int) -> int:
        if health != common_pb2.WORKER_HEALTH_UNSPECIFIED:
            return health
        if w.draining:
            return common_pb2.WORKER_HEALTH_DRAINING
        if weight == 0:
            return common_pb2.WORKER_HEALTH_UNHEALTHY
        return common_pb2.WORKER_HEALTH_SUSPICIOUS if weight < 1 else common_pb2.WORKER_HEALTH_HEALTHY


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
