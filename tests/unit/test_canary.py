"""Canary calibration (majority, steadiness, margins) and judging, on synthetic answers."""

from __future__ import annotations

from phalanx._proto import common_pb2
from phalanx.common.subjects import canary_key
from phalanx.health.canary import (
    CANARY_FACTS,
    CANDIDATE_PROMPTS,
    CanaryFact,
    CanaryGroup,
    CanaryRun,
    calibrate,
    canary_facts,
    judge,
    logit_ulp,
    required_margin,
    worker_compute_dtype,
)
from phalanx.health.state import CheckResult
from phalanx.model.config import BUILTIN_CHECKPOINTS

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
    runs += twice("a", P1, [4, 5], margins=[0.01, 0.5])  # a near tie at the first token
    runs += twice("a", P2, [6, 7], logits=[9.0, 11.0])
    result = calibrate("m@1", "m", runs, prompts_wanted=3, min_margin=0.05)
    assert [c.prompt_text for c in result.calibration.cases] == [P2]
    assert set(result.rejected) == {P0, P1}
    assert list(result.calibration.cases[0].top_logit_min) == [9.0, 11.0]


def test_calibration_keeps_a_prompts_tokens_up_to_its_first_near_tie():
    runs = twice("a", P0, [1, 2, 3], margins=[0.5, 0.01, 0.5])
    result = calibrate("m@1", "m", runs, prompts_wanted=1, min_margin=0.05)
    (case,) = result.calibration.cases
    assert list(case.expected_token_ids) == [1] and len(case.top_logit_min) == len(case.top_logit_max) == 1


def test_a_dtypes_ulp_is_its_spacing_at_the_logits_magnitude():
    assert logit_ulp("bfloat16", 20.0) == logit_ulp("bfloat16", -16.0) == 0.125  # 8 bits of mantissa: 16-32 in steps of 1/8
    assert logit_ulp("bfloat16", 3.0) == 2.0**-6
    assert logit_ulp("float32", 20.0) == 2.0**-19
    assert logit_ulp("float16", 20.0) == 2.0**-6
    assert logit_ulp("float8_e4m3fn", 20.0) == logit_ulp("bfloat16", 20.0)  # unknown: as coarse as bfloat16


def test_the_required_margin_follows_the_dtype_and_the_logits_magnitude():
    assert required_margin("float32", 20.0, min_margin=0.05, margin_ulps=8) == 0.05
    assert required_margin("bfloat16", 20.0, min_margin=0.05, margin_ulps=8) == 1.0
    assert required_margin("bfloat16", 40.0, min_margin=0.05, margin_ulps=8) == 2.0
    assert required_margin("bfloat16", 0.5, min_margin=0.05, margin_ulps=8) == 0.05  # below, min_margin rules


def test_a_margin_float32_keeps_is_a_near_tie_in_bfloat16():
    # The reported canary: a greedy token won by one bfloat16 ulp at logit 20 (0.125, over min_margin) and flipped in a batch.
    runs = twice("a", P0, [260, 7], logits=[20.0, 20.0], margins=[0.125, 3.0]) + twice("a", P1, [5, 6], logits=[20.0, 20.0])
    kept = calibrate("m@1", "m", runs, prompts_wanted=3, min_margin=0.05, margin_ulps=8, compute_dtype="float32")
    assert [c.prompt_text for c in kept.calibration.cases] == [P0, P1]
    bf16 = calibrate("m@1", "m", runs, prompts_wanted=3, min_margin=0.05, margin_ulps=8, compute_dtype="bfloat16")
    assert [c.prompt_text for c in bf16.calibration.cases] == [P1]
    assert "below 1.0000 (bfloat16)" in bf16.rejected[P0]


