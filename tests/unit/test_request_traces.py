"""Request-level traces in the public layouts (Azure, BurstGPT, Mooncake), compressed and counted per planner interval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.planner.errors import TraceError
from phalanx.planner.predictors import TraceInterval, save_trace
from phalanx.planner.request_traces import TraceRequest, compress, load_any_trace, parse_request_trace, to_intervals

pytestmark = pytest.mark.unit

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:50.9951690,3180,8
2023-11-16 18:15:48.1000000,110,27
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
"""
MOONCAKE = "\n".join(json.dumps(row) for row in (
    {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 2]},
    {"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 3]},
)) + "\n"


def test_an_azure_trace_is_read_by_its_date_times_and_put_in_arrival_order():
    requests = parse_request_trace(AZURE)
    assert [(round(r.arrival_s, 3), r.isl, r.osl) for r in requests] == [(0.0, 4808, 10), (1.419, 110, 27), (4.315, 3180, 8)]


def test_a_burstgpt_trace_keeps_its_failed_requests_with_no_output():
    assert parse_request_trace(BURSTGPT) == [TraceRequest(0.0, 472, 18), TraceRequest(40.0, 1087, 0), TraceRequest(113.0, 417, 276)]


def test_a_mooncake_trace_has_millisecond_timestamps():
    assert parse_request_trace(MOONCAKE) == [TraceRequest(0.0, 6755, 500), TraceRequest(0.0, 7319, 490), TraceRequest(3.052, 2287, 316)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,prompt,completion\n1,2,3\n", "the header of an Azure trace"),
        ("Timestamp,Model,Request tokens,Response tokens\n1,ChatGPT,-4,2\n", "Request tokens must be a finite count >= 0"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "neither seconds nor a date and time"),
        ('{"session_id": "conv_0", "input_length": 9176, "output_length": 142}\n', "needs timestamp, input_length, output_length"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no request in the trace"),
    ],
)
def test_a_malformed_trace_is_refused_with_where_and_why(text, message):
    with pytest.raises(TraceError, match=message):
        parse_request_trace(text, source="t.csv")


def test_compress_scales_arrivals_to_the_minutes_and_keeps_the_lengths():
    requests = [TraceRequest(0.0, 10, 1), TraceRequest(1800.0, 20, 2), TraceRequest(3600.0, 30, 3)]
    assert compress(requests, 10) == [TraceRequest(0.0, 10, 1), TraceRequest(300.0, 20, 2), TraceRequest(600.0, 30, 3)]
    with pytest.raises(ValueError):
        compress(requests, 0)


def test_intervals_count_requests_and_an_idle_interval_keeps_the_last_lengths():
    requests = [TraceRequest(0.0, 100, 10), TraceRequest(5.0, 300, 30), TraceRequest(25.0, 50, 5)]
    assert to_intervals(requests, 10.0) == [
        TraceInterval(0.0, 2.0, 200.0, 20.0), TraceInterval(10.0, 0.0, 200.0, 20.0), TraceInterval(20.0, 1.0, 50.0, 5.0),
    ]


def test_load_any_trace_tells_interval_traces_from_request_traces(tmp_path: Path):
    (tmp_path / "mooncake.jsonl").write_text(MOONCAKE)
    intervals, kind = load_any_trace(tmp_path / "mooncake.jsonl", interval_s=1.0)
    assert kind == "requests" and [i.requests for i in intervals] == [2.0, 0.0, 0.0, 1.0]
    (tmp_path / "burst.csv").write_text(BURSTGPT)
    intervals, kind = load_any_trace(tmp_path / "burst.csv", minutes=1.0, interval_s=30.0)  # 113 s -> 60 s
    assert kind == "requests" and [i.requests for i in intervals] == [2.0, 0.0, 1.0]  # at 0, 21.2 and 60 s
    save_trace(tmp_path / "intervals.csv", intervals)
    again, kind = load_any_trace(tmp_path / "intervals.csv")
    assert kind == "intervals" and again == intervals
    with pytest.raises(TraceError, match="replayed as it is"):
        load_any_trace(tmp_path / "intervals.csv", minutes=5)
