"""SLO-aware admission (router/overload.py): admit what fits, hold what may still fit, refuse only what cannot make it."""

import pytest

from phalanx.router.admission import Tier
from phalanx.router.overload import (
    HOLD_ERROR_AGE_S,
    WARMUP_GAPS,
    AdmissionSettings,
    Admit,
    Arrival,
    Hold,
    OverloadPolicy,
    Refuse,
    RefuseReason,
    StepModel,
    TierSlo,
)
from phalanx.router.routing import WorkerLoad

pytestmark = pytest.mark.unit

SLO = TierSlo(ttft_s=1.0, itl_s=0.25)
# The workers' step: 40 ms + 20 ms per sequence, so at headroom 0.9 (0.225 s) a batch of 9 fits and 10 does not.
A, B = 0.04, 0.02


def load(worker_id: str = "w1", batch: int = 0, *, running: int | None = None, queue: int = 0, step_s: float | None = None,
         prefill: float = 10_000.0, pending: int = 0) -> WorkerLoad:
    running = batch if running is None else running
    step = (A + B * running if running else 0.0) if step_s is None else step_s
    return WorkerLoad(worker_id, batch, running, queue, step, prefill, pending)


def trained(*workers: str, settings: AdmissionSettings | None = None) -> OverloadPolicy:
    """A policy that has seen steps of every batch size from 1 to 12 on each worker."""
    policy = OverloadPolicy(settings or AdmissionSettings())
    for worker in workers or ("w1",):
        for n in range(12, 0, -1):
            policy.on_step(worker, n, A + B * n)
    return policy


def arrival(request_id: str, at: float, *, tier: Tier = Tier.STANDARD, prompt: int = 100, slo: TierSlo = SLO,
            max_tokens: int = 0) -> Arrival:
    return Arrival(request_id, int(tier), prompt, at, slo, max_tokens)


def finish(policy: OverloadPolicy, times: list[float]) -> None:
    for t in times:
        policy.on_finished(t)


# -- predictions -----------------------------------------------------------------------------------------------
def test_step_model_fits_the_line_of_step_time_over_batch_size():
    model = StepModel()
    for n in (1, 2, 4, 8, 3, 6):
        model.add(n, A + B * n)
    a, b = model.line()
    assert a == pytest.approx(A) and b == pytest.approx(B)


def test_step_model_tells_no_slope_from_one_batch_size_idle_reports_or_too_few():
    model = StepModel()
    for _ in range(10):
        model.add(4, 0.12)
        model.add(0, 5.0)  # no batch: no sample
    assert model.line() is None
    few = StepModel()
    few.add(1, 0.06)
    few.add(8, 0.2)
    assert few.line() is None


def test_without_a_line_the_mean_gap_is_scaled_and_errs_high():
    policy = OverloadPolicy()
    for _ in range(5):
        policy.on_step("w1", 4, 0.12)
    assert policy.step_at(load(batch=4), 5) == pytest.approx(0.15)  # 0.12 x 5 / 4: above the true 0.14


def test_a_cold_fleet_admits_one_sequence_per_worker_until_its_gaps_are_measured():
    policy = OverloadPolicy()
    cold = [load("w1", 0, step_s=0.0), load("w2", 0, step_s=0.0)]
    assert policy.step_at(cold[0], 1) is None
    assert policy.arrive(arrival("r1", 0.0), cold)[0] == Admit("r1", "w1")
    busy = [load("w1", 1, step_s=0.0), load("w2", 0, step_s=0.0)]
    assert policy.arrive(arrival("r2", 0.0), busy)[0] == Admit("r2", "w2")
    assert policy.arrive(arrival("r3", 0.0), [load("w1", 1, step_s=0.0), load("w2", 1, step_s=0.0)])[0] == Hold("r3")
    # A fresh worker's first gaps are its warm-up (its kernels' first calls): left out, the fleet is still cold.
    for _ in range(WARMUP_GAPS):
        policy.on_step("w1", 1, 0.9)
    assert policy.step_at(load("w1", 1), 1) is None
    assert policy.poll([load("w1", 1), load("w2", 1)], 0.05) == []
    policy.on_step("w1", 1, A + B)
    assert policy.poll([load("w1", 1), load("w2", 1)], 0.1) == [Admit("r3", "w1", pytest.approx(0.1))]


