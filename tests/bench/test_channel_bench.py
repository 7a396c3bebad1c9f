"""`python -m phalanx.bench.channel`: gloo tensor channel vs the gRPC fallback vs memcpy, between two real processes."""

import pytest

from phalanx.bench.channel import run_channel_bench

pytestmark = pytest.mark.slow


async def test_channel_bench_reports_every_transport_and_the_channel_beats_grpc_for_bulk(etcd_config):
    result = await run_channel_bench([1, 16], repeats=3, etcd_config=etcd_config)
    assert set(result) >= {"sizes_mib", "channel_vs_grpc", "open_ms", "rtt_us"}
    assert set(result["sizes_mib"]) == set(result["channel_vs_grpc"]) == {"1", "16"}
    for row in result["sizes_mib"].values():
        assert set(row) == {"channel_gbps", "grpc_gbps", "memcpy_gbps"}
        assert all(value > 0 for value in row.values())
    assert result["channel_vs_grpc"]["16"] > 1.0
    assert 0 < result["open_ms"] < 1000 and 0 < result["rtt_us"] < 100_000
