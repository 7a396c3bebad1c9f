"""The checkpoint store's spill outage on its own: reported once, the disk left alone until the retry time, ended by a
spill that works."""

from __future__ import annotations

import pytest

from phalanx.checkpoint_store.spill_outage import SpillOutage

pytestmark = pytest.mark.unit


def test_a_failed_spill_starts_one_outage_and_waits_its_retry_time_before_the_disk_is_tried_again():
    outage = SpillOutage(retry_s=5.0)
    assert not outage.failing and not outage.waiting(100.0)
    assert outage.failed(100.0)  # starts the outage: reported
    assert outage.failing and outage.waiting(104.9) and not outage.waiting(105.0)
    assert not outage.failed(105.0)  # the same outage: not reported again, the next try moves on
    assert outage.waiting(109.9) and not outage.waiting(110.0)
    assert outage.failures == 2


def test_a_spill_that_works_ends_the_outage_once():
    outage = SpillOutage(retry_s=5.0)
    assert not outage.worked()  # no outage to end
    outage.failed(100.0)
    assert outage.worked() and not outage.failing and not outage.waiting(101.0)
    assert not outage.worked()
    assert outage.failures == 1
