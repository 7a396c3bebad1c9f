"""KvFetchPolicy: how a restoring worker fetches KV from its source, decided from facts alone."""

import pytest

from phalanx.worker.kv_fetch import KvFetch, KvFetchDecision, KvFetchPolicy, KvFetchRoute

pytestmark = pytest.mark.unit

MIN_BYTES = 32 << 20
policy = KvFetchPolicy(channel_min_bytes=MIN_BYTES)


def test_a_kept_channel_carries_the_kv_whatever_its_size():
    for nbytes in (1, MIN_BYTES - 1, MIN_BYTES, 1 << 30):
        assert policy.decide(KvFetch(nbytes=nbytes, channel_kept=True)) == KvFetchDecision(KvFetchRoute.KEPT_CHANNEL)


def test_small_kv_without_a_kept_channel_goes_over_grpc_and_warms_a_channel():
    decision = policy.decide(KvFetch(nbytes=MIN_BYTES - 1))
    assert decision == KvFetchDecision(KvFetchRoute.GRPC, warm_channel=True)


def test_large_kv_without_a_kept_channel_forms_a_new_channel():
    assert policy.decide(KvFetch(nbytes=MIN_BYTES)) == KvFetchDecision(KvFetchRoute.NEW_CHANNEL)
    assert policy.decide(KvFetch(nbytes=1 << 30)) == KvFetchDecision(KvFetchRoute.NEW_CHANNEL)


@pytest.mark.parametrize("fetch", [KvFetch(nbytes=1 << 30, grpc_requested=True), KvFetch(nbytes=1 << 30, has_endpoint=False)])
def test_grpc_requested_or_no_endpoint_goes_over_grpc_without_warming(fetch):
    assert not policy.uses_channels(fetch)
    assert policy.decide(fetch) == KvFetchDecision(KvFetchRoute.GRPC)
    assert policy.decide(KvFetch(nbytes=1 << 30, channel_kept=True, grpc_requested=True)).route is KvFetchRoute.GRPC


def test_a_kept_channel_the_source_lost_falls_back_by_size():
    small, large = KvFetch(nbytes=1 << 20, channel_kept=True), KvFetch(nbytes=MIN_BYTES, channel_kept=True)
    assert policy.after_kept_channel_lost(small) == KvFetchDecision(KvFetchRoute.GRPC, warm_channel=True)
    assert policy.after_kept_channel_lost(large) == KvFetchDecision(KvFetchRoute.NEW_CHANNEL)


def test_zero_min_bytes_always_uses_a_channel():
    always = KvFetchPolicy(channel_min_bytes=0)
    assert always.decide(KvFetch(nbytes=0)) == KvFetchDecision(KvFetchRoute.NEW_CHANNEL)


def test_negative_min_bytes_is_refused():
    with pytest.raises(ValueError, match="channel_min_bytes"):
        KvFetchPolicy(channel_min_bytes=-1)
