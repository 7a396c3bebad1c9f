"""The latency SLOs a router counts violations against: the ones the health service publishes with the level."""

import pytest

from phalanx._proto import common_pb2
from phalanx.health.degradation import latency_slo_factor
from phalanx.router.slo import LatencyKind, LatencySlo

pytestmark = pytest.mark.unit


def published(level: int) -> common_pb2.DegradationState:
    """The state the health service publishes at `level` with SLOs of 2 s TTFT and 250 ms TPOT."""
    relax = latency_slo_factor(level)  # as DegradationPolicy reports them
    return common_pb2.DegradationState(level=level, ttft_slo_s=2.0 * relax, tpot_slo_s=0.25 * relax)


def test_no_published_state_judges_nothing():
    slo = LatencySlo.from_state(None)
    assert not slo.missed(LatencyKind.TTFT, 1e9) and not slo.missed(LatencyKind.ITL, 1e9)


@pytest.mark.parametrize(("level", "ttft_s", "itl_s"), [(0, 2.0, 0.25), (2, 2.0, 0.25), (3, 4.0, 0.5), (4, 4.0, 0.5)])
def test_latency_is_judged_against_the_slo_of_the_level_in_force(level, ttft_s, itl_s):
    slo = LatencySlo.from_state(published(level))
    assert (slo.limit_s(LatencyKind.TTFT), slo.limit_s(LatencyKind.ITL)) == (ttft_s, itl_s)
    assert slo.missed(LatencyKind.TTFT, ttft_s + 0.01) and not slo.missed(LatencyKind.TTFT, ttft_s)
    assert slo.missed(LatencyKind.ITL, itl_s + 0.01) and not slo.missed(LatencyKind.ITL, itl_s)


def test_a_three_second_first_token_misses_at_level_two_and_not_at_level_three():
    assert LatencySlo.from_state(published(2)).missed(LatencyKind.TTFT, 3.0)
    assert not LatencySlo.from_state(published(3)).missed(LatencyKind.TTFT, 3.0)