def test_a_burst_on_an_idle_worker_joins_at_once_up_to_the_batch_its_gaps_were_measured_at():
    # w1 ran batches of 1 to 12 before (its line fits 9): a burst on it idle (running 0) needs no slow start up to 9.
    policy = trained()
    decisions = [policy.arrive(arrival(f"r{i}", 0.0), [load("w1", i, running=0)])[0] for i in range(12)]
    assert [type(d) for d in decisions[:9]] == [Admit] * 9
    assert not isinstance(decisions[9], Admit)  # the 10th is over the ITL limit, measured or not
    # Beyond what it measured, slow start again: measured up to 3, an idle burst takes 3 at once; the 4th waits for a report.
    small = OverloadPolicy()
    for n in (3, 2, 1, 3, 2, 1):
        small.on_step("w1", n, A + B * n)
    assert [type(small.arrive(arrival(f"s{i}", 0.0), [load("w1", i, running=0)])[0]) for i in range(4)] == [Admit, Admit, Admit, Hold]


def test_a_cold_fleets_burst_is_not_refused_for_its_workers_warm_up_steps():
    # 12 streams on 3 fresh workers: one each at once, the rest held (up to 1 s of a 2 s SLO). Each worker's first gap
    # takes 0.4 s (its first step), its steps after that 60 ms. Counted, that first gap would make a batch of 2 look over
    # the ITL limit, so that the held requests waited for streams of 64 tokens and were refused as hopeless.
    patient = TierSlo(ttft_s=2.0, itl_s=0.25)
    policy = OverloadPolicy()
    batch = {"w1": 0, "w2": 0, "w3": 0}
    for i in range(12):
        loads = [load(w, n, step_s=0.0) for w, n in batch.items()]
        decision, _ = policy.arrive(arrival(f"r{i}", 0.0, slo=patient, max_tokens=64), loads)
        if isinstance(decision, Admit):
            batch[decision.worker_id] += 1
    assert sum(batch.values()) == 3 and policy.held == 9
    for i, worker in enumerate(batch):
        for gap, at in ((0.4, 0.4), (0.06, 0.46), (0.06, 0.52)):
            policy.on_step(worker, 1, gap, f"r{i}", at)
    effects = policy.poll([load(w, n) for w, n in batch.items()], 0.53)
    assert not [e for e in effects if isinstance(e, Refuse)]
    assert len([e for e in effects if isinstance(e, Admit)]) == 6  # each batch to 3, as slow start allows; 3 still held
    assert policy.held == 3


def test_a_batch_grows_at_most_to_twice_what_the_last_report_ran():
    policy = trained("w0")  # w1 measured nothing itself: the fleet's line is a guess for it
    # The line says 6 sequences fit, but the worker's last report ran 2: 4 at most until a report shows more.
    assert policy.arrive(arrival("r1", 0.0), [load("w1", 3, running=2)])[0] == Admit("r1", "w1")
    assert policy.arrive(arrival("r2", 0.0), [load("w1", 4, running=2)])[0] == Hold("r2")
    assert policy.poll([load("w1", 4, running=4)], 0.1) == [Admit("r2", "w1", pytest.approx(0.1))]


def test_no_more_sequences_join_a_worker_whose_tokens_already_come_slower_than_the_slo():
    policy = trained()
    for _ in range(5):
        policy.on_step("w1", 4, 0.3)  # the line says 0.12 at 4 sequences; the gaps say otherwise
    assert policy.arrive(arrival("r1", 0.0), [load("w1", 4)])[0] == Hold("r1")


