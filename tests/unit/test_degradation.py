"""The capacity model behind graceful degradation: pressure, levels and their hysteresis."""

import math
import random

import pytest

from phalanx.common.errors import RequestShedError
from phalanx.health import degradation
from phalanx.health.config import DegradationConfig
from phalanx.health.degradation import DegradationPolicy, WorkerCapacity, target_level
from phalanx.health.metrics import HealthMetrics
from phalanx.router import admission as router_admission
from phalanx.router.admission import Admission, Tier
from phalanx.router.config import TenantPolicy
from phalanx.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit

# 300 tok/s needed, 100 tok/s per worker: four workers leave headroom, three are exactly enough.
CAPACITY = {"slo_tokens_per_s": 300.0, "worker_tokens_per_s": 100.0, "raise_after_s": 2.0, "lower_after_s": 30.0}


def make_config(**overrides) -> DegradationConfig:
    return DegradationConfig(**{**CAPACITY, **overrides})


def worker(worker_id: str = "w0", **fields) -> WorkerCapacity:
    defaults = dict(
        routable=True, weight=1.0, decode_tokens_per_s=0.0, prefill_tokens_per_s=4000.0, step_time_s=0.02,
        queue_depth=0, running_seqs=0, free_blocks=900, total_blocks=1000, report_age_s=0.1,
    )
    return WorkerCapacity(worker_id=worker_id, **{**defaults, **fields})


def fleet(n: int, **fields) -> list[WorkerCapacity]:
    return [worker(f"w{i}", **fields) for i in range(n)]


class Clock:
    """Drives a policy the way the health service does: one evaluation per interval."""

    def __init__(self, policy: DegradationPolicy, interval_s: float = 1.0) -> None:
        self.policy = policy
        self.interval_s = interval_s
        self.now = 1000.0

    def run(self, workers, seconds: float):
        """Evaluates for `seconds` (the first evaluation at once); returns the last decision."""
        end = self.now + seconds
        decision = self.policy.evaluate(self.now, workers)
        while self.now + self.interval_s <= end + 1e-9:
            self.now += self.interval_s
            decision = self.policy.evaluate(self.now, workers)
        self.now += self.interval_s
        return decision

    def levels(self, workers, seconds: float) -> list[int]:
        out = []
        for _ in range(round(seconds / self.interval_s)):
            out.append(self.policy.evaluate(self.now, workers).level)
            self.now += self.interval_s
        return out


@pytest.mark.parametrize(
    ("pressure", "level"),
    [(0.0, 0), (1.0, 0), (1.0001, 1), (1.15, 1), (1.2, 2), (1.4, 2), (1.5, 3), (2.0, 3), (2.01, 4), (math.inf, 4)],
)
def test_target_level_follows_the_pressure_thresholds(pressure, level):
    assert target_level(pressure) == level


def test_levels_follow_capacity_as_workers_leave_and_come_back():
    clock = Clock(DegradationPolicy(make_config()))
    four = clock.run(fleet(4), 10)
    assert (four.level, four.pressure, four.healthy_workers) == (0, 0.75, 4)
    three = clock.run(fleet(3), 10)
    assert (three.level, three.pressure) == (0, 1.0)  # exactly at the SLO is not overload
    two = clock.run(fleet(2), 10)
    assert (two.level, two.pressure) == (3, 1.5)
    one = clock.run(fleet(1), 10)
    assert (one.level, one.pressure) == (4, 3.0)
    # All four back: one step down per lower_after_s, never a jump.
    assert clock.levels(fleet(4), 125) == [4] * 30 + [3] * 30 + [2] * 30 + [1] * 30 + [0] * 5


def test_three_workers_keep_level_one_once_raised_the_margin_holds_it():
    # Pressure exactly 1.0 does not call for level 1, but does not allow leaving it either (needs < 0.9).
    clock = Clock(DegradationPolicy(make_config(), level=1))
    assert clock.run(fleet(3), 300).level == 1
    assert clock.run(fleet(4), 30).level == 0


def test_level_rises_only_after_the_target_held_for_raise_after_s():
    clock = Clock(DegradationPolicy(make_config(raise_after_s=2.0)))
    assert clock.levels(fleet(2), 4) == [0, 0, 3, 3]


