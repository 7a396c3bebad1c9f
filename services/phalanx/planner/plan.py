"""The planner's plan step: one interval's predictions in, worker counts out. Pure, no I/O.

The service (planner/service.py) observes an interval, feeds its predictors and correction factors, and hands
the predictions to `plan_step`; the `PlanOutcome` it gets back holds the count the plan wants, the capacity view
health reads, and `replan`, the same maths for another arrival rate (surges, scale-down floors). What the
service does with it (metrics, the capacity write, the decision machine) is the service's.

The degradation level is an input: from `ReplicaConfig.relaxed_slo_level` (3) on, the deployment promises
relaxed latency SLOs and the plan targets those. The level is health's, and one of health's inputs is the
capacity view this step returns (docs/components.md, "The degradation level"): the two feed each other. At a
relaxed level the plan therefore never asks for fewer workers than the target in force (`held_at_target`):
a fleet is degraded because it lacks capacity, and the relaxed SLOs' smaller plan, fed back through the
capacity view, lowered the pressure, then the level, then raised the plan again: the loop scaled an
overloaded fleet down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from phalanx.planner.capacity import CapacityView, capacity_view
from phalanx.planner.correction import CorrectionFactors, decode_load, expected_itl_s, fleet_concurrency
from phalanx.planner.distribution import Summary
from phalanx.planner.observations import Observation
from phalanx.planner.profile import PerformanceProfile
from phalanx.planner.replicas import LoadForecast, ReplicaConfig, ReplicaPlan, SloTargets, plan_replicas

__all__ = ["Expectation", "PlanInputs", "PlanOutcome", "expectation", "plan_step", "scaled"]


@dataclass(frozen=True)
class Expectation:
    """What the profile expected of an observed interval: the correction factors compare it with what was observed."""

    itl_s: float
    decode_load: float  # share of the operating load the fleet ran at


def expectation(observation: Observation, profile: PerformanceProfile, *, isl_mean: float, osl_mean: float, workers: int,
                itl_aim_s: float) -> Expectation | None:
    """None when the interval measured no latencies (nothing completed)."""
    if observation.ttft is None or observation.itl is None:
        return None
    duration = observation.ttft.mean + osl_mean * observation.itl.mean
    context = isl_mean + osl_mean / 2
    concurrency = fleet_concurrency(request_rate=observation.request_rate, request_duration_s=duration, workers=max(workers, 1))
    return Expectation(itl_s=expected_itl_s(profile, concurrency, context=context),
                       decode_load=decode_load(profile, concurrency, itl_target_s=itl_aim_s, context=context))


@dataclass(frozen=True)
class PlanInputs:
    """One interval's predictions and the fleet they plan for."""

    observation: Observation
    predicted_requests: float  # over the observed interval
    predicted_isl: float  # the configured default when the interval measured no input lengths
    predicted_osl: float
    factors: CorrectionFactors
    slo: SloTargets  # the configured SLOs
    aim: SloTargets  # what the plan aims at: the SLOs less the headroom
    replicas: ReplicaConfig  # its interval_s: the decision machine's adaptive interval
    serving_workers: int
    current_target: int  # of the routed workers (a disaggregated fleet's decode pool)
    degradation_level: int
    # Two pools (planner/pools.py): `workers` and `replan` are then the decode pool's, `prefill` the prefill pool's.
    disaggregated: bool = False


@dataclass(frozen=True)
class PlanOutcome:
    workers: int  # what the plan wants of the routed workers (before the config's min/max clamp): aggregated, or decode
    plan: ReplicaPlan
    planned_rate: float  # requests/s the plan was made for
    capacity: CapacityView  # for health's degradation, read at the configured SLOs
    replan: Callable[[float], int]  # the same plan for another arrival rate (requests/s)
    held_at_target: bool  # a relaxed level's smaller plan was raised to the target in force (module docstring)
    prefill: int | None = None  # a disaggregated fleet's prefill workers (before the pool's clamp); None: aggregated


def plan_step(inputs: PlanInputs, profile: PerformanceProfile) -> PlanOutcome:
    """The workers the next interval needs for the predicted load (the module docstring)."""
    observation, interval = inputs.observation, inputs.replicas.interval_s
    # The forecast is for one interval of the adaptive length; requests scale with it.
    forecast = LoadForecast(
        requests=inputs.predicted_requests / max(observation.interval_s, 1e-9) * interval,
        isl=scaled(observation.isl, inputs.predicted_isl) if observation.isl else Summary(mean=inputs.predicted_isl),
        osl=scaled(observation.osl, inputs.predicted_osl),
    )
    level, config = inputs.degradation_level, inputs.replicas
    plan = plan_replicas(forecast, profile, inputs.aim, config, inputs.factors, degradation_level=level)

    def routed(plan: ReplicaPlan) -> int:
        return plan.decode if inputs.disaggregated else plan.combined

    def replan(arrival_rate: float) -> int:
        return routed(plan_replicas(replace(forecast, requests=arrival_rate * interval), profile, inputs.aim, config, inputs.factors,
                                    degradation_level=level))

    planned_rate = forecast.requests / interval
    # The capacity view is read at the configured SLOs (capacity.py), whatever level or headroom the plan targets.
    at_slo = plan if level < config.relaxed_slo_level and inputs.aim == inputs.slo else plan_replicas(
        forecast, profile, inputs.slo, config, inputs.factors, degradation_level=0)
    capacity = capacity_view(at_slo, inputs.serving_workers, planned_rate)
    workers, held = routed(plan), False
    if level >= config.relaxed_slo_level and workers < inputs.current_target:
        workers, held = inputs.current_target, True
    return PlanOutcome(workers=workers, plan=plan, planned_rate=planned_rate, capacity=capacity, replan=replan, held_at_target=held,
                       prefill=plan.prefill if inputs.disaggregated else None)


def scaled(summary: Summary | None, mean: float) -> Summary:
    """The observed distribution's shape around a predicted mean (quantiles scaled by predicted/observed mean)."""
    if summary is None or summary.mean <= 0:
        return Summary(mean=mean)
    ratio = mean / summary.mean
    return Summary(mean=mean, quantiles={q: v * ratio for q, v in summary.quantiles.items()}, count=summary.count)