def test_a_slot_freed_since_the_last_report_is_refilled_while_the_workers_gaps_are_within_the_limit():
    # A line a little off at the SLO's edge: 9 sequences predicted over the 0.225 s limit, but the worker's latest gaps,
    # at 9, are 0.19 s. A stream that ended since the report (8 counted, 9 running) leaves a slot to refill.
    policy = OverloadPolicy()
    for _ in range(3):
        for n in range(1, 13):
            policy.on_step("w1", n, 0.07 + 0.02 * n)
    for _ in range(4):
        policy.on_step("w1", 9, 0.19)
    assert policy.step_at(load("w1", 9), 9) > 0.225
    decision, _ = policy.arrive(arrival("refill", 0.0), [load("w1", 8, running=9)])
    assert decision == Admit("refill", "w1", 0.0, 100)
    # Growing past what it ran is the line's call: at 9 running and 9 counted, no room.
    assert not isinstance(policy.arrive(arrival("grow", 0.0), [load("w1", 9)])[0], Admit)


def test_a_worker_without_spread_borrows_the_fleets_line():
    policy = trained("w1")
    for _ in range(5):
        policy.on_step("w2", 3, A + B * 3)
    assert policy.step_at(load("w2", 3), 9) == pytest.approx(A + B * 9)


def test_ttft_counts_prompt_tokens_queued_ahead_and_one_step_with_the_request():
    policy = trained()
    w = load(batch=2, pending=900, prefill=1000.0)
    assert policy.ttft_s(w, 100) == pytest.approx(1.0 + A + B * 3)


# -- arrivals ------------------------------------------------------------------------------------------------------
def test_an_idle_fleet_admits_at_once_on_the_worker_with_the_lowest_predicted_ttft():
    policy = trained("w1", "w2")
    decision, displaced = policy.arrive(arrival("r1", 0.0), [load("w1", 5), load("w2", 1)])
    assert decision == Admit("r1", "w2") and displaced == []


def test_a_request_goes_to_a_worker_with_room_when_the_cheapest_has_none():
    policy = trained("w1", "w2")
    # w1 is full (a 10th sequence would step 0.24 s > 0.225); w2 has room though its queue makes it slower to start.
    decision, _ = policy.arrive(arrival("r1", 0.0), [load("w1", 9), load("w2", 5, pending=3000, prefill=10_000.0)])
    assert decision == Admit("r1", "w2")


def test_no_routable_worker_is_left_to_routing_not_refused_as_overload():
    decision, _ = OverloadPolicy().arrive(arrival("r1", 0.0), [])
    assert decision == Admit("r1", None)


def test_a_full_fleet_holds_a_request_while_it_may_still_make_its_ttft():
    policy = trained()
    decision, _ = policy.arrive(arrival("r1", 0.0), [load("w1", 9)])
    assert decision == Hold("r1")
    assert policy.held == 1


def test_a_request_is_refused_at_once_when_the_queue_ahead_drains_too_slowly_for_its_budget():
    policy = trained()
    policy.arrive(arrival("first", 0.0), [load("w1", 9)])
    finish(policy, [1.0, 2.0, 3.0, 4.0])  # 4 streams in 4 s: one place in the queue takes a second
    # Its place behind "first" is 2 s away at 1 a second: beyond its 0.9 s budget.
    decision, _ = policy.arrive(arrival("r1", 4.0), [load("w1", 9)])
    assert isinstance(decision, Refuse) and decision.reason is RefuseReason.QUEUE_TOO_SLOW
    # The hint: how long the queue ahead of it (and its own place) takes to drain.
    assert decision.retry_after_s == pytest.approx(2.0)