def test_a_dip_during_the_raise_hold_restarts_it():
    clock = Clock(DegradationPolicy(make_config(raise_after_s=2.0)))
    assert clock.levels(fleet(2), 2) == [0, 0]
    assert clock.levels(fleet(4), 1) == [0]
    assert clock.levels(fleet(2), 4) == [0, 0, 3, 3]


def test_raise_goes_to_the_lowest_level_called_for_throughout_the_hold():
    clock = Clock(DegradationPolicy(make_config(raise_after_s=2.0)))
    assert clock.levels(fleet(1), 1) == [0]  # target 4
    assert clock.levels(fleet(2), 1) == [0]  # target 3
    assert clock.levels(fleet(1), 1) == [3]  # a single spike at the end does not reach 4
    assert clock.levels(fleet(1), 3) == [3, 3, 4]  # ...a held one does


def test_raise_after_zero_raises_at_the_first_evaluation():
    policy = DegradationPolicy(make_config(raise_after_s=0.0))
    assert policy.evaluate(0.0, fleet(2)).level == 3


def test_noisy_pressure_around_a_threshold_does_not_flap():
    # TPOT pressure uniformly in [1.05, 1.25] around the level 1/2 threshold of 1.15, every 250 ms.
    rng = random.Random(7)
    clock = Clock(DegradationPolicy(make_config(slo_tokens_per_s=0.0, slo_tpot_s=0.1)), interval_s=0.25)
    levels, targets = [], []
    for _ in range(2400):
        step = 0.1 * rng.uniform(1.05, 1.25)
        decision = clock.policy.evaluate(clock.now, [worker(running_seqs=8, step_time_s=step)])
        levels.append(decision.level)
        targets.append(target_level(decision.pressure))
        clock.now += clock.interval_s
    raw_changes = sum(a != b for a, b in zip(targets, targets[1:], strict=False))
    changes = [(a, b) for a, b in zip(levels, levels[1:], strict=False) if a != b]
    assert raw_changes > 500  # the noise alone would flip the level about every other evaluation
    assert len(changes) <= 2 and all(b > a for a, b in changes)  # it settles: up once or twice, never back down
    assert levels[-1] in (1, 2)


def test_pressure_below_a_threshold_but_inside_the_margin_does_not_lower():
    config = make_config(slo_tokens_per_s=0.0, slo_tpot_s=0.1)
    clock = Clock(DegradationPolicy(config, level=2))
    # 1.1 calls for level 1, but leaving level 2 needs pressure below 1.15 x 0.9 = 1.035.
    assert clock.run([worker(running_seqs=4, step_time_s=0.11)], 300).level == 2
    assert clock.run([worker(running_seqs=4, step_time_s=0.10)], 30).level == 1


def test_lowering_timer_restarts_when_pressure_comes_back():
    clock = Clock(DegradationPolicy(make_config(), level=2))
    assert clock.run(fleet(4), 20).level == 2
    assert clock.run([*fleet(2), worker("w2", weight=0.75)], 0).level == 2  # 300 / 275 = 1.09: not below 1.15 x 0.9
    assert clock.run(fleet(4), 20).level == 2
    assert clock.run(fleet(4), 10).level == 1


def test_stale_reports_count_as_no_capacity():
    workers = fleet(2) + [worker("w2", report_age_s=3.5), worker("w3", report_age_s=math.inf)]
    decision = DegradationPolicy(make_config(raise_after_s=0.0, report_stale_s=3.0)).evaluate(0.0, workers)
    assert (decision.level, decision.pressure, decision.healthy_workers) == (3, 1.5, 2)
    assert decision.reason == "throughput: need 300 tok/s, healthy capacity 200 tok/s (2 of 4 workers)"


def test_stale_worker_queue_does_not_count_either():
    # A silent worker's last report (a long queue) must not drive TTFT: the router sends new work elsewhere.
    stale = worker("w1", queue_depth=500, step_time_s=0.5, report_age_s=10.0)
    decision = DegradationPolicy(make_config(slo_tokens_per_s=0.0, raise_after_s=0.0)).evaluate(0.0, [worker("w0"), stale])
    assert decision.level == 0 and decision.healthy_workers == 1


def test_unroutable_workers_count_as_no_capacity():
    workers = fleet(2) + [worker("w2", routable=False), worker("w3", weight=0.0)]
    decision = DegradationPolicy(make_config(raise_after_s=0.0)).evaluate(0.0, workers)
    assert (decision.level, decision.healthy_workers) == (3, 2)


