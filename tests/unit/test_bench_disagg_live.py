"""The live disaggregation bench's figures (phalanx.bench.disagg_live.figures), from requests made up here."""

from phalanx.bench.disagg_live import LiveSettings, _Request, figures

SETTINGS = LiveSettings(seconds=20.0, warmup_s=2.0, steady_tokens=3, long_out=2, ttft_slo_s=1.0, itl_slo_s=0.3)


def steady(sent_at: float, times: list[float]) -> _Request:
    return _Request("steady", sent_at, token_times=times, indexes=list(range(len(times))))


def test_only_the_gaps_that_end_while_a_long_prompt_waits_for_its_first_token_count_as_during_arrivals():
    long = _Request("long", 5.0, token_times=[8.0, 8.1], indexes=[0, 1])
    before = steady(3.0, [3.1, 3.2, 3.3])  # every gap ends before the long prompt arrives
    across = steady(7.0, [7.1, 7.5, 9.0])  # the 0.4 s gap ends at 7.5 (waiting); the 1.5 s one at 9.0 (not)
    result = figures([long, before, across], SETTINGS)
    assert result["itl_during_long_arrivals_s"]["gaps"] == 1
    assert result["itl_during_long_arrivals_s"]["p99"] == 0.4
    assert result["itl_s"]["p99"] == 1.5
    assert result["ttft_long_s"]["p50"] == 3.0


def test_goodput_counts_requests_within_both_slos_after_the_warmup_and_lost_or_repeated_tokens_are_caught():
    good = steady(3.0, [3.5, 3.6, 3.7])
    slow_first = steady(4.0, [5.5, 5.6, 5.7])  # TTFT 1.5 s > 1 s
    slow_gaps = steady(6.0, [6.1, 6.6, 7.1])  # mean gap 0.5 s > 0.3 s
    short = steady(8.0, [8.1, 8.2])  # fewer tokens than asked
    warmup = steady(1.0, [1.1, 1.2, 1.3])  # before the warm-up's end: not counted at all
    repeated = _Request("steady", 9.0, token_times=[9.1, 9.2, 9.3], indexes=[0, 1, 1])
    failed = _Request("long", 10.0, error="UnavailableError")
    result = figures([good, slow_first, slow_gaps, short, warmup, repeated, failed], SETTINGS)
    assert result["steady_requests"] == 5 and result["long_requests"] == 1
    assert result["goodput_rps"] == round(1 / 18, 3)  # `good` only: `repeated`'s timing is fine, its tokens are not
    assert result["requests_with_lost_or_repeated_tokens"] == 1
    assert result["errors"] == 1
    assert result["slo_attainment"] == round(1 / 6, 4)