def test_a_request_is_held_only_when_a_slot_is_likely_to_free_within_its_hold():
    # Held at most 0.5 s (half its 1 s SLO). Slots freeing 2 a second: one within 0.5 s has a chance of 1 - e^-1 = 63 %,
    # short of the 95 % a hold needs, so it is refused at once instead of after a hold that fails 1 time in 3.
    slow = trained()
    slow.arrive(arrival("first", 0.0), [load("w1")])  # admitted on an idle worker: the policy's history starts here
    finish(slow, [0.5 * i for i in range(1, 9)])
    decision, _ = slow.arrive(arrival("r1", 4.0), [load("w1", 9)])
    assert isinstance(decision, Refuse) and decision.reason is RefuseReason.QUEUE_TOO_SLOW and decision.waited_s == 0
    # 10 a second: the first place frees within 0.5 s at 99.3 %, the second at 96 %, the third at 88 %.
    fast = trained()
    fast.arrive(arrival("first", 0.0), [load("w1")])
    finish(fast, [0.1 * i for i in range(1, 41)])
    decisions = [fast.arrive(arrival(f"r{i}", 4.0), [load("w1", 9)])[0] for i in range(3)]
    assert decisions[:2] == [Hold("r0"), Hold("r1")]
    assert isinstance(decisions[2], Refuse)
    # At a lower confidence the second place of the slow fleet is held too (1 - 2/e^1 = 26 % >= 25 %).
    lenient = trained(settings=AdmissionSettings(hold_confidence=0.25))
    lenient.arrive(arrival("first", 0.0), [load("w1")])
    finish(lenient, [0.5 * i for i in range(1, 9)])
    assert [lenient.arrive(arrival(f"r{i}", 4.0), [load("w1", 9)])[0] for i in range(3)][:2] == [Hold("r0"), Hold("r1")]


def test_holds_whose_slots_came_late_make_the_next_holds_stricter_until_they_age_out():
    policy = trained()
    policy.arrive(arrival("first", 0.0), [load("w1")])
    finish(policy, [0.1 * i for i in range(1, 41)])  # 10 a second: the head's slot is expected 0.1 s after it arrives
    assert policy.arrive(arrival("r0", 4.0), [load("w1", 9)])[0] == Hold("r0")
    (admitted,) = policy.poll([load("w1", 8)], 4.45)
    assert isinstance(admitted, Admit) and admitted.late_s == pytest.approx(0.35)
    assert policy.hold_margin_s(4.45) == pytest.approx(0.35)
    # At 8 a second a slot within its 0.5 s hold is 98 % likely; within the 0.15 s the margin leaves, 70 %: refused at once.
    decision, _ = policy.arrive(arrival("r1", 5.0), [load("w1", 9)])
    assert isinstance(decision, Refuse) and decision.reason is RefuseReason.QUEUE_TOO_SLOW and decision.waited_s == 0
    # A minute on, that hold no longer counts.
    assert policy.hold_margin_s(4.45 + HOLD_ERROR_AGE_S + 0.1) == 0.0


def test_a_failed_hold_counts_at_least_as_late_as_the_deadline_it_missed_and_one_in_32_is_within_the_margin():
    policy = trained()
    policy.arrive(arrival("first", 0.0), [load("w1")])
    finish(policy, [0.1 * i for i in range(1, 41)])
    for i in range(31):  # slots that came sooner than predicted
        at = 4.0 + 0.01 * i
        assert policy.arrive(arrival(f"quick-{i}", at), [load("w1", 9)])[0] == Hold(f"quick-{i}")
        (admitted,) = policy.poll([load("w1", 8)], at + 0.005)
        assert isinstance(admitted, Admit) and admitted.late_s < 0
    assert policy.hold_margin_s(4.4) == 0.0
    policy.arrive(arrival("r0", 4.4), [load("w1", 9)])  # expected at 4.4 + 4.4 / 40, held until 4.9 at the latest
    (refused,) = policy.poll([load("w1", 9)], 4.95)
    assert isinstance(refused, Refuse) and refused.reason is RefuseReason.BUDGET_SPENT
    # Its slot, by the drain rate now (40 in 4.95 s), was still 4.95 / 40 s away: later than its deadline.
    late = 4.95 + 4.95 / 40 - (4.4 + 4.4 / 40)
    assert refused.late_s == pytest.approx(late)
    assert policy.hold_margin_s(4.95) == 0.0  # 1 failure in 32 holds: within the 95 %
    policy.arrive(arrival("r1", 5.0), [load("w1", 9)])
    policy.poll([load("w1", 9)], 5.55)
    assert policy.hold_margin_s(5.55) > 0.4  # 2 in 32 are not: the margin is the lesser failure's lateness


