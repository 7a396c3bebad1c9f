"""The planner service: the pure core (docs/planner.md) in a process.

Start: gRPC (health and reflection only: the planner's interface is etcd and /metrics) NOT_SERVING ->
etcd -> SERVING -> campaign for PLANNER_LEADER_KEY (one planner decides, others stand by, like health)
-> while leading, every `poll_s`:

- read the routers (ROUTERS_PREFIX registrations carry their metrics_address), the workers and their
  health records from etcd, and scrape every router's /metrics (or, with `prometheus_url`, query
  Prometheus at each tick): `Readiness` holds once a router and a worker are registered and serving and a
  router has been scraped twice (or Prometheus has the router series) - no start delay;
- feed acknowledgements to the DecisionMachine (an ack of id N completes every decision up to N);
- when the machine's schedule allows a tick: observe the interval, predict, plan (with a profile), and
  tick; publish a decision through the connector.

Health's DEAD records (an etcd watch on HEALTH_PREFIX) produce a restoration decision at once, not at the
next poll, except for a worker that was DRAINING before (it was stopped on purpose). Without a profile
the planner does not scale with load; it keeps the count within [min_workers, max_workers], follows an
operator's target (`phalanx planner set-target`) and replaces DEAD workers.

Stop (SIGTERM): NOT_SERVING -> stop planning -> resign (a standby takes over at once) -> stop gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping

import aetcd
import httpx

from phalanx._proto import common_pb2
from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.discovery import EtcdDirectory, WorkerDirectory, encode_json
from phalanx.common.leadership import LeaderElection, LeadershipLostError, lead_forever
from phalanx.common.lease import connect_etcd
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import (
    HEALTH_PREFIX,
    PLANNER_CAPACITY_KEY,
    PLANNER_LEADER_KEY,
    ROUTERS_PREFIX,
    SPARES_PREFIX,
    spare_key,
    validate_worker_id,
)
from phalanx.common.watched import DEGRADATION, PLANNER_TARGET, StateFollower
from phalanx.planner.capacity import CapacityView
from phalanx.planner.config import PlannerConfig
from phalanx.planner.connectors import Connector, DecisionRecord, VirtualConnector, read_decision
from phalanx.planner.correction import (
    CorrectionConfig,
    CorrectionTracker,
    expected_ttft_s,
)
from phalanx.planner.decisions import (
    Arrivals,
    Decision,
    DecisionConfig,
    DecisionMachine,
    DecisionReason,
    Outcome,
    Readiness,
    poisson_upper_bound,
    surge_rate,
)
from phalanx.planner.metrics import PlannerMetrics
from phalanx.planner.observations import (
    Observation,
    Scrape,
    interval_demand,
    observe_prometheus,
    observe_scrapes,
    parse_scrape,
    promql_queries,
)
from phalanx.planner.plan import PlanInputs, expectation, plan_step
from phalanx.planner.pools import FleetPools, PoolBounds
from phalanx.planner.predictors import Predictor, PredictorConfig, load_trace, make_predictor, warm_start
from phalanx.planner.profile import PerformanceProfile, load_profile
from phalanx.planner.replicas import ReplicaConfig, SloTargets

log = logging.getLogger(__name__)
# One line per scrape at INFO would bury the planner's own lines.
logging.getLogger("httpx").setLevel(logging.WARNING)

# Workers in these states are no capacity (common.proto WorkerHealth).
_NOT_SERVING = {common_pb2.WORKER_HEALTH_UNHEALTHY, common_pb2.WORKER_HEALTH_DRAINING, common_pb2.WORKER_HEALTH_DEAD}

# With a surge confidence, the surge windows in multiples of surge_window_s: a burst's arrivals add up over the longer ones.
_SURGE_WINDOWS = (1, 2, 4)


class Planner:
    """One leadership term: the loop of the module docstring."""

    def __init__(
        self, config: PlannerConfig, client: aetcd.Client, etcd_config: EtcdConfig, election: LeaderElection, connector: Connector,
        metrics: PlannerMetrics, profile: PerformanceProfile | None,
    ) -> None:
        self.config = config
        self.client = client
        self.etcd_config = etcd_config
        self.election = election
        self.connector = connector
        self.metrics = metrics
        self.profile = profile
        self.machine: DecisionMachine | None = None
        self.readiness = Readiness(routers_serving=False, serving_workers=0, metrics_flowing=False)
        self.correction = CorrectionTracker(CorrectionConfig(enabled=config.correction))
        self.predictors: dict[str, Predictor] = {name: make_predictor(config.predictor, PredictorConfig()) for name in ("requests", "isl", "osl")}
        if config.trace:
            trace = load_trace(config.trace)
            warm_start(self.predictors["requests"], [row.requests for row in trace])
            warm_start(self.predictors["isl"], [row.isl for row in trace])
            warm_start(self.predictors["osl"], [row.osl for row in trace])
        self._scrapes: dict[str, Scrape] = {}  # the newest scrape of each router
        self._tick_scrapes: dict[str, Scrape] = {}  # each router's scrape at the last tick: an interval's start
        self._scraped_twice = False
        self._operator_target: int | None = None
        self._workers = 0  # serving routed workers (a disaggregated fleet's decode workers)
        self.pools = FleetPools(config.disaggregated, PoolBounds(config.prefill_min_workers, config.prefill_max_workers))
        self._desired_prefill: int | None = None  # the last plan's prefill pool (a disaggregated fleet)
        self._spare_marks = EtcdDirectory(etcd_config, prefix=SPARES_PREFIX, message_type=common_pb2.HotSpareRecord)
        self._spares: set[str] = set()  # registered, marked spare, not failing
        self._promoted: dict[str, None] = {}  # spares this planner promoted: their mark may still show in a listing taken before
        self._counted: set[int] = set()
        self._degradation_level = 0
        self._degradation = StateFollower(etcd_config, DEGRADATION)  # health's level: from level 3 on the plan relaxes its SLOs
        self._target = StateFollower(etcd_config, PLANNER_TARGET)  # an operator's target (`phalanx planner set-target`)
        self._capacity: CapacityView | None = None  # of the last plan, published after it
        self._observed_at: float | None = None
        self._osl_seen = False  # an interval has observed output lengths  # when the last interval was observed (None: not yet)
        self._http = httpx.AsyncClient(timeout=config.scrape_timeout_s)
        # Router scrapes of the last polls (oldest first), for the surge window; and the last plan's maths for a new rate.
        self._recent_scrapes: deque[dict[str, Scrape]] = deque()
        self._replan: Callable[[float], int] | None = None
        self._planned_rate: float | None = None  # requests/s the last plan was made for
        self._held_counted = 0

    async def run(self) -> None:
        previous = await read_decision(self.client)
        workers = WorkerDirectory(self.etcd_config)
        healths = EtcdDirectory(self.etcd_config, prefix=HEALTH_PREFIX, message_type=common_pb2.WorkerHealthRecord)
        routers = EtcdDirectory(self.etcd_config, prefix=ROUTERS_PREFIX, message_type=common_pb2.RouterRegistration)
        try:
            await self._degradation.read()
            await self._target.read()
            await self._refresh(workers, healths, routers)
            # A successor carries on from the last decision (its ids and targets); a first planner from the fleet as it is.
            start = previous.workers if previous is not None else self._workers
            prefill = previous.prefill_workers if previous is not None else self.pools.counts.prefill if self.pools.disaggregated else None
            self.machine = DecisionMachine(
                DecisionConfig(
                    interval_s=self.config.interval_s, max_interval_s=self.config.max_interval_s, scale_deadline_s=self.config.scale_deadline_s,
                    replace_deadline_s=self.config.replace_deadline_s, promote_deadline_s=self.config.promote_deadline_s,
                    hot_spares=self.config.hot_spares, prefill_hot_spares=self.config.prefill_hot_spares,
                    scale_down_window_s=self.config.scale_down_window_s if self.config.scale_down_window_s is not None
                    else 3 * self.config.interval_s,
                    scale_down_confirm_s=self.config.scale_down_confirm_s if self.config.scale_down_confirm_s is not None
                    else self.config.surge_window_s,
                    hold_confidence=self.config.scale_down_hold_confidence, withdraw_odds=self.config.surge_withdraw_odds,
                ),
                start, first_id=previous.id + 1 if previous is not None else 1, prefill=prefill,
            )
            self.metrics.target_workers.set(start)
            self.metrics.show_prefill(target=prefill)
            self._sync_spares()
            deaths = EtcdDirectory(self.etcd_config, prefix=HEALTH_PREFIX, message_type=common_pb2.WorkerHealthRecord)
            await deaths.list()  # DEAD records from before we led were handled then; watch from here on
            # Only now: a DEAD record written from here on is seen (the watch starts at the listed revision).
            self.metrics.leader.set(1)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._watch_deaths(deaths))
                tasks.create_task(self._degradation.follow())
                tasks.create_task(self._target.follow())
                while True:  # common.leadership cancels the term once the lease lapsed
                    await self._step(workers, healths, routers)
                    await asyncio.sleep(self.config.poll_s)
        finally:
            for directory in (workers, healths, routers, self._spare_marks, self._degradation, self._target):
                await directory.close()
            await self._http.aclose()

    # -- one poll ------------------------------------------------------------------------------------
    async def _step(self, workers: WorkerDirectory, healths: EtcdDirectory, routers: EtcdDirectory) -> None:
        machine = self.machine
        assert machine is not None
        await self._refresh(workers, healths, routers)
        if self.pools.disaggregated:
            machine.plan_pools(self.pools.counts.prefill)
        await self._take_acks()
        target = self._target.value.workers if self._target.value is not None else None
        if target is not None and target != self._operator_target:
            machine.decide_at_next_tick()
        self._operator_target = target
        now = time.monotonic()
        recent = self._recent_arrivals()
        surge = self._surge(recent)
        if surge is not None:
            decision = machine.surge(now, self.readiness, surge[0], base_rate=self._planned_rate, surge_rate=surge[1])
            if decision is not None:
                if decision.promote:
                    await self._promote(decision.promote)
                    log.info("surge: decision %d promotes hot spare %s", decision.id, decision.promote)
                await self._publish(decision)
        trial = machine.provisional
        if trial is not None:
            since = self._arrivals_since(trial.since)
            if since is not None:
                decision = machine.surge_evidence(now, self.readiness, *since)
                if decision is not None:
                    self.metrics.surges_withdrawn.inc()
                    log.info("surge withdrawn: %.0f arrivals in the %.1f s after it favour the planned %.2f/s over %.2f/s", *since,
                             trial.base_rate, trial.surge_rate)
                    await self._publish(decision)
        # A scale-down decided at a tick goes only if arrivals stay down (decisions.py); a rise cancels it.
        decision = machine.arrivals(now, self.readiness, recent)
        self._count_held("a pending scale-down cancelled", recent)
        if decision is not None:
            await self._publish(decision)
        # Observe every interval, also while a decision is being carried out (the tick then decides nothing): the predictors
        # see every interval, and health's capacity view stays fresh through a slow scale-up, when it matters most.
        observe = machine.tick_due(now) or (self._observed_at is not None and now - self._observed_at >= machine.interval_s)
        if not (self.readiness.ready and observe):
            machine.tick(now, self.readiness, machine.targets.workers)  # expires what is past its deadline
            self._record_finished()
            return
        self._observed_at = now
        observation = await self._observe_interval()
        self._degradation_level = self._degradation.value.level if self._degradation.value is not None else 0
        self.metrics.degradation.set(self._degradation_level)
        # In a thread: a predictor's refit (ARIMA, Prophet) takes seconds, and the loop keeps the leadership lease alive.
        self._capacity = None
        desired = await asyncio.to_thread(self._desired, observation)
        recent = self._recent_arrivals()
        surge = self._surge(recent)
        if surge is not None and surge[0] > desired:
            # The interval's forecast is older than the last seconds' arrivals: a tick at the start of a burst must not drain
            # the workers the burst is about to need (measured: a scale-down 1 s into a burst, undone by a surge 0.8 s later).
            desired = surge[0]
        if desired < machine.targets.workers and observation is not None:
            floor = min(self._scale_down_floor(observation), machine.targets.workers)
            if floor > desired:
                log.info("scale-down to %d limited to %d: the arrivals are within the noise of %d workers' rate", desired, floor, floor)
                desired = floor
        self.metrics.desired_workers.set(desired)
        if self._capacity is not None and self.config.capacity_view:
            await self._publish_capacity(self._capacity)
        planned_rate = self._planned_rate if self._operator_target is None else None
        prefill = self.pools.prefill_target(self._desired_prefill, machine.targets.prefill)
        self.metrics.show_prefill(desired=prefill, actual=self.pools.counts.prefill if prefill is not None else None)
        decision = machine.tick(now, self.readiness, desired, arrivals=recent, planned_rate=planned_rate, desired_prefill=prefill)
        self._count_held(f"a scale-down to {desired} held at the tick", recent)
        self._record_finished()
        self.metrics.interval.set(machine.interval_s)
        if decision is not None:
            await self._publish(decision)

    async def _refresh(self, workers: WorkerDirectory, healths: EtcdDirectory, routers: EtcdDirectory) -> None:
        registered = await workers.list()
        health = await healths.list()
        marks = await self._spare_marks.list()
        alive = [w for w in registered if w not in health or health[w].health not in _NOT_SERVING]
        serving = [w for w in alive if w not in marks]
        self._spares = {w for w in alive if w in marks and w not in self._promoted}
        self._workers = self.pools.update({w: registration.role for w, registration in registered.items()}, serving)
        self._sync_spares()
        found = await routers.list()
        self.metrics.actual_workers.set(self._workers)
        self.metrics.routers.set(len(found))
        if self.config.prometheus_url:
            flowing = await self._prometheus_has_routers()
        else:
            flowing = await self._scrape_routers(found)
        self.readiness = Readiness(routers_serving=bool(found), serving_workers=self._workers, metrics_flowing=flowing)
        self.metrics.ready.set(1 if self.readiness.ready else 0)

    def _sync_spares(self) -> None:
        """Tell the machine which spares are ready (registered, marked, not failing) and which left without dying."""
        machine = self.machine
        if machine is None:
            return
        for worker_id in list(machine.spares):
            if worker_id not in self._spares:
                machine.spare_lost(worker_id)
        for worker_id in sorted(self._spares):
            machine.spare_ready(worker_id, role=self.pools.role(worker_id))
        self.metrics.spares.set(len(machine.spares) + len(machine.prefill_spares))

    async def _scrape_routers(self, routers: Mapping[str, common_pb2.RouterRegistration]) -> bool:
        async def one(router_id: str, address: str) -> tuple[str, Scrape | None]:
            try:
                reply = await self._http.get(f"http://{address}/metrics")
                reply.raise_for_status()
                return router_id, parse_scrape(reply.text, time.monotonic())
            except (httpx.HTTPError, ValueError) as error:
                log.debug("scraping router %s at %s failed: %s", router_id, address, error)
                self.metrics.observe_errors.labels("scrape").inc()
                return router_id, None

        results = await asyncio.gather(*(one(r, reg.metrics_address) for r, reg in routers.items() if reg.metrics_address))
        fresh = {router_id: scrape for router_id, scrape in results if scrape is not None}
        if any(router_id in self._scrapes for router_id in fresh):
            self._scraped_twice = True
        # A router gone from etcd leaves the next interval; one scraped for the first time starts it.
        self._tick_scrapes = {r: s for r, s in self._tick_scrapes.items() if r in fresh}
        for router_id, scrape in fresh.items():
            self._tick_scrapes.setdefault(router_id, scrape)
        self._scrapes = fresh
        self._recent_scrapes.append(fresh)
        longest_surge = self.config.surge_window_s * (_SURGE_WINDOWS[-1] if self.config.surge_confidence > 0 else 1)
        horizon = time.monotonic() - max(longest_surge, self.config.observe_window_s) - 2 * self.config.poll_s
        while self._recent_scrapes and min((s.at for s in self._recent_scrapes[0].values()), default=0.0) < horizon:
            self._recent_scrapes.popleft()
        return self._scraped_twice and bool(fresh)

    def _surge(self, recent: Arrivals | None) -> tuple[int, float] | None:
        """Workers the arrivals of the last seconds need, when they are a surge (`decisions.surge_workers`), and the rate it is
        sized for: at least `surge_min_requests` of them (a couple of requests at a low rate are no surge) over
        `surge_window_s` and, with `surge_confidence`, a rise beyond the noise of the rate the last plan was made for, over that
        window or one of _SURGE_WINDOWS times it (docs/results/2026-11-27-planner-passes.md, seventh pass: the trade it
        makes between worker-seconds and SLO attainment, measured)."""
        if recent is None or self._replan is None:
            return None
        windows = [recent]
        if self.config.surge_confidence > 0:
            windows += [w for w in (self._recent_arrivals(self.config.surge_window_s * k) for k in _SURGE_WINDOWS[1:]) if w is not None]
        c = self.config
        rate = surge_rate(windows, self._planned_rate, min_requests=c.surge_min_requests, confidence=c.surge_confidence,
                          size_confidence=c.surge_size_confidence)
        # `surge_workers`' count, the rate computed once: each window's `workers` is already the clamped plan of its own rate.
        return None if rate is None else (c.clamp(self._replan(rate)), rate)

    def _arrivals_since(self, since: float) -> tuple[float, float] | None:
        """Arrivals counted after the monotonic time `since`, and over how many seconds: from the first kept scrape round taken
        after it (every span after it is fresh evidence, however much of it is kept); None before two such rounds."""
        start = next((scrapes for scrapes in self._recent_scrapes if scrapes and min(s.at for s in scrapes.values()) >= since), None)
        if start is None or start is self._scrapes:
            return None
        observation = observe_scrapes(start, self._scrapes)
        if observation is None or observation.arrival_rate is None or observation.interval_s <= 0:
            return None
        return observation.arrival_rate * observation.interval_s, observation.interval_s

    def _scale_down_floor(self, observation: Observation) -> int:
        """With `scale_down_confidence`: the workers for the highest arrival rate the observed interval's count is within the
        Poisson noise of (`decisions.poisson_upper_bound`); 0 without it, an operator's target or a plan."""
        c = self.config
        if c.scale_down_confidence <= 0 or self._replan is None or self._operator_target is not None or observation.interval_s <= 0:
            return 0
        arrived = interval_demand(observation, self._degradation_level)
        return c.clamp(self._replan(poisson_upper_bound(arrived, c.scale_down_confidence) / observation.interval_s))

    def _count_held(self, what: str, recent: Arrivals | None) -> None:
        assert self.machine is not None
        held = self.machine.scale_downs_held
        if held > self._held_counted:
            self.metrics.scale_downs_held.inc(held - self._held_counted)
        if held > self._held_counted and recent is not None:
            log.info("%s: %.0f arrivals in the last %.1f s (%.2f/s, %d workers), planned for %.2f/s", what, recent.requests,
                     self.config.surge_window_s, recent.rate, recent.workers, self._planned_rate or 0.0)
        self._held_counted = held

    def _recent_arrivals(self, window_s: float | None = None) -> Arrivals | None:
        """The arrivals of the last `window_s` (default `surge_window_s`): how many, their rate, and the workers it needs at
        the last plan's lengths and factors; None when there is no plan yet, an operator's target, or Prometheus (whose rates
        are over the interval), or when the kept scrapes span less than half the window."""
        c = self.config
        window = c.surge_window_s if window_s is None else window_s
        if window <= 0 or c.prometheus_url or self._replan is None or self._operator_target is not None:
            return None
        now = time.monotonic()
        oldest = next((scrapes for scrapes in self._recent_scrapes if scrapes and _round_age(scrapes, now) <= window), None)
        if oldest is None or oldest is self._scrapes:
            return None
        observation = observe_scrapes(oldest, self._scrapes)
        if observation is None or observation.arrival_rate is None or observation.interval_s < window / 2:
            return None
        rate = observation.arrival_rate
        return Arrivals(requests=rate * observation.interval_s, rate=rate, workers=c.clamp(self._replan(rate)))

    async def _query(self, query: str) -> dict:
        reply = await self._http.get(f"{self.config.prometheus_url.rstrip('/')}/api/v1/query", params={"query": query})
        return reply.json()

    async def _prometheus_has_routers(self) -> bool:
        try:
            # Any router series: a router exporting gauges is scraped, even before its first request.
            response = await self._query('count({__name__=~"phalanx_router_.+"})')
        except (httpx.HTTPError, ValueError) as error:
            log.debug("prometheus query failed: %s", error)
            self.metrics.observe_errors.labels("prometheus").inc()
            return False
        return response.get("status") == "success" and bool(response.get("data", {}).get("result"))

    async def _observe_interval(self) -> Observation | None:
        if self.config.prometheus_url:
            assert self.machine is not None
            window = max(self.machine.interval_s, self.config.observe_window_s)
            queries = promql_queries(window)
            try:
                responses = dict(zip(queries, await asyncio.gather(*(self._query(q) for q in queries.values())), strict=True))
                return observe_prometheus(responses, window)
            except (httpx.HTTPError, ValueError) as error:
                log.warning("prometheus observation failed: %s", error)
                self.metrics.observe_errors.labels("prometheus").inc()
                return None
        observation = observe_scrapes(self._window_start(), self._scrapes)
        self._tick_scrapes = dict(self._scrapes)
        return observation

    def _window_start(self) -> Mapping[str, Scrape]:
        """The scrapes an observation starts from: the last tick's, or, when that is less than `observe_window_s` ago, the
        newest kept round at least that old (the oldest kept while the planner has not been up that long)."""
        window = self.config.observe_window_s
        now = time.monotonic()
        if window <= 0 or not self._tick_scrapes or _round_age(self._tick_scrapes, now) >= window:
            return self._tick_scrapes
        old_enough = [scrapes for scrapes in self._recent_scrapes if scrapes and _round_age(scrapes, now) >= window]
        return old_enough[-1] if old_enough else next((scrapes for scrapes in self._recent_scrapes if scrapes), self._tick_scrapes)

    # -- planning ------------------------------------------------------------------------------------
    def _desired(self, observation: Observation | None) -> int:
        """The count the interval's plan wants, within [min_workers, max_workers]: an operator's target first, then the profile's plan,
        else the current target."""
        assert self.machine is not None
        planned = self._plan(observation) if observation is not None else None
        if self._operator_target is not None:
            return self.config.clamp(self._operator_target)
        if planned is not None:
            return self.config.clamp(planned)
        return self.config.clamp(self.machine.targets.workers)

    def _plan(self, observation: Observation) -> int | None:
        """Feed the predictors (and correction factors) with the interval; the profile's worker count for the next one."""
        osl_mean = observation.osl.mean if observation.osl is not None else None
        isl_mean = observation.isl.mean if observation.isl is not None else self.config.default_isl
        # Demand: arrivals, and refusals while shedding (observations.interval_demand). Under overload few requests finish in
        # an interval (counted by completions alone the demand fell exactly when the fleet was short), and after a burst its
        # requests go on finishing for a request's duration (counted as demand, they held the fleet large).
        demand = interval_demand(observation, self._degradation_level)
        self.predictors["requests"].observe(demand)
        self.predictors["isl"].observe(isl_mean)
        if osl_mean is not None:
            self.predictors["osl"].observe(osl_mean)
            self.metrics.observed_osl.set(osl_mean)
            self._osl_seen = True
        elif self.config.default_osl is not None and not self._osl_seen:
            # No request completed yet: an overloaded fleet completes none, and that is no reason not to plan. The operator's
            # expected output length stands in until one does; after that the predictor carries the last lengths on.
            osl_mean = self.config.default_osl
        elif self._osl_seen:
            osl_mean = self.predictors["osl"].predict_next()
        self.metrics.observed_requests.set(demand / max(observation.interval_s, 1e-9))
        assert self.machine is not None
        self.metrics.lead_time.set(lead_s := self.config.lead_time_s if self.config.lead_time_s is not None else self.machine.lead_time_s or 0.0)
        requests = self.predictors["requests"].predict_peak(1.0 + lead_s / self.machine.interval_s)
        self.metrics.predicted_requests.set(requests / max(observation.interval_s, 1e-9))
        if self.profile is None or osl_mean is None:
            return None
        predicted_osl = self.predictors["osl"].predict_next() if self._osl_seen else osl_mean
        self.metrics.predicted_osl.set(predicted_osl)
        slo = SloTargets(ttft_s=self.config.ttft_slo_s, itl_s=self.config.itl_slo_s)
        # The plan aims below the SLOs by the headroom: the SLO bounds every request, and at a fleet sized exactly for it
        # the average request runs at it, so the requests of busier workers (routing is never perfectly even) miss it.
        aim = SloTargets(ttft_s=slo.ttft_s * self.config.slo_headroom, itl_s=slo.itl_s * self.config.slo_headroom)
        expected = expectation(observation, self.profile, isl_mean=isl_mean, osl_mean=osl_mean, workers=self._workers, itl_aim_s=aim.itl_s)
        if expected is not None:
            assert observation.ttft is not None and observation.itl is not None  # an expectation needs both
            factors = self.correction.update(
                observed_ttft_s=observation.ttft.mean, expected_ttft_s=expected_ttft_s(self.profile, isl_mean),
                observed_itl_s=observation.itl.mean, expected_itl_s=expected.itl_s,
                ttft_samples=observation.ttft.count, itl_samples=observation.itl.count, decode_load=expected.decode_load,
            )
        else:
            factors = self.correction.factors
        self.metrics.correction.labels("prefill").set(factors.prefill)
        self.metrics.correction.labels("decode").set(factors.decode)
        outcome = plan_step(PlanInputs(
            observation=observation, predicted_requests=requests,
            predicted_isl=self.predictors["isl"].predict_next() if observation.isl else self.config.default_isl,
            predicted_osl=predicted_osl, factors=factors, slo=slo, aim=aim,
            # Two pools are each floored at their own minimum (pools.py), not at min_workers.
            replicas=ReplicaConfig(interval_s=self.machine.interval_s, min_workers=0 if self.pools.disaggregated else self.config.min_workers,
                                   max_gpus=self.config.max_gpus, length_quantile=self.config.length_quantile,
                                   failure_reserve=self.config.failure_reserve),
            serving_workers=self._workers + self.pools.counts.prefill, current_target=self.machine.targets.workers,
            degradation_level=self._degradation_level, disaggregated=self.pools.disaggregated,
        ), self.profile)
        self._replan, self._planned_rate, self._capacity = outcome.replan, outcome.planned_rate, outcome.capacity
        self._desired_prefill = outcome.prefill
        plan = outcome.plan
        log.info("plan: %.2f req/s arrived, %.2f predicted (lead time %.1f s); ITL %s s observed, %s s profiled at %.0f %% of the operating "
                 "load; factors prefill %.2f decode %.2f; %s workers (prefill %.2f + decode %.2f at ITL target %.3f s), %d serving%s",
                 demand / max(observation.interval_s, 1e-9), outcome.planned_rate, lead_s,
                 f"{observation.itl.mean:.3f}" if observation.itl else "-", f"{expected.itl_s:.3f}" if expected else "-",
                 100 * (expected.decode_load if expected else math.nan), factors.prefill, factors.decode,
                 f"{plan.prefill} prefill + {plan.decode} decode" if outcome.prefill is not None else plan.combined, plan.prefill_raw,
                 plan.decode_raw, plan.itl_target_s, self._workers,
                 f"; held at the target of {outcome.workers} at level {self._degradation_level}" if outcome.held_at_target else "")
        return outcome.workers

    # -- decisions -----------------------------------------------------------------------------------
    async def _publish(self, decision: Decision) -> None:
        assert self.machine is not None
        replacing = sorted(d.replaces for d in self.machine.restorations.values() if d.replaces)
        record = DecisionRecord.of(decision, replacing)
        if not await self.connector.publish(record):
            raise LeadershipLostError("a fenced decision write failed: another planner leads")
        self.metrics.decisions.labels(str(decision.reason)).inc()
        self.metrics.target_workers.set(decision.targets.workers)
        prefill = decision.targets.prefill
        self.metrics.show_prefill(target=prefill)
        log.info("decision %d (%s): %d %sworkers%s", decision.id, decision.reason, decision.targets.workers,
                 f"decode + {prefill} prefill " if prefill is not None else "", f", replacing {', '.join(replacing)}" if replacing else "")

    async def _publish_capacity(self, view: CapacityView) -> None:
        """The view for health's degradation, valid for two intervals (a planner that stops deciding stops counting)."""
        assert self.machine is not None
        record = common_pb2.PlannerCapacityView(
            pressure=view.pressure, needed_workers=view.needed_workers, serving_workers=view.serving_workers,
            predicted_requests_per_s=view.predicted_requests_per_s, updated_at=time.time(), valid_for_s=2 * self.machine.interval_s,
        )
        self.metrics.capacity_pressure.set(view.pressure)
        if not await self.election.fenced_put(PLANNER_CAPACITY_KEY, encode_json(record)):
            raise LeadershipLostError("a fenced capacity write failed: another planner leads")

    async def _take_acks(self) -> None:
        assert self.machine is not None
        ack = await self.connector.acknowledged()
        if ack is None:
            return
        pending = [d.id for d in self.machine.restorations.values()]
        if self.machine.in_flight is not None:
            pending.append(self.machine.in_flight.id)
        now = time.monotonic()
        for decision_id in sorted(pending):
            if decision_id <= ack.id:
                self.machine.complete(decision_id, now)
        self._record_finished()

    def _record_finished(self) -> None:
        """Count decisions that finished since the last look (the machine's history is bounded: keep only ids it still holds)."""
        assert self.machine is not None
        history = self.machine.history
        for finished in history:
            if finished.decision.id not in self._counted:
                self.metrics.finished.labels(str(finished.outcome)).inc()
                if finished.outcome is Outcome.COMPLETED:
                    self.metrics.decision_latency.observe(finished.latency_s)
        self._counted = {finished.decision.id for finished in history}

    async def _watch_deaths(self, deaths: EtcdDirectory) -> None:
        """Restoration for workers that died; not for those that were DRAINING first by their own doing: a worker drains on
        SIGTERM, so it left on purpose (a scale-down, an operator), and replacing it would undo that."""
        draining: dict[str, None] = {}
        async for kind, worker_id, record in deaths.watch():
            if kind != "put" or record is None:
                continue
            if record.health == common_pb2.WORKER_HEALTH_DRAINING and record.circuit != common_pb2.CIRCUIT_STATE_OPEN:
                # The worker drains itself (SIGTERM). Health's quarantine of an UNHEALTHY worker is DRAINING too, with its
                # circuit open: that one did not leave on purpose, and its death is a loss to restore.
                draining[worker_id] = None
                while len(draining) > 1024:
                    del draining[next(iter(draining))]
                continue
            if record.health != common_pb2.WORKER_HEALTH_DEAD:
                draining.pop(worker_id, None)
                continue
            if draining.pop(worker_id, "alive") is None:
                log.info("worker %s drained and stopped: nothing to replace", worker_id)
                continue
            assert self.machine is not None
            decision = self.machine.worker_dead(time.monotonic(), worker_id, role=self.pools.role(worker_id))
            if decision is None:
                continue
            if decision.reason is DecisionReason.PROMOTE_SPARE and decision.promote:
                await self._promote(decision.promote)
                log.warning("worker %s is DEAD: decision %d promotes hot spare %s", worker_id, decision.id, decision.promote)
            else:
                log.warning("worker %s is DEAD: decision %d replaces it", worker_id, decision.id)
            await self._publish(decision)


    async def _promote(self, spare: str) -> None:
        """Capacity now: routers watch the marks, and route to the spare the moment its mark goes. The decision record
        follows for the orchestrator, which counts the spare as a worker and starts a new spare."""
        self._promoted[spare] = None
        while len(self._promoted) > 1024:
            del self._promoted[next(iter(self._promoted))]
        if not await self.election.fenced_delete(spare_key(spare)):
            raise LeadershipLostError("a fenced promotion failed: another planner leads")


