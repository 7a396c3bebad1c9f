"""The checks that keep malformed load reports and KV events off the router's and health's state."""

from __future__ import annotations

import math

import pytest

from phalanx._proto import common_pb2
from phalanx.common.errors import InvalidRequestError
from phalanx.common.events import _check_sender, check_kv_event, check_load_report
from phalanx.common.subjects import subject_kind

pytestmark = pytest.mark.unit


def test_a_worker_s_real_load_report_passes():
    check_load_report(common_pb2.LoadReport(worker_id="w1", queue_depth=3, free_blocks=10, total_blocks=64, step_time_ms=12.5))


@pytest.mark.parametrize("fields", [
    {"queue_depth": -1}, {"running_seqs": -5}, {"free_blocks": -1}, {"free_blocks": 65, "total_blocks": 64},
    {"step_time_ms": math.nan}, {"prefill_tokens_per_s": math.inf}, {"decode_tokens_per_s": -0.5},
])
def test_impossible_load_numbers_are_refused_naming_the_field(fields):
    with pytest.raises(InvalidRequestError) as raised:
        check_load_report(common_pb2.LoadReport(worker_id="w1", **fields))
    assert raised.value.violations[0].field in fields


def test_a_kv_event_with_an_empty_block_is_refused():
    check_kv_event(common_pb2.KvEvent(stored=[common_pb2.KvBlockStored(block_hash=1, num_tokens=16)]))
    with pytest.raises(InvalidRequestError):
        check_kv_event(common_pb2.KvEvent(stored=[common_pb2.KvBlockStored(block_hash=1, num_tokens=0)]))


def test_a_message_on_a_worker_s_subject_must_name_that_worker():
    _check_sender(common_pb2.LoadReport(worker_id="w1"), "phalanx.load.w1")
    _check_sender(common_pb2.DegradationState(), "phalanx.degradation")  # no worker_id field: nothing to check
    for claimed in ("", "w2", "w1 "):
        with pytest.raises(InvalidRequestError):
            _check_sender(common_pb2.KvEvent(worker_id=claimed), "phalanx.kv.w1")


def test_subject_kinds_are_bounded_metric_labels():
    assert [subject_kind(s) for s in ("phalanx.kv.w1", "phalanx.load.w-2", "phalanx.health.w", "phalanx.health_report.w")] == [
        "kv", "load", "health", "health_report"]
    assert subject_kind("phalanx.degradation") == "phalanx.degradation" and subject_kind("anything.else") == "other"