def test_the_streams_it_relays_tell_when_slots_free_better_than_the_drain_rate():
    # A full batch of 9 on w1 (step 40 + 20 x 9 = 220 ms), admitted by this policy with 4, 9, 14 ... tokens to go: the
    # first slot frees with its 4th token (0.88 s), the second with its 9th (1.98 s).
    policy = trained()
    policy.arrive(arrival("first-seen", 0.0), [load("w1")])
    finish(policy, [0.5 * i for i in range(1, 9)])  # 2 a second: by the drain rate, a slot within 0.5 s at 63 %
    for i in range(9):
        policy.arrive(arrival(f"run-{i}", 4.0, max_tokens=5 + 5 * i), [load("w1", i)])
    patient = TierSlo(ttft_s=3.0, itl_s=0.25)  # held up to 1.5 s: the first slot comes in time, the second does not
    assert policy.arrive(arrival("first", 4.0, slo=patient), [load("w1", 9)])[0] == Hold("first")
    second, _ = policy.arrive(arrival("second", 4.0, slo=patient), [load("w1", 9)])
    assert isinstance(second, Refuse) and second.reason is RefuseReason.QUEUE_TOO_SLOW
    # A stream that ends leaves the count (its slot goes to "first"); run-0 next, 0.86 s from now: more than the 0.8 s a
    # request of a 1.6 s SLO may be held.
    policy.stream_ended("run-1")
    assert policy.poll([load("w1", 8)], 4.02) == [Admit("first", "w1", pytest.approx(0.02), 100)]
    hurried = TierSlo(ttft_s=1.6, itl_s=0.25)
    assert isinstance(policy.arrive(arrival("early", 4.02, slo=hurried), [load("w1", 9)])[0], Refuse)
    # Tokens relayed count down, from the last one: 1 to go after 3 more, 0.22 s away.
    for _ in range(3):
        policy.on_step("w1", 9, 0.22, "run-0", 4.5)
    assert policy.arrive(arrival("third", 4.5, slo=hurried), [load("w1", 9)])[0] == Hold("third")


def test_a_burst_on_an_idle_worker_waits_for_slow_start_not_for_the_drain_rate():
    # The fleet's line fits a batch of 9 within the ITL limit, but w1 itself measured nothing yet. A burst of 12 reaches it
    # between two load reports (running 0), after a slow drain (by it alone a second place would be refused): slow start
    # lets 2 join now, and the next 7 are held for the batch's growth at the next reports rather than refused; the 10th
    # on is beyond what the batch will take.
    policy = trained("w0")
    policy.arrive(arrival("first-seen", 0.0), [load("w1")])
    finish(policy, [0.5 * i for i in range(1, 9)])
    admitted = 0
    decisions = []
    for i in range(12):
        decision, _ = policy.arrive(arrival(f"r{i}", 4.0), [load("w1", admitted, running=0)])
        admitted += isinstance(decision, Admit)
        decisions.append(decision)
    assert [type(d) for d in decisions] == [Admit] * 2 + [Hold] * 7 + [Refuse] * 3
    # The next report shows 2 running: the batch may double, and the head of the queue joins.
    assert [type(e) for e in policy.poll([load("w1", 2)], 4.1)] == [Admit] * 2


def test_on_a_batch_above_what_fits_a_slot_opens_only_once_enough_streams_ended():
    # 11 running on w1 (step 260 ms, over the 225 ms limit), 10 of them this router's with 1, 2, 3 ... tokens to go: the
    # ITL fits 9 at most, so the batch must be down to 8 before one more may join: 3 ends, 0.78 s (not 0.26 s, one end).
    policy = trained()
    for i in range(11):
        policy.arrive(arrival(f"run-{i}", 1.0, max_tokens=2 + i), [load("w1", min(i, 8))])
    policy.stream_ended("run-10")
    for _ in range(5):
        policy.on_step("w1", 11, 0.26)  # its gaps: over the limit, so no slot is refilled at 11 either
    # Held at most half the TTFT SLO: 0.6 s of a 1.2 s SLO is too short, 1 s of a 2 s SLO is enough.
    decisions = {slo: policy.arrive(arrival(f"slo-{slo}", 1.0, slo=TierSlo(slo, 0.25)), [load("w1", 11)])[0] for slo in (1.2, 2.0)}
    assert isinstance(decisions[1.2], Refuse)
    assert decisions[2.0] == Hold("slo-2.0")


