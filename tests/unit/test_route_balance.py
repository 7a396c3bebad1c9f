"""The offline routing-balance model (phalanx.bench.route_balance): modelled workers behind the real RoutingTable."""

import pytest

from phalanx.bench.route_balance import simulate

pytestmark = pytest.mark.unit


def test_a_fleet_that_can_serve_the_trace_serves_nearly_all_of_it_and_one_worker_cannot():
    fleet = simulate(workers=7, minutes=2)
    alone = simulate(workers=1, minutes=2)
    assert fleet.slo_attainment >= 0.9 and fleet.most_running <= 12
    assert alone.slo_attainment < 0.5 and alone.most_running > 20
    assert alone.mean_itl_s > fleet.mean_itl_s >= 0.15 + 0.075  # a step with at least one sequence running


def test_the_running_sequence_term_spreads_the_sequences():
    # Weightless, only the reported step time (an average over steps that lags a burst by seconds at these step times) and
    # the requests routed since the last report tell workers apart, and sequences pile up on a few of them.
    weightless = simulate(workers=7, minutes=2, running_seq_steps=0.0)
    weighted = simulate(workers=7, minutes=2, running_seq_steps=1.0)
    assert weighted.mean_itl_s < weightless.mean_itl_s / 2 and weighted.most_running * 2 < weightless.most_running


def test_prompts_on_shared_system_prompts_find_them_in_the_workers_caches():
    shared = simulate(workers=7, minutes=2, shared_prefix=256)
    assert simulate(workers=7, minutes=2).prefix_hit_share == 0.0
    assert shared.prefix_hit_share > 0.6  # 256 of 296 tokens, once each worker has prefilled each system prompt
