"""Direct media delivery's bookkeeping: what an encoder holds and for how long, the router's handle cache, and the
worker request's media built from handles or rows."""

from __future__ import annotations

import pytest
import torch

from phalanx._proto import common_pb2, encoder_pb2
from phalanx.common.block_hash import MediaSpan
from phalanx.encoder_pool.held import DeliveryRate, DeliveryRates, HeldEmbeddings
from phalanx.router.media import Encoded, HandleCache, usable_for


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_held_embeddings_stay_for_their_hold_time_and_are_fetched_any_number_of_times():
    clock = _Clock()
    held = HeldEmbeddings(5.0, 1 << 20, clock=clock)
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    key = held.put(values)
    assert held.get(key) is not None and held.get(key) is not None  # a retry elsewhere fetches again
    assert torch.equal(held.get(key), values) and (len(held), held.nbytes) == (1, 48)
    clock.now += 4.9
    assert held.get(key) is not None
    clock.now += 0.2
    assert held.get(key) is None and (len(held), held.nbytes, held.dropped) == (0, 0, 1)
    assert held.get("never") is None


def test_held_embeddings_drop_the_oldest_past_their_byte_bound():
    held = HeldEmbeddings(60.0, 100, clock=_Clock())
    first = held.put(torch.zeros(10, dtype=torch.float32))  # 40 bytes
    second = held.put(torch.zeros(10, dtype=torch.float32))
    third = held.put(torch.zeros(10, dtype=torch.float32))  # 120 > 100: the first goes
    assert held.get(first) is None and held.get(second) is not None and held.get(third) is not None
    with pytest.raises(ValueError):
        HeldEmbeddings(0, 1)


def test_the_handle_cache_forgets_handles_5_s_before_their_hold_time_ends():
    clock = _Clock()
    cache = HandleCache(2, clock=clock)
    embedding, source = encoder_pb2.Embedding(rows=16, key="k1"), common_pb2.MediaSource(encoder_address="e:1", key="k1")
    cache.put((1, b"a"), embedding, source, hold_s=10.0)
    assert cache.get((1, b"a")) == (embedding, source)
    clock.now += 5.0  # a short hold: half of it
    assert cache.get((1, b"a")) is None and len(cache) == 0
    cache.put((1, b"a"), embedding, source, hold_s=60.0)
    clock.now += 54.9
    assert cache.get((1, b"a")) is not None
    clock.now += 0.2
    assert cache.get((1, b"a")) is None
    for name in (b"a", b"b", b"c"):
        cache.put((1, name), embedding, source, hold_s=10.0)
    assert cache.get((1, b"a")) is None and cache.get((1, b"c")) is not None  # least recently used out
    cache.put(None, embedding, source, hold_s=10.0)  # video: never cached
    assert len(cache) == 2


def test_a_worker_requests_media_carry_either_the_rows_or_where_they_wait():
    spans = [MediaSpan(3, 16, 7)]
    rows = encoder_pb2.Embedding(rows=16, hidden=4, dtype="float32", data=b"x" * 256, media_hash=7)
    (inline,) = Encoded([rows]).media(spans)
    assert (inline.start, inline.rows, inline.data, inline.HasField("source")) == (3, 16, b"x" * 256, False)
    handle = encoder_pb2.Embedding(rows=16, hidden=4, dtype="float32", key="k", media_hash=7)
    source = common_pb2.MediaSource(encoder_address="e:1", channel_endpoint="encoder-e", key="k")
    (direct,) = Encoded([handle], [source]).media(spans)
    assert (direct.start, direct.data, direct.source) == (3, b"", source)


def test_an_encoders_delivery_rate_averages_sends_large_enough_to_measure_a_link():
    rate = DeliveryRate(min_bytes=1000, alpha=0.5)
    assert rate.bytes_per_s == 0.0
    rate.observe(999, 1e-6)  # too small: latency, not bandwidth
    rate.observe(10_000, 0.0)
    assert rate.bytes_per_s == 0.0
    rate.observe(4_000, 0.001)
    assert rate.bytes_per_s == pytest.approx(4e6)  # the first measurement as it is
    rate.observe(2_000, 0.001)
    assert rate.bytes_per_s == pytest.approx(3e6)  # then a moving average
    with pytest.raises(ValueError):
        DeliveryRate(alpha=0.0)


def test_an_encoders_delivery_rates_average_each_workers_link_apart_for_the_most_recent_workers():
    rates = DeliveryRates(min_bytes=1000, alpha=0.5, max_links=2)
    rates.observe(4_000, 0.001, "w1")  # 4 MB/s
    rates.observe(4_000, 0.004, "w2")  # 1 MB/s
    rates.observe(2_000, 0.001, "w1")  # 2 MB/s: w1's average 3 MB/s
    rates.observe(999, 1e-6, "w3")  # too small to measure a link: no entry
    rates.observe(6_000, 0.001)  # a receiver that did not say: overall only
    assert rates.by_worker() == pytest.approx({"w1": 3e6, "w2": 1e6})
    assert rates.bytes_per_s == pytest.approx((((4e6 + 1e6) / 2 + 2e6) / 2 + 6e6) / 2)  # every send, one average
    rates.observe(8_000, 0.001, "w3")  # a third worker: the one sent to least recently (w2) drops out
    assert rates.by_worker() == pytest.approx({"w1": 3e6, "w3": 8e6})
    assert DeliveryRates(max_links=0).by_worker() == {}


def test_handles_are_used_until_5_s_or_half_of_the_hold_before_it_ends_and_the_cache_says_until_when():
    # The router passes a direct request's handles on to a migration only until then (after it, it encodes again).
    assert (usable_for(60.0), usable_for(10.0), usable_for(4.0)) == (55.0, 5.0, 2.0)
    clock = _Clock()
    cache = HandleCache(4, clock=clock)
    embedding, source = encoder_pb2.Embedding(rows=16, key="k"), common_pb2.MediaSource(encoder_address="e:1", key="k")
    assert cache.until((1, b"a")) == 0.0
    cache.put((1, b"a"), embedding, source, hold_s=60.0)
    assert cache.until((1, b"a")) == clock.now + 55.0
    assert cache.until(None) == 0.0
