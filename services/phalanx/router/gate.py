"""The router's shell around SLO-aware admission (phalanx.router.overload): feeds it events, executes its effects.

A new request asks `enter`, which returns at once with the worker to route it to (the policy admitted it), raises
OverCapacityError (refused: RESOURCE_EXHAUSTED with a retry hint), or holds it until the policy admits or refuses it.
One background task polls the policy whenever something that frees room happens (a stream finished, a load report,
a request arrived or left) and at the earliest held budget's end at the latest. With admission off, `enter` admits
everything and routing decides as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

from phalanx._proto import common_pb2
from phalanx.common.errors import OverCapacityError
from phalanx.router.admission import Tier
from phalanx.router.config import RouterConfig
from phalanx.router.metrics import RouterMetrics
from phalanx.router.overload import AdmissionSettings, Admit, Arrival, Hold, OverloadPolicy, Refuse, TierSlo
from phalanx.router.routing import RoutingTable, WorkerLoad
from phalanx.router.slo import LatencySlo

__all__ = ["AdmissionGate"]

# While requests are held, the policy is polled at least this often (load reports come about every 100 ms and wake it
# anyway; this covers a fleet whose reports stopped).
_POLL_S = 0.25


class AdmissionGate:
    def __init__(self, config: RouterConfig, table: RoutingTable, metrics: RouterMetrics, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = config.admission == "slo"
        self.table = table
        self.metrics = metrics
        self.clock = clock
        self.policy = OverloadPolicy(AdmissionSettings(
            max_queued=config.admission_max_queued, headroom=config.admission_headroom, max_hold_share=config.admission_max_hold_share,
            hold_confidence=config.admission_hold_confidence,
            default_retry_after_s=config.no_worker_retry_after_s,
        ))
        self._defaults = TierSlo(config.admission_ttft_slo_s, config.admission_itl_slo_s)
        self._factors = {Tier.from_name(name): factor for name, factor in config.admission_tier_slo_factors.items()}
        self.slo = LatencySlo()  # what the health service publishes (none: the defaults above)
        self._waiting: dict[str, asyncio.Future[Admit]] = {}
        # Streams this router admitted and still relays, by request and per worker. A load report resets the table's
        # routed-since-report count, but a request routed just before it may not show in it yet: without these, every
        # report looked like room for a few more.
        self._open: dict[str, str] = {}
        self._open_per_worker: collections.Counter[str] = collections.Counter()
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        metrics.admission_held.set_function(lambda: self.policy.held)
        metrics.admission_hold_margin.set_function(lambda: self.policy.hold_margin_s(self.clock()))

    def tier_slo(self, tier: Tier) -> TierSlo:
        factor = self._factors.get(tier, 1.0)
        ttft = self.slo.ttft_s or self._defaults.ttft_s
        itl = self.slo.itl_s or self._defaults.itl_s
        return TierSlo(ttft * factor, itl * factor)

    async def enter(self, request_id: str, tier: Tier, prompt_tokens: int, max_tokens: int = 0) -> str | None:
        """The worker to route a new request to (None: routing picks), once admitted; raises OverCapacityError if refused.

        A worker returned is already counted as routed to (`RoutingTable.note_routed`)."""
        if not self.enabled:
            return None
        now = self.clock()
        arrival = Arrival(request_id, int(tier), prompt_tokens, now, self.tier_slo(tier), max_tokens)
        decision, displaced = self.policy.arrive(arrival, self._loads())
        for refused in displaced:
            self._settle(refused)
        if isinstance(decision, Admit):
            self._count(decision)
            self._note(decision)
            return decision.worker_id
        if isinstance(decision, Refuse):
            self._count(decision)
            raise _refusal(decision)
        assert isinstance(decision, Hold)
        turn: asyncio.Future[Admit] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = turn
        self._ensure_pump()
        self._wake.set()
        try:
            admitted = await turn
        except asyncio.CancelledError:
            self.policy.cancel(request_id)
            self._waiting.pop(request_id, None)
            raise
        return admitted.worker_id

    def ended(self, request_id: str, worker_id: str, *, finished: bool) -> None:
        """A stream this router relayed ended on `worker_id`; `finished`: it ran to its end there, and its slot is free."""
        admitted_on = self._open.pop(request_id, None)
        if admitted_on is not None:
            self._open_per_worker[admitted_on] -= 1
        self.policy.stream_ended(request_id)
        if finished:
            self.table.note_finished(worker_id)
            self.policy.on_finished(self.clock())
        if self._waiting:
            self._wake.set()

    def on_gap(self, worker_id: str, seconds: float, request_id: str = "") -> None:
        """The router relayed a token of `request_id` `seconds` after its previous one, from `worker_id`."""
        if self.enabled:
            self.policy.on_step(worker_id, self.table.running(worker_id), seconds, request_id, self.clock())
            if self._waiting:
                self._wake.set()  # a cold worker's first gaps may make room

    def on_load(self, report: common_pb2.LoadReport) -> None:
        """A load report changed what the table knows of the worker: held requests may fit now."""
        if self._waiting:
            self._wake.set()

    def forget_worker(self, worker_id: str) -> None:
        self.policy.forget_worker(worker_id)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    # -- internals ---------------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run(), name="admission-gate")

    async def _run(self) -> None:
        while self._waiting:
            self._wake.clear()
            now = self.clock()
            for effect in self.policy.poll(self._loads(), now):
                self._settle(effect)
            deadline = self.policy.next_deadline()
            timeout = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - now))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _settle(self, effect: Admit | Refuse) -> None:
        turn = self._waiting.pop(effect.request_id, None)
        self._count(effect)
        if turn is None or turn.done():
            return
        if isinstance(effect, Admit):
            self._note(effect)
            turn.set_result(effect)
        else:
            turn.set_exception(_refusal(effect))

    def _note(self, admitted: Admit) -> None:
        """Counted on its worker at once, not when its handler routes it: the next poll may run before that, and must see
        the slot taken. The router does not note it again (RouterServicer._route, `noted`)."""
        if admitted.worker_id is not None:
            self.table.note_routed(admitted.worker_id, admitted.prompt_tokens)
            self._open[admitted.request_id] = admitted.worker_id
            self._open_per_worker[admitted.worker_id] += 1

    def _loads(self) -> list[WorkerLoad]:
        """The routable workers' loads, each batch at least the streams this router relays from it."""
        own = self._open_per_worker
        return [replace(w, batch=own[w.worker_id]) if own[w.worker_id] > w.batch else w for w in self.table.loads()]

    def _count(self, effect: Admit | Refuse) -> None:
        outcome, reason = ("admitted", "") if isinstance(effect, Admit) else ("refused", effect.reason.value)
        self.metrics.admission.labels(outcome=outcome, reason=reason, held="true" if effect.waited_s > 0 else "false").inc()
        if effect.waited_s > 0:
            self.metrics.admission_wait.observe(effect.waited_s)
        if effect.late_s is not None:
            self.metrics.admission_hold_late.observe(effect.late_s)


def _refusal(refused: Refuse) -> OverCapacityError:
    return OverCapacityError(
        f"over capacity: this request could not start within its time-to-first-token SLO ({refused.reason.value}); "
        f"retry in {refused.retry_after_s:.2g} s",
        retry_after_s=refused.retry_after_s,
    )