def test_suspicious_worker_counts_with_half_its_capacity():
    policy = DegradationPolicy(make_config(raise_after_s=0.0))
    four_with_two_suspicious = fleet(2) + [worker("s0", weight=0.5), worker("s1", weight=0.5)]
    assert policy.evaluate(0.0, four_with_two_suspicious).pressure == 1.0  # 100 + 100 + 50 + 50
    three_with_one_suspicious = fleet(2) + [worker("s0", weight=0.5)]
    decision = policy.evaluate(1.0, three_with_one_suspicious)
    assert (decision.pressure, decision.level) == (1.2, 2)


def test_full_kv_cache_calls_for_smaller_batches():
    policy = DegradationPolicy(make_config(slo_tokens_per_s=0.0, raise_after_s=0.0, min_free_kv_fraction=0.05))
    nearly = policy.evaluate(0.0, fleet(2, free_blocks=60, total_blocks=1000))
    assert nearly.level == 0 and nearly.pressure == pytest.approx(0.94 / 0.95)
    full = policy.evaluate(1.0, [worker("w0", free_blocks=0), worker("w1", free_blocks=10)])
    assert full.level == 1 and full.batch_scale == 0.75
    assert full.pressure == pytest.approx(0.995 / 0.95)
    assert full.reason.startswith("kv: 100% of 2000 blocks used, limit 95%")


def test_tpot_is_the_step_time_a_running_sequence_sees():
    policy = DegradationPolicy(make_config(slo_tokens_per_s=0.0, raise_after_s=0.0, slo_tpot_s=0.25))
    # 30 sequences at 300 ms and 10 at 100 ms: the mean sequence sees 250 ms (an unweighted mean would say 200).
    at_slo = policy.evaluate(0.0, [worker("a", running_seqs=30, step_time_s=0.3), worker("b", running_seqs=10, step_time_s=0.1)])
    assert at_slo.pressure == pytest.approx(1.0) and at_slo.level == 0
    idle_slow = worker("c", running_seqs=0, step_time_s=5.0)  # runs nothing: nobody waits on its steps
    slow = policy.evaluate(1.0, [worker("a", running_seqs=10, step_time_s=0.4), idle_slow])
    assert slow.pressure == pytest.approx(1.6) and slow.level == 3
    assert slow.reason.startswith("tpot: mean step 400 ms over 10 running sequences, SLO 250 ms")


def test_load_alone_stops_at_level_three_lost_capacity_reaches_four():
    """Slow steps, long queues and a full cache say busy: level 3 admits standard and premium; 4 is for lost capacity."""
    config = make_config(slo_tokens_per_s=0.0, raise_after_s=0.0, slo_tpot_s=0.25, slo_ttft_s=2.0)
    overloaded = [worker("a", running_seqs=18, step_time_s=0.536, queue_depth=40, free_blocks=0)]  # a busy host's steps
    decision = DegradationPolicy(config).evaluate(0.0, overloaded)
    assert decision.level == 3 and decision.pressure < 2.0
    assert decision.reason.startswith("ttft: best estimated wait 21.98 s")  # the real figure, though capped
    lost = DegradationPolicy(make_config(slo_tokens_per_s=250, worker_tokens_per_s=100, raise_after_s=0.0)).evaluate(0.0, fleet(1))
    assert lost.level == 4 and lost.reason.startswith("throughput: need 250 tok/s, healthy capacity 100 tok/s")
    assert DegradationPolicy(config).evaluate(0.0, []).level == 4


def test_ttft_uses_the_best_worker_for_new_requests():
    policy = DegradationPolicy(make_config(slo_tokens_per_s=0.0, raise_after_s=0.0, slo_ttft_s=2.0))
    busy = worker("busy", queue_depth=49, step_time_s=0.2)  # 10 s
    best = worker("best", queue_depth=9, step_time_s=0.2)  # (9 + 1) x 0.2 = 2 s
    assert policy.evaluate(0.0, [busy, best]).pressure == pytest.approx(1.0)
    worse = worker("best", queue_depth=14, step_time_s=0.2)  # 3 s
    decision = policy.evaluate(1.0, [busy, worse])
    assert decision.pressure == pytest.approx(1.5) and decision.level == 3
    assert decision.reason.startswith("ttft: best estimated wait 3.00 s (best: 14 queued), SLO 2 s")


