"""Canary calibration (majority, steadiness, margins) and judging, on synthetic answers."""

from __future__ import annotations

from phalanx.health.canary import CANDIDATE_PROMPTS, CanaryRun, calibrate, judge
from phalanx.health.state import CheckResult

P0, P1, P2 = CANDIDATE_PROMPTS[:3]


def run(worker: str, prompt: str, tokens, logits=None, margins=None) -> CanaryRun:
    tokens = tuple(tokens)
    return CanaryRun(worker, prompt, tokens, tuple(logits or [10.0] * len(tokens)), tuple(margins or [1.0] * len(tokens)))


def twice(worker: str, prompt: str, tokens, **kw) -> list[CanaryRun]:
    return [run(worker, prompt, tokens, **kw), run(worker, prompt, tokens, **kw)]


def test_calibration_keeps_prompts_the_majority_agrees_on_and_names_the_dissenter():
    runs = twice("a", P0, [1, 2, 3]) + twice("b", P0, [1, 2, 3]) + twice("c", P0, [1, 9, 9])
    result = calibrate("m@1", "m", runs, prompts_wanted=3, min_margin=0.05)
    assert [list(c.expected_token_ids) for c in result.calibration.cases] == [[1, 2, 3]]
    assert result.dissenters.keys() == {"c"}
    assert list(result.calibration.calibrated_on) == ["a", "b"]


def test_calibration_rejects_unsteady_prompts_and_near_ties():
    runs = [run("a", P0, [1, 2]), run("a", P0, [1, 3])]  # two runs disagree
    runs += twice("a", P1, [4, 5], margins=[0.5, 0.01])  # a near tie
    runs += twice("a", P2, [6, 7], logits=[9.0, 11.0])
    result = calibrate("m@1", "m", runs, prompts_wanted=3, min_margin=0.05)
    assert [c.prompt_text for c in result.calibration.cases] == [P2]
    assert set(result.rejected) == {P0, P1}
    assert list(result.calibration.cases[0].top_logit_min) == [9.0, 11.0]


def test_calibration_without_a_majority_fails():
    runs = twice("a", P0, [1]) + twice("b", P0, [2])
    result = calibrate("m@1", "m", runs, prompts_wanted=1, min_margin=0.0)
    assert result.calibration is None and "majority" in result.rejected[P0]


def test_calibration_keeps_at_most_the_wanted_number_in_candidate_order():
    runs = [r for p in reversed(CANDIDATE_PROMPTS[:5]) for r in twice("a", p, [1, 2])]
    result = calibrate("m@1", "m", runs, prompts_wanted=2, min_margin=0.05)
    assert [c.prompt_text for c in result.calibration.cases] == list(CANDIDATE_PROMPTS[:2])


def test_top_logit_range_spans_every_agreeing_run():
    runs = twice("a", P0, [1, 2], logits=[10.0, 5.0]) + twice("b", P0, [1, 2], logits=[10.2, 4.9])
    case = calibrate("m@1", "m", runs, prompts_wanted=1, min_margin=0.0).calibration.cases[0]
    assert abs(case.top_logit_min[0] - 10.0) < 1e-5 and abs(case.top_logit_min[1] - 4.9) < 1e-5
    assert abs(case.top_logit_max[0] - 10.2) < 1e-5


def _case():
    runs = twice("a", P0, [1, 2, 3], logits=[10.0, 8.0, 6.0])
    return calibrate("m@1", "m", runs, prompts_wanted=1, min_margin=0.0).calibration.cases[0]


def test_judge_passes_the_expected_answer_within_tolerance():
    outcome = judge(_case(), [1, 2, 3], [10.2, 7.9, 6.1], 0.02, tolerance=0.05)
    assert outcome.result is CheckResult.PASS and outcome.latency_s == 0.02


def test_judge_names_the_first_mismatching_position():
    outcome = judge(_case(), [1, 2, 7], [10.0, 8.0, 6.0], 0.02, tolerance=0.05)
    assert outcome.result is CheckResult.FAIL and outcome.reason == "token_mismatch"
    assert "position 2" in outcome.detail


def test_judge_catches_a_short_answer():
    outcome = judge(_case(), [1, 2], [10.0, 8.0], 0.02, tolerance=0.05)
    assert outcome.reason == "token_mismatch" and "position 2" in outcome.detail


def test_judge_catches_right_tokens_with_wrong_logits():
    outcome = judge(_case(), [1, 2, 3], [10.0, 12.0, 6.0], 0.02, tolerance=0.05)
    assert outcome.result is CheckResult.FAIL and outcome.reason == "logit_out_of_range"
