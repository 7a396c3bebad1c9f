"""`phalanx bench disagg` (phalanx.bench.disagg_serving): the simulated runner's prefill/decode interference, the
simulated hand-over, and the bench's result shape on a tiny fleet."""

from __future__ import annotations

import json

import pytest

from phalanx.bench.disagg_serving import DisaggBenchSettings, bench_profile, run_disagg_serving_bench, run_fleet
from phalanx.worker.simulated import SimulatedRunner

pytestmark = pytest.mark.unit

TINY = DisaggBenchSettings(
    workers=2, prefill_workers=1, seconds=4.0, warmup_s=0.5, steady_rps=6.0, steady_tokens=32, long_rps=2.0, long_min=512,
    long_max=1024, long_tokens=8, max_batched_tokens=512,
)


def test_a_long_prefill_in_a_batch_stretches_the_decode_step_of_the_other_sequences() -> None:
    # The interference disaggregation removes: a mixed step lasts the prefill chunk's time plus the decodes'.
    runner = SimulatedRunner(bench_profile(), [1])
    decodes = [1024] * 8
    alone = runner.step_seconds(0, decodes)
    mixed = runner.step_seconds(2048, decodes)
    assert mixed == pytest.approx(alone + runner.profile.prefill_ttft(2048))
    assert mixed > 5 * alone


def test_the_disaggregated_fleet_hands_every_long_prompt_over_and_keeps_decode_steps_short() -> None:
    agg, dis = run_fleet(TINY, disagg=False), run_fleet(TINY, disagg=True)
    assert agg["handovers"] == 0 and dis["handovers"] >= dis["long_prompts"] > 0
    assert dis["workers"] == {"monolithic": 0, "prefill": 1, "decode": 1}
    assert dis["completed"] == dis["requests"] and agg["completed"] == agg["requests"]
    # The decode worker never runs a long prefill chunk: its ITL p99 stays below a 512-token chunk's time.
    assert dis["itl_during_long_arrivals_s"]["p99"] < bench_profile().prefill_ttft(512)
    assert agg["itl_during_long_arrivals_s"]["p99"] > bench_profile().prefill_ttft(256)
    assert 0 < dis["kv_transfer_share_of_ttft"] < 1


def test_the_result_has_goals_and_a_met_map_and_says_what_is_simulated() -> None:
    result = run_disagg_serving_bench(TINY, real={"tokens": 1024, "transfer_s": 0.5, "prefill_s": 2.0})
    assert set(result["met"]) == {"itl_p99_during_long_arrivals_ratio", "goodput_disagg_vs_agg"}
    assert "simulated" in result["simulated"] and "KV hand-over simulated" in result["simulated"]
    assert result["real_transfer"]["kv_transfer_s_per_1k_tokens"] == 0.5
    assert result["real_transfer"]["kv_transfer_share_of_ttft"] == 0.2
    json.dumps(result)


@pytest.mark.slow
def test_phalanx_bench_disagg_runs_in_a_tiny_configuration() -> None:
    from typer.testing import CliRunner

    from phalanx.cli.bench import bench_app

    args = ["disagg", "--json", "--workers", "3", "--prefill-workers", "1", "--seconds", "4", "--warmup", "0.5", "--steady-rps", "2",
            "--long-rps", "1", "--long-min", "1024", "--long-max", "2048"]
    outcome = CliRunner().invoke(bench_app, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.output)
    assert result["aggregated"]["workers"]["monolithic"] == 3
    assert result["disaggregated"]["workers"] == {"monolithic": 0, "prefill": 1, "decode": 2}
    assert result["itl_p99_during_long_arrivals_ratio"] > 1.0