def test_worst_criterion_sets_the_pressure():
    policy = DegradationPolicy(make_config(raise_after_s=0.0, slo_tpot_s=0.1))
    decision = policy.evaluate(0.0, fleet(4, running_seqs=4, step_time_s=0.13))  # throughput 0.75, tpot 1.3
    assert decision.pressure == pytest.approx(1.3) and decision.reason.startswith("tpot:")


def test_no_routable_fresh_worker_is_level_four_at_once():
    policy = DegradationPolicy(make_config(raise_after_s=60.0))
    for workers in ([], [worker(routable=False)], [worker(report_age_s=math.inf)], [worker(report_age_s=60.0)]):
        fresh = DegradationPolicy(make_config(raise_after_s=60.0))
        decision = fresh.evaluate(0.0, workers)
        assert decision.level == 4 and decision.pressure == math.inf and decision.healthy_workers == 0
    assert policy.evaluate(0.0, fleet(4)).level == 0
    decision = policy.evaluate(1.0, [])
    assert decision.level == 4 and decision.reason.startswith("no routable worker")
    # Workers back after the outage: the level their pressure calls for at once (4 of them: 0), then the usual rules.
    back = policy.evaluate(2.0, fleet(4))
    assert back.level == 0 and back.reason.endswith("4 routable worker(s) back after an outage: level set by their pressure")
    clock = Clock(policy)
    clock.now = 3.0
    assert clock.levels(fleet(2), 4) == [0, 0, 0, 0]  # a rise waits raise_after_s (60 s here) again


def test_after_an_outage_too_few_workers_get_the_level_their_pressure_calls_for():
    policy = DegradationPolicy(make_config())
    policy.evaluate(0.0, [])
    assert policy.evaluate(1.0, fleet(2)).level == 3  # pressure 1.5
    assert policy.evaluate(2.0, fleet(4)).level == 3  # from here on, one step per lower_after_s


def test_no_load_and_no_throughput_slo_is_level_zero():
    policy = DegradationPolicy(make_config(slo_tokens_per_s=0.0))
    idle = policy.evaluate(0.0, fleet(2, step_time_s=0.0, free_blocks=1000))
    assert (idle.level, idle.pressure, idle.reason) == (0, 0.0, "kv: 0% of 2000 blocks used, limit 95%")
    unknown = policy.evaluate(1.0, fleet(2, step_time_s=0.0, free_blocks=0, total_blocks=0))  # nothing measured yet
    assert (unknown.level, unknown.pressure, unknown.reason) == (0, 0.0, "no load")


@pytest.mark.parametrize(
    ("level", "need", "ttft", "tpot", "batch_scale"),
    [(0, 50, 2.0, 0.25, 1.0), (1, 110, 2.0, 0.25, 0.75), (2, 130, 2.0, 0.25, 0.75), (3, 180, 4.0, 0.5, 0.5), (4, 300, 4.0, 0.5, 0.5)],
)
def test_decision_reports_relaxed_slos_and_batch_scale_per_level(level, need, ttft, tpot, batch_scale):
    # One 100 tok/s worker and `need` tok/s: a pressure inside the band of `level`, so it neither rises nor drops.
    config = make_config(slo_tokens_per_s=need, slo_ttft_s=2.0, slo_tpot_s=0.25)
    clock = Clock(DegradationPolicy(config, level=level))
    decision = clock.run(fleet(1), 120)
    assert (decision.level, decision.ttft_slo_s, decision.tpot_slo_s, decision.batch_scale) == (level, ttft, tpot, batch_scale)


def test_latency_criteria_use_the_configured_slos_even_when_relaxed():
    # At level 3 the promise is 2 x 250 ms, but a 400 ms step is still pressure 1.6, not 0.8: no flapping back to 0.
    policy = DegradationPolicy(make_config(slo_tokens_per_s=0.0, slo_tpot_s=0.25), level=3)
    decision = policy.evaluate(0.0, [worker(running_seqs=4, step_time_s=0.4)])
    assert decision.pressure == pytest.approx(1.6) and decision.tpot_slo_s == 0.5


def test_resumes_from_the_stored_level_and_leaves_it_by_the_same_rules():
    clock = Clock(DegradationPolicy(make_config(), level=3))
    assert clock.levels(fleet(4), 31) == [3] * 30 + [2]
    assert DegradationPolicy(make_config(), level=9).level == 4
    assert DegradationPolicy(make_config(), level=-1).level == 0


