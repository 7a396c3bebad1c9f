"""`phalanx bench goodput`'s arithmetic: what meets the SLOs, goodput, refusal latency, and the goals' verdicts."""

import pytest

from phalanx.bench.goodput import GOALS, Outcome, judge, summarize

pytestmark = pytest.mark.unit


def ok(ttft: float, gap: float, tokens: int = 4) -> Outcome:
    return Outcome(sent_at=0.0, status="ok", ttft_s=ttft, gaps=[gap] * (tokens - 1), tokens=tokens)


def refused(ms: float) -> Outcome:
    return Outcome(sent_at=0.0, status="refused", answered_s=ms / 1e3, retry_after="2")


def test_a_request_meets_the_slos_with_every_token_its_ttft_and_its_mean_gap_within_them():
    assert ok(0.5, 0.2).meets(1.0, 0.25, 4)
    assert not ok(1.5, 0.2).meets(1.0, 0.25, 4)
    assert not ok(0.5, 0.3).meets(1.0, 0.25, 4)
    assert not ok(0.5, 0.2, tokens=3).meets(1.0, 0.25, 4)  # cut short
    assert not Outcome(sent_at=0.0, status="timeout").meets(1.0, 0.25, 4)


def test_goodput_counts_what_met_both_slos_per_second_and_admitted_share_leaves_refusals_out():
    outcomes = [ok(0.5, 0.2), ok(0.5, 0.2), ok(2.0, 0.2), refused(10), refused(80), Outcome(sent_at=0.0, status="timeout")]
    summary = summarize(outcomes, 2.0, ttft_slo_s=1.0, itl_slo_s=0.25, osl=4)
    assert summary["goodput_rps"] == 1.0 and summary["offered_rps"] == 3.0
    assert summary["admitted_meeting_slo"] == 0.5  # 2 of the 4 not refused
    assert summary["refused"] == 2 and summary["refusal_ms_p50"] == 10.0 and summary["refusal_ms_p99"] == 80.0
    assert summary["refused_within_50ms"] == 0.5
    assert summary["statuses"] == {"ok": 3, "refused": 2, "timeout": 1}


def load(goodput: float, share: float = 1.0, refusal_p99: float | None = None) -> dict:
    return {"goodput_rps": goodput, "admitted_meeting_slo": share, "refusal_ms_p99": refusal_p99}


def test_the_goals_compare_each_load_with_capacity_and_off_must_collapse():
    modes = {
        "slo": {"1": load(4.0), "2": load(3.8, 0.97, 20.0), "4": load(3.5, 0.96, 45.0)},
        "off": {"1": load(4.0), "4": load(0.5, 0.1)},
    }
    ratios, met = judge(modes)
    assert ratios["slo"]["2"] == 0.95 and ratios["slo"]["4"] == 0.875 and ratios["off"]["4"] == 0.125
    assert met == {"goodput_2x_vs_1x": True, "goodput_4x_vs_1x": False, "admitted_meeting_slo": True, "refusal_p99_ms": True,
                   "off_collapses": True}
    assert set(met) == set(GOALS)


def test_a_goal_without_its_loads_is_not_judged():
    _, met = judge({"slo": {"1": load(4.0)}})
    assert met["goodput_2x_vs_1x"] is None and met["off_collapses"] is None and met["refusal_p99_ms"] is None


def test_after_faults_judges_the_requests_sent_soon_after_each_kill_and_counts_every_lost_one():
    from phalanx.bench.goodput import after_faults

    def sent(at: float, status: str = "ok", ttft: float = 0.2) -> Outcome:
        return Outcome(sent_at=at, status=status, ttft_s=ttft if status == "ok" else None, gaps=[0.1], tokens=2)

    outcomes = [sent(1.0, ttft=5.0), sent(21.0, ttft=0.9), sent(25.0, "error:ReadError"), sent(40.0, "refused"), sent(50.0, "timeout")]
    figures = after_faults(outcomes, [20.0], window_s=10.0)
    assert figures["kills"] == 1 and figures["requests_after_faults"] == 2
    assert figures["ttft_s_p99_after_faults"] == 0.9  # the slow one came before the kill
    assert figures["lost"] == 2  # cut and timed out; the refusal was an answer