def test_a_refusal_is_decided_in_well_under_a_millisecond():
    import time

    policy = trained("w1", "w2", "w3", "w4")
    full = [load(f"w{i}", 9) for i in range(1, 5)]
    for i in range(200):
        policy.arrive(arrival(f"held-{i}", 0.0, slo=TierSlo(100.0, 0.25)), full)
    finish(policy, [0.5 * i for i in range(1, 11)])
    start = time.perf_counter()
    decision, _ = policy.arrive(arrival("late", 5.0), full)
    assert isinstance(decision, Refuse)
    assert time.perf_counter() - start < 0.005


def test_a_higher_tier_jumps_the_queue_only_of_lower_tiers():
    policy = trained()
    full = [load("w1", 9)]
    policy.arrive(arrival("standard", 0.0), full)
    policy.arrive(arrival("premium", 0.1, tier=Tier.PREMIUM), full)
    policy.arrive(arrival("standard-2", 0.2), full)
    admitted = policy.poll([load("w1", 8)], 0.3)  # room for exactly one
    assert admitted == [Admit("premium", "w1", pytest.approx(0.2))]
    admitted = policy.poll([load("w1", 7)], 0.4)  # room for two: first come, first served
    assert [e.request_id for e in admitted] == ["standard", "standard-2"]


def test_one_poll_does_not_admit_more_than_the_batches_have_room_for():
    policy = trained("w1", "w2")
    full = [load("w1", 9), load("w2", 9)]
    for i in range(6):
        policy.arrive(arrival(f"r{i}", 0.0), full)
    effects = policy.poll([load("w1", 7), load("w2", 8)], 0.1)  # 2 + 1 slots
    assert [e.request_id for e in effects] == ["r0", "r1", "r2"]
    assert sorted(e.worker_id for e in effects if isinstance(e, Admit)) == ["w1", "w1", "w2"]
    assert policy.held == 3


def test_a_held_request_whose_budget_ran_out_is_refused_with_how_long_it_waited():
    policy = trained()
    policy.arrive(arrival("r1", 0.0), [load("w1", 9)])
    assert policy.poll([load("w1", 9)], 0.4) == []
    # Held half its TTFT SLO at most: the router's share of the TTFT leaves room for the client's and the gateway's.
    assert policy.next_deadline() == pytest.approx(0.5)
    (refused,) = policy.poll([load("w1", 9)], 0.55)
    assert isinstance(refused, Refuse) and refused.reason is RefuseReason.BUDGET_SPENT
    assert refused.waited_s == pytest.approx(0.55)
    assert policy.held == 0


def test_a_held_request_waits_for_another_workers_slot_when_the_one_with_room_has_too_long_a_prefill_queue():
    policy = trained("w1", "w2")
    queued = load("w1", 2, pending=20_000)  # room in its batch, but 2 s of prefill queued: beyond the 0.9 s budget
    assert policy.arrive(arrival("r1", 0.0), [queued, load("w2", 9)])[0] == Hold("r1")
    assert policy.poll([queued, load("w2", 9)], 0.05) == []  # not refused "budget spent": w2's slot may still come
    assert policy.poll([queued, load("w2", 8)], 0.1) == [Admit("r1", "w2", pytest.approx(0.1))]