def test_reason_tells_a_pending_move():
    policy = DegradationPolicy(make_config(raise_after_s=2.0))
    assert policy.evaluate(0.0, fleet(2)).reason.endswith("; level 3 called for 0.0 of 2 s")
    resumed = DegradationPolicy(make_config(lower_after_s=30.0), level=1)
    resumed.evaluate(0.0, fleet(4))
    assert resumed.evaluate(10.0, fleet(4)).reason.endswith("; level 0 allowed for 10.0 of 30 s")


# -- learned capacity (worker_tokens_per_s = 0) ----------------------------------------
def learning(**overrides) -> DegradationConfig:
    return make_config(worker_tokens_per_s=0.0, raise_after_s=0.0, **overrides)


def test_unsaturated_fleet_leaves_throughput_out_until_it_is_learned():
    # Light load: batch-1 rates say what workers did, not what they can do; reading them as capacity would shed.
    policy = DegradationPolicy(learning())
    decision = policy.evaluate(0.0, fleet(4, decode_tokens_per_s=20.0, running_seqs=1))
    assert decision.level == 0
    assert "throughput capacity not learned yet" in decision.reason
    assert policy.learned_capacity("w0") is None


def test_rate_measured_with_a_queue_is_capacity_and_idling_does_not_erode_it():
    policy = DegradationPolicy(learning())
    assert policy.evaluate(0.0, fleet(4, decode_tokens_per_s=100.0, queue_depth=5)).pressure == 0.75
    later = policy.evaluate(3600.0, fleet(4, decode_tokens_per_s=10.0))  # an hour of light load
    assert later.pressure == 0.75 and policy.learned_capacity("w0") == 100.0


def test_learned_levels_follow_workers_leaving():
    policy = DegradationPolicy(learning())
    policy.evaluate(0.0, fleet(4, decode_tokens_per_s=100.0, queue_depth=2))
    decision = policy.evaluate(1.0, fleet(2, decode_tokens_per_s=30.0))
    assert (decision.level, decision.pressure) == (3, 1.5)
    assert decision.reason == "throughput: need 300 tok/s, healthy capacity 200 tok/s (2 of 2 workers)"


def test_saturated_peak_decays_slowly_towards_a_lower_measured_rate():
    policy = DegradationPolicy(learning())
    policy.evaluate(0.0, [worker(decode_tokens_per_s=100.0, queue_depth=3)])
    policy.evaluate(60.0, [worker(decode_tokens_per_s=50.0, queue_depth=3)])
    assert policy.learned_capacity("w0") == pytest.approx(100.0 * 0.5 ** (60 / degradation.PEAK_HALF_LIFE_S))
    for t in range(120, 3600, 60):
        policy.evaluate(float(t), [worker(decode_tokens_per_s=50.0, queue_depth=3)])
    assert policy.learned_capacity("w0") == 50.0
    policy.evaluate(3600.0, [worker(decode_tokens_per_s=120.0, queue_depth=3)])  # a higher rate counts at once
    assert policy.learned_capacity("w0") == 120.0


def test_never_measured_worker_counts_as_the_fleet_median():
    policy = DegradationPolicy(learning())
    measured = [worker("a", decode_tokens_per_s=80.0, queue_depth=1), worker("b", decode_tokens_per_s=100.0, queue_depth=1),
                worker("c", decode_tokens_per_s=150.0, queue_depth=1)]
    newcomer = worker("new")  # registered, reported, never ran anything
    light = worker("light", decode_tokens_per_s=130.0)  # a lower bound above the median is kept
    decision = policy.evaluate(0.0, [*measured, newcomer, light])
    assert policy.learned_capacity("new") == 100.0 and policy.learned_capacity("light") == 130.0
    assert decision.pressure == pytest.approx(300 / (80 + 100 + 150 + 100 + 130))


def test_peaks_of_deregistered_workers_are_forgotten():
    policy = DegradationPolicy(learning())
    policy.evaluate(0.0, [worker("old", decode_tokens_per_s=500.0, queue_depth=1), worker("w0", decode_tokens_per_s=100.0, queue_depth=1)])
    policy.evaluate(1.0, [worker("w0", decode_tokens_per_s=100.0)])
    policy.evaluate(2.0, [worker("w0"), worker("old")])  # "old" came back as a fresh process
    assert policy.learned_capacity("old") == 100.0  # the fleet median, not its former 500