def test_workers_share_canary_expectations_only_within_one_model_version_and_dtype():
    bf16 = common_pb2.WorkerRegistration(model_version="m@1", compute_dtype="bfloat16", kv_dtype="bfloat16")
    older = common_pb2.WorkerRegistration(model_version="m@1", kv_dtype="bfloat16")  # registered before compute_dtype
    f32 = common_pb2.WorkerRegistration(model_version="m@1", compute_dtype="float32")
    assert worker_compute_dtype(common_pb2.WorkerRegistration()) == "float32"
    assert CanaryGroup.of_worker(bf16) == CanaryGroup.of_worker(older) == CanaryGroup("m@1", "bfloat16") != CanaryGroup.of_worker(f32)
    runs = twice("a", P0, [1, 2])
    calibration = calibrate("m@1", "m", runs, prompts_wanted=1, min_margin=0.05, margin_ulps=8, compute_dtype="bfloat16").calibration
    assert CanaryGroup.of_calibration(calibration) == CanaryGroup("m@1", "bfloat16")
    assert canary_key("m@1", "bfloat16") != canary_key("m@1", "float32")


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


# -- real models: known facts --------------------------------------------------

FACT = CanaryFact("The capital of France is", " Paris")
PARIS = 7042


def fact_runs(worker: str, tokens, text: str, logits=(20.0,), margins=(5.0,), prompt: str = FACT.prompt) -> list[CanaryRun]:
    return [CanaryRun(worker, prompt, tuple(tokens), tuple(logits), tuple(margins), text)] * 2


def test_a_fact_calibrates_on_the_right_answer_and_its_logit_range():
    runs = fact_runs("a", [PARIS], " Paris", logits=(19.0,)) + fact_runs("b", [PARIS], " Paris", logits=(19.4,))
    result = calibrate("smol@1", "smol", runs, prompts_wanted=3, min_margin=0.05, facts=[FACT])
    (case,) = result.calibration.cases
    assert case.prompt_text == FACT.prompt and list(case.expected_token_ids) == [PARIS]
    assert abs(case.top_logit_min[0] - 19.0) < 1e-5 and abs(case.top_logit_max[0] - 19.4) < 1e-5
    assert not result.dissenters


def test_with_facts_the_generic_prompts_do_not_count():
    runs = fact_runs("a", [PARIS], " Paris") + twice("a", P1, [4, 5])
    result = calibrate("smol@1", "smol", runs, prompts_wanted=3, min_margin=0.05, facts=[FACT])
    assert [c.prompt_text for c in result.calibration.cases] == [FACT.prompt]


def test_the_truth_outvotes_a_wrong_majority():
    runs = fact_runs("a", [PARIS], " Paris") + fact_runs("b", [11], " Lyon") + fact_runs("c", [11], " Lyon")
    result = calibrate("smol@1", "smol", runs, prompts_wanted=3, min_margin=0.05, facts=[FACT])
    assert list(result.calibration.cases[0].expected_token_ids) == [PARIS]
    assert result.dissenters.keys() == {"b", "c"} and "' Lyon', not ' Paris'" in result.dissenters["b"]
    assert list(result.calibration.calibrated_on) == ["a"]


def test_a_model_wrong_everywhere_fails_calibration_and_every_worker_is_suspect():
    runs = fact_runs("a", [11], " Lyon") + fact_runs("b", [12], " the")
    result = calibrate("smol@1", "smol", runs, prompts_wanted=3, min_margin=0.05, facts=[FACT])
    assert result.calibration is None and "no worker answers" in result.rejected[FACT.prompt]
    assert result.dissenters.keys() == {"a", "b"}


def test_a_random_model_has_no_facts_and_calibrates_by_agreement():
    assert canary_facts("phalanx-tiny-moe") == ()
    runs = twice("a", P0, [1, 2, 3])
    assert calibrate("m@1", "phalanx-tiny-moe", runs, prompts_wanted=1, min_margin=0.05, facts=canary_facts("phalanx-tiny-moe")).calibration


def test_facts_are_kept_for_built_in_real_models_only():
    assert set(CANARY_FACTS) <= set(BUILTIN_CHECKPOINTS)
    assert canary_facts("smollm2-135m-instruct") == (FACT,)