def test_held_requests_past_what_the_drain_rate_can_reach_are_refused_early():
    policy = trained(settings=AdmissionSettings(max_hold_share=1.0))
    full = [load("w1", 9)]
    for i in range(6):
        policy.arrive(arrival(f"r{i}", 0.0, slo=TierSlo(3.0, 0.25)), full)
    finish(policy, [0.4, 0.7, 1.0])  # 3 streams in the first second: 3 a second
    effects = policy.poll(full, 1.0)
    # Place k waits k / 3 s from now (1 s): places 1-4 reach a worker by 2.4 s, within the 2.7 s budget; 5 and 6 do not.
    assert sorted(e.request_id for e in effects) == ["r4", "r5"]
    assert all(isinstance(e, Refuse) and e.reason is RefuseReason.QUEUE_TOO_SLOW for e in effects)


def test_a_full_queue_displaces_the_newest_of_a_lower_tier_and_refuses_its_own():
    policy = trained(settings=AdmissionSettings(max_queued=2))
    full = [load("w1", 9)]
    policy.arrive(arrival("be", 0.0, tier=Tier.BEST_EFFORT), full)
    policy.arrive(arrival("std", 0.0), full)
    decision, displaced = policy.arrive(arrival("std-2", 0.1), full)
    assert decision == Hold("std-2")
    assert [(r.request_id, r.reason) for r in displaced] == [("be", RefuseReason.DISPLACED)]
    decision, displaced = policy.arrive(arrival("std-3", 0.2), full)
    assert isinstance(decision, Refuse) and decision.reason is RefuseReason.QUEUE_FULL and displaced == []
    decision, displaced = policy.arrive(arrival("prem", 0.3, tier=Tier.PREMIUM), full)
    assert decision == Hold("prem")
    assert [r.request_id for r in displaced] == ["std-2"]


def test_a_cancelled_request_leaves_the_queue():
    policy = trained()
    policy.arrive(arrival("r1", 0.0), [load("w1", 9)])
    policy.cancel("r1")
    assert policy.held == 0
    assert policy.poll([load("w1", 0)], 0.1) == []


def test_a_tier_with_looser_slos_fits_where_a_stricter_one_does_not():
    policy = trained()
    strict, _ = policy.arrive(arrival("strict", 0.0), [load("w1", 9)])
    loose, _ = policy.arrive(arrival("loose", 0.0, tier=Tier.PREMIUM, slo=TierSlo(2.0, 0.5)), [load("w1", 9)])
    assert isinstance(strict, Hold) and loose == Admit("loose", "w1")


def test_a_new_request_waits_behind_held_ones_of_its_tier_even_if_room_just_appeared():
    policy = trained()
    policy.arrive(arrival("first", 0.0), [load("w1", 9)])
    decision, _ = policy.arrive(arrival("second", 0.1), [load("w1", 5)])
    assert decision == Hold("second")
    assert [e.request_id for e in policy.poll([load("w1", 5)], 0.1)] == ["first", "second"]


def test_the_drain_rate_is_unknown_for_the_first_second_counts_the_last_window_and_outlives_idle_spells():
    policy = OverloadPolicy(AdmissionSettings(drain_window_s=5.0))
    policy.arrive(arrival("r", 0.0), [load()])
    policy.on_finished(0.5)
    assert policy.drain_per_s(0.5) is None
    finish(policy, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert policy.drain_per_s(5.0) == pytest.approx(6 / 5)
    assert policy.drain_per_s(7.5) == pytest.approx(3 / 5)  # 3.0, 4.0 and 5.0 are in the window
    # An idle spell empties the window: a burst after it is judged by the last rate measured, not held blind.
    assert policy.drain_per_s(30.0) == pytest.approx(3 / 5)


def test_a_request_no_worker_can_serve_within_its_slo_goes_to_an_idle_worker_and_waits_for_a_busy_one():
    # 50,000 prompt tokens at 10,000 tokens/s: 5 s to the first token, against a 1 s SLO, even on an idle worker.
    policy = trained("w1")
    decision, _ = policy.arrive(arrival("long", 0.0, prompt=50_000), [load("w1")])
    assert decision == Admit("long", "w1", 0.0, 50_000)
    # A busy worker is not idle: the request is held (then refused as before), not put in front of its batch.
    decision, _ = policy.arrive(arrival("long-2", 0.1, prompt=50_000), [load("w1", batch=2)])
    assert not isinstance(decision, Admit)