def test_configured_worker_rate_overrides_what_workers_report():
    policy = DegradationPolicy(make_config(raise_after_s=0.0, worker_tokens_per_s=100.0))
    assert policy.evaluate(0.0, fleet(2, decode_tokens_per_s=1000.0, queue_depth=3)).pressure == 1.5


# -- the level at the router --------------------------------------------------------------
def test_model_and_router_agree_on_what_levels_shed():
    assert router_admission.SHED_BEST_EFFORT_LEVEL == degradation.SHED_BEST_EFFORT_LEVEL
    assert router_admission.SHED_STANDARD_LEVEL == degradation.SHED_STANDARD_LEVEL == degradation.MAX_LEVEL


def test_each_level_scales_the_batch_and_relaxes_latency_as_it_says():
    assert [degradation.batch_scale(level) for level in range(6)] == [1.0, 0.75, 0.75, 0.5, 0.5, 0.5]
    assert [degradation.latency_slo_factor(level) for level in range(6)] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


def test_metric_help_texts_tell_what_each_level_does():
    assert router_admission.LEVELS_HELP == degradation.LEVELS_HELP
    for level, does in enumerate(["normal", "batches x0.75", "sheds best_effort", "batches x0.5 and latency SLOs x2", "rejects new requests"]):
        assert f"{level} " in degradation.LEVELS_HELP and does in degradation.LEVELS_HELP
    health = HealthMetrics().degradation._documentation
    router = RouterMetrics().degradation._documentation
    assert degradation.LEVELS_HELP in health and degradation.LEVELS_HELP in router


def test_losing_workers_sheds_best_effort_then_every_new_request():
    clock = Clock(DegradationPolicy(make_config()))
    router = Admission({"default": TenantPolicy()}, {})

    def served(workers) -> set[Tier]:
        router.level = clock.run(workers, 10).level
        ok = set()
        for tier in Tier:
            try:
                router.admit(tenant="", tier=tier, api_key=None)
                ok.add(tier)
            except RequestShedError as error:
                assert error.retry_after_s > 0
        return ok

    assert served(fleet(4)) == {Tier.PREMIUM, Tier.STANDARD, Tier.BEST_EFFORT}
    assert served(fleet(2)) == {Tier.PREMIUM, Tier.STANDARD}  # level 3
    assert served(fleet(1)) == set()  # level 4: every new request waits while the fleet drains
    router = Admission({"default": TenantPolicy()}, {}, premium_at_level_4=True)
    assert served(fleet(1)) == {Tier.PREMIUM}  # ...unless premium is served there, while any capacity exists
    assert served([]) == {Tier.PREMIUM}  # no worker: level 4; routing itself answers UNAVAILABLE


# -- the planner's view ------------------------------------------------------------------
def test_a_fresh_planner_view_raises_the_pressure_and_a_stale_one_counts_for_nothing():
    from phalanx.health.degradation import PlannerView

    policy = DegradationPolicy(make_config(raise_after_s=0.0))
    workers = fleet(4)  # health's own reading: 300 of 400 tok/s, pressure 0.75
    own = policy.evaluate(1000.0, workers)
    assert own.pressure == pytest.approx(0.75)
    coming = PlannerView(pressure=1.6, needed_workers=6.4, serving_workers=4, age_s=1.0, valid_for_s=4.0)
    decision = policy.evaluate(1001.0, workers, coming)
    assert decision.pressure == pytest.approx(1.6) and decision.reason.startswith("planner: predicted demand needs 6.4 workers, 4 serving")
    assert decision.level == target_level(1.6)
    calm = PlannerView(pressure=0.2, needed_workers=0.8, serving_workers=4, age_s=1.0, valid_for_s=4.0)
    assert policy.evaluate(1002.0, workers, calm).pressure == pytest.approx(0.75)  # the larger of the two
    stale = PlannerView(pressure=1.6, needed_workers=6.4, serving_workers=4, age_s=9.0, valid_for_s=4.0)
    assert DegradationPolicy(make_config()).evaluate(1000.0, workers, stale).pressure == pytest.approx(0.75)
    off = DegradationPolicy(make_config(planner_view=False))
    assert off.evaluate(1000.0, workers, coming).pressure == pytest.approx(0.75)
    # A forecast alone never refuses every request: level 3 at most.
    short = PlannerView(pressure=5.0, needed_workers=20.0, serving_workers=4, age_s=0.0, valid_for_s=4.0)
    assert DegradationPolicy(make_config(raise_after_s=0.0)).evaluate(1000.0, workers, short).level == 3