def _round_age(scrapes: Mapping[str, Scrape], now: float) -> float:
    """Seconds since a round of scrapes began (its oldest scrape: a round spans every router's)."""
    return now - min(scrape.at for scrape in scrapes.values())


class PlannerProcess:
    def __init__(self, config: PlannerConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.etcd_config = etcd
        self.instance_id = validate_worker_id(config.instance_id or f"planner-{socket.gethostname()}-{os.getpid()}")
        self.metrics = PlannerMetrics()
        self.shell = ServiceShell("phalanx-planner", config, telemetry, registry=self.metrics.registry)
        self.ready = self.shell.ready
        self.election = LeaderElection(etcd, PLANNER_LEADER_KEY, ttl_s=config.leader_ttl_s)
        self.profile = load_profile(config.profile) if config.profile else None
        self.planner: Planner | None = None

    @property
    def address(self) -> str:
        return self.shell.address

    @property
    def metrics_address(self) -> str:
        return self.shell.metrics_address

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        async with self.shell as shell:
            client = connect_etcd(self.etcd_config)
            shell.push_async_callback(client.close)
            self.election.attach(client)
            await shell.start()
            shell.push_async_callback(self._resign)
            await shell.set_serving(True)
            log.info("planner %s on %s (metrics %s, connector %s)", self.instance_id, self.address, self.metrics_address, self.config.connector)
            async with asyncio.TaskGroup() as tasks:
                leading = tasks.create_task(self._lead_forever(client))
                await shell.wait_for_stop()
                await shell.stop_serving()
                leading.cancel()
            await shell.stop_server()

    def _connector(self, client: aetcd.Client) -> Connector:
        if self.config.connector == "kubernetes":
            from phalanx.planner.kubernetes_connector import KubernetesConnector

            return KubernetesConnector(self.config.kube_namespace, self.config.kube_statefulset,
                                       prefill_statefulset=self.config.prefill_statefulset)
        return VirtualConnector(client, self.election)

    async def _resign(self) -> None:
        try:
            await self.election.resign()
        except Exception:
            log.exception("resigning the leadership failed; the key lapses after its TTL")

    async def _lead_forever(self, client: aetcd.Client) -> None:
        await lead_forever(self.election, f"planner {self.instance_id}", self._leader_value, lambda: self._term(client))

    def _leader_value(self) -> bytes:
        return encode_json(common_pb2.PlannerLeader(instance_id=self.instance_id, address=self.address, pid=os.getpid(), elected_at=time.time()))

    async def _term(self, client: aetcd.Client) -> None:
        """One leadership term: plan until deposed."""
        connector = self._connector(client)
        self.planner = Planner(self.config, client, self.etcd_config, self.election, connector, self.metrics, self.profile)
        try:
            await self.planner.run()
        finally:
            self.planner = None
            self.metrics.leader.set(0)
            await connector.close()
