"""The EW's cross-AW layer batcher: when a batch starts, and that nobody waits for an AW that is gone."""

import pytest

from phalanx.expert_worker.batcher import BatchPolicy, BatchStart, LayerBatcher

pytestmark = pytest.mark.unit
POLICY = BatchPolicy(window_s=0.002, min_rows=64, silence_s=0.1, num_layers=4)
L0, L1 = (0, True), (1, True)


def _batcher(*aws: str, now: float = 0.0) -> LayerBatcher[str]:
    """A batcher whose AWs are connected and each completed the last layer of a step at `now`: recently active,
    waiting nowhere, next at layer 0."""
    b: LayerBatcher[str] = LayerBatcher(POLICY)
    for aw in aws:
        b.connect(aw)
        b.deliver(aw, (3, True), f"warm-{aw}", 1, now)
    b.expire(now + POLICY.window_s)
    assert b.next_deadline() is None
    return b


def test_a_lone_attention_worker_is_never_kept_waiting():
    b: LayerBatcher[str] = LayerBatcher(POLICY)
    b.connect("a")
    (batch,) = b.deliver("a", L0, "a0", 3, now=0.0)
    assert batch.started_by is BatchStart.ALL_DELIVERED and batch.attention_workers() == ["a"]
    assert b.next_deadline() is None


def test_an_idle_attention_worker_that_never_delivered_is_not_expected():
    b: LayerBatcher[str] = LayerBatcher(POLICY)
    b.connect("a")
    b.connect("idle")
    (batch,) = b.deliver("a", L0, "a0", 3, now=0.0)
    assert batch.started_by is BatchStart.ALL_DELIVERED


def test_calls_of_two_active_attention_workers_for_one_layer_form_one_batch():
    b = _batcher("a", "b", now=0.0)
    assert b.deliver("a", L0, "a0", 3, now=0.01) == []
    assert b.next_deadline() == pytest.approx(0.01 + POLICY.window_s)
    (batch,) = b.deliver("b", L0, "b0", 2, now=0.0105)
    assert batch.started_by is BatchStart.ALL_DELIVERED
    assert batch.entries == [("a", "a0"), ("b", "b0")] and batch.rows == 5


def test_a_wait_ends_at_the_window_and_names_who_was_missing():
    b = _batcher("a", "b", now=0.0)
    assert b.deliver("a", L0, "a0", 3, now=0.01) == []
    assert b.expire(0.01 + POLICY.window_s / 2) == []
    (batch,) = b.expire(0.01 + POLICY.window_s)
    assert batch.started_by is BatchStart.WINDOW and batch.missing == {"b"}


def test_a_disconnected_attention_worker_is_not_waited_for():
    b = _batcher("a", "b", now=0.0)
    assert b.deliver("a", L0, "a0", 3, now=0.01) == []
    (batch,) = b.disconnect("b", now=0.0101)
    assert batch.started_by is BatchStart.ALL_DELIVERED and batch.attention_workers() == ["a"]
    # ... nor afterwards.
    (batch,) = b.deliver("a", L1, "a1", 3, now=0.02)
    assert batch.started_by is BatchStart.ALL_DELIVERED


def test_an_attention_worker_silent_past_the_probe_window_is_dropped():
    b = _batcher("a", "b", now=0.0)
    # b delivered last at 0.0; at 0.05 it is still expected, past silence_s it is not.
    assert b.deliver("a", L0, "a0", 3, now=0.05) == []
    b.expire(0.05 + POLICY.window_s)
    (batch,) = b.deliver("a", L1, "a1", 3, now=POLICY.silence_s + 0.001)
    assert batch.started_by is BatchStart.ALL_DELIVERED


def test_an_attention_worker_waiting_at_another_layer_is_not_waited_for():
    b = _batcher("a", "b", "c", now=0.0)
    assert b.deliver("a", L0, "a0", 3, now=0.01) == []
    # b arrives at layer 1 (it skipped this EW at layer 0): layer 0 now waits only for c; layer 1 waits for c too.
    assert b.deliver("b", L1, "b1", 3, now=0.0101) == []
    started = b.deliver("c", L0, "c0", 3, now=0.0102)
    # Every AW now waits somewhere: both layers start, neither waits out its window.
    assert sorted((s.key, s.started_by, len(s.entries)) for s in started) == [
        (L0, BatchStart.ALL_DELIVERED, 2),
        (L1, BatchStart.ALL_DELIVERED, 1),
    ]


def test_the_attention_worker_ahead_waits_for_the_one_behind_which_then_catches_up():
    b = _batcher("a", "b", now=0.0)
    # b's layer 0 waits for a (between steps) and its window runs out; then a comes to layer 0: b passed it, nobody
    # to wait for.
    assert b.deliver("b", L0, "b0", 3, now=0.01) == []
    (b0,) = b.expire(0.01 + POLICY.window_s)
    assert b0.started_by is BatchStart.WINDOW and b0.attention_workers() == ["b"]
    (a0,) = b.deliver("a", L0, "a0", 3, now=0.0122)
    assert a0.started_by is BatchStart.ALL_DELIVERED
    # a is still computing layer 0 when b is at layer 1: b waits for a (one layer behind) ...
    assert b.deliver("b", L1, "b1", 3, now=0.0124) == []
    # ... and a's layer 1 joins it: from here on they are in step.
    (both,) = b.deliver("a", L1, "a1", 3, now=0.0128)
    assert both.started_by is BatchStart.ALL_DELIVERED and both.attention_workers() == ["b", "a"]


def test_an_attention_worker_that_already_passed_the_layer_is_not_waited_for():
    b = _batcher("a", "b", now=0.0)
    for layer in range(2):  # a runs layers 0..1 while b is quiet (its layer 0 waits for b, which is next at layer 0)
        started = b.deliver("a", (layer, True), "a", 3, now=0.01 + layer * 0.003)
        started += b.expire(0.01 + layer * 0.003 + POLICY.window_s)
        assert [s.key[0] for s in started] == [layer]
    # b's layer 0: a is two layers past it (it would come back next step only; layer numbers alone cannot tell two
    # past from two behind on 4 layers, and the batcher counts half the layers as behind).
    (batch,) = b.deliver("b", L0, "b0", 3, now=0.02)
    assert batch.started_by is BatchStart.ALL_DELIVERED


def test_a_batch_with_min_rows_starts_at_once():
    b = _batcher("a", "b", now=0.0)
    (batch,) = b.deliver("a", L0, "a0", POLICY.min_rows, now=0.01)
    assert batch.started_by is BatchStart.MIN_ROWS


def test_modes_are_never_mixed_in_one_batch():
    b = _batcher("a", "b", now=0.0)
    assert b.deliver("a", (0, True), "a0", 3, now=0.01) == []
    started = b.deliver("b", (0, False), "b0", 3, now=0.0101)
    # Both AWs now wait somewhere: each batch has nobody left to wait for, and starts alone.
    assert sorted((s.key, len(s.entries)) for s in started) == [((0, False), 1), ((0, True), 1)]


def test_a_second_call_before_the_reply_is_refused():
    b = _batcher("a", "b", now=0.0)
    b.deliver("a", L0, "a0", 3, now=0.01)
    with pytest.raises(ValueError, match="before the reply"):
        b.deliver("a", L1, "a1", 3, now=0.011)
