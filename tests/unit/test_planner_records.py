"""The planner's etcd values are protobuf JSON like every other etcd value: what the planner writes parses as its
`phalanx.common.v1` message through discovery's helpers, and what it reads comes back unchanged (including the
older snake_case dict values a planner of an earlier version left behind)."""

from __future__ import annotations

import json

import pytest

from phalanx._proto import common_pb2
from phalanx.common.discovery import decode_json, encode_json
from phalanx.planner.connectors import AckRecord, DecisionRecord
from phalanx.planner.decisions import Decision, DecisionReason, Targets

pytestmark = pytest.mark.unit


def test_a_decision_record_is_a_planner_decision_message_and_round_trips() -> None:
    record = DecisionRecord(
        id=12, workers=4, spares=1, reason="replace_dead", issued_at=1_700_000_000.25, deadline=1_700_000_060.25,
        replaces=["w-1", "w-3"], promote="spare-2",
    )
    value = record.to_json()
    message = decode_json(value, common_pb2.PlannerDecision)
    assert (message.id, message.workers, message.spares, message.reason) == (12, 4, 1, "replace_dead")
    assert list(message.replaces) == ["w-1", "w-3"] and message.promote == "spare-2"
    assert DecisionRecord.from_json(value) == record


def test_a_decision_without_replacements_or_promotion_round_trips_with_empty_defaults() -> None:
    decision = Decision(id=3, reason=DecisionReason.SCALE, targets=Targets(workers=2, spares=0), issued_at=100.0, deadline=220.0)
    record = DecisionRecord.of(decision, [])
    back = DecisionRecord.from_json(record.to_json())
    assert back == record
    assert back.replaces == [] and back.promote == ""
    assert back.deadline - back.issued_at == pytest.approx(120.0)


def test_an_ack_record_is_a_planner_ack_message_and_round_trips() -> None:
    ack = AckRecord(id=9, workers=3, at=1_700_000_001.5, orchestrator="phalanx-up:42")
    message = decode_json(ack.to_json(), common_pb2.PlannerAck)
    assert (message.id, message.workers, message.orchestrator) == (9, 3, "phalanx-up:42")
    assert AckRecord.from_json(ack.to_json()) == ack


def test_values_written_as_plain_dicts_by_an_older_planner_still_read() -> None:
    old_decision = {"id": 5, "workers": 2, "spares": 0, "reason": "scale", "issued_at": 1.0, "deadline": 61.0, "replaces": [], "promote": ""}
    assert DecisionRecord.from_json(json.dumps(old_decision).encode()) == DecisionRecord(**old_decision)
    old_ack = {"id": 5, "workers": 2, "at": 3.0, "orchestrator": "x"}
    assert AckRecord.from_json(json.dumps(old_ack).encode()) == AckRecord(**old_ack)
    assert decode_json(json.dumps({"workers": 7, "at": 2.0}), common_pb2.PlannerTarget).workers == 7


def test_large_decision_ids_survive_the_int64_json_string_encoding() -> None:
    record = DecisionRecord(id=2**40 + 1, workers=1, spares=0, reason="scale", issued_at=0.0, deadline=1.0)
    assert DecisionRecord.from_json(encode_json(common_pb2.PlannerDecision(id=record.id, workers=1, reason="scale", deadline=1.0))) == record


def test_a_disaggregated_decision_carries_both_pools_and_its_old_fields_are_the_decode_pools() -> None:
    decision = Decision(id=4, reason=DecisionReason.SCALE, targets=Targets(workers=6, spares=1, prefill=2, prefill_spares=1),
                        issued_at=10.0, deadline=130.0)
    record = DecisionRecord.of(decision, [])
    assert (record.workers, record.spares, record.prefill_workers, record.prefill_spares) == (6, 1, 2, 1) and record.disaggregated
    message = decode_json(record.to_json(), common_pb2.PlannerDecision)
    # An orchestrator that knows no pools reads the routed (decode) workers where it always did.
    assert (message.workers, message.spares) == (6, 1)
    assert [(p.role, p.workers, p.spares) for p in message.pools] == [("prefill", 2, 1), ("decode", 6, 1)]
    assert DecisionRecord.from_json(record.to_json()) == record


def test_an_aggregated_decision_has_no_pools_and_a_prefill_pool_of_zero_is_still_a_pool() -> None:
    aggregated = DecisionRecord(id=1, workers=3, spares=0, reason="scale", issued_at=0.0, deadline=1.0)
    assert not decode_json(aggregated.to_json(), common_pb2.PlannerDecision).pools
    assert DecisionRecord.from_json(aggregated.to_json()).prefill_workers is None
    none_prefilling = DecisionRecord(id=2, workers=3, spares=0, reason="scale", issued_at=0.0, deadline=1.0, prefill_workers=0)
    assert DecisionRecord.from_json(none_prefilling.to_json()).prefill_workers == 0


def test_an_ack_counts_the_prefill_workers_too() -> None:
    ack = AckRecord(id=3, workers=6, at=2.0, orchestrator="kubernetes:ns/phalanx-worker", prefill_workers=2)
    assert decode_json(ack.to_json(), common_pb2.PlannerAck).prefill_workers == 2
    assert AckRecord.from_json(ack.to_json()) == ack
