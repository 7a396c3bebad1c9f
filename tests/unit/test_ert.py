"""Expert routing table: placement over expert workers, takeover on loss, joins, and its etcd encoding."""

from collections import Counter

import pytest

from phalanx._proto import expert_pb2
from phalanx.common.discovery import decode_json, encode_json
from phalanx.ert_manager.table import (
    ErtError,
    ErtManager,
    ExpertRole,
    ExpertRoutingTable,
    ExpertWorkerJoined,
    ExpertWorkerLost,
    ExpertWorkerRef,
    NoExpertHostError,
    place,
)

pytestmark = pytest.mark.unit

LAYERS, EXPERTS = 4, 8


def _ref(i: int) -> ExpertWorkerRef:
    return ExpertWorkerRef(f"ew-{i}", f"127.0.0.1:{5000 + i}", f"expert-ew-{i}")


def _manager(workers: int, copies: int) -> ErtManager:
    manager = ErtManager("phalanx-tiny-moe", LAYERS, EXPERTS)
    for i, hosted in enumerate(place(LAYERS, EXPERTS, workers, copies)):
        manager.apply(ExpertWorkerJoined(_ref(i), tuple(hosted)))
    return manager


def test_placement_hosts_every_expert_once_per_copy_on_distinct_workers():
    hosted = place(LAYERS, EXPERTS, 3, copies=2)
    holders: dict[tuple[int, int], list[int]] = {}
    for worker, experts in enumerate(hosted):
        for h in experts:
            holders.setdefault(h.key, []).append(worker)
    assert len(holders) == LAYERS * EXPERTS
    assert all(len(ws) == 2 and len(set(ws)) == 2 for ws in holders.values())
    primaries = Counter(w for w, experts in enumerate(hosted) for h in experts if h.role is ExpertRole.PRIMARY)
    assert max(primaries.values()) - min(primaries.values()) <= 1
    # Consecutive experts of a layer go to different workers: a layer's load spreads.
    assert {w for w, experts in enumerate(hosted) for h in experts if h.layer == 0 and h.expert in (0, 1) and h.role is ExpertRole.PRIMARY} == {0, 1}


@pytest.mark.parametrize(("workers", "copies"), [(0, 1), (2, 3), (2, 0)])
def test_placement_refuses_more_copies_than_workers(workers, copies):
    with pytest.raises(ErtError):
        place(LAYERS, EXPERTS, workers, copies)


def test_table_of_a_full_placement_is_complete_and_versioned_once_per_change():
    manager = _manager(3, 2)
    table = manager.table
    assert table.complete
    assert table.version == 3  # one bump per join
    assert table.resolve(0, 0) == "ew-0"
    assert table.resolve(0, 0, exclude={"ew-0"}) == "ew-1"
    assert manager.apply(ExpertWorkerJoined(_ref(0), tuple(place(LAYERS, EXPERTS, 3, 2)[0]))) is None  # same registration again


def test_losing_a_primary_promotes_its_shadow_and_drops_the_dead_worker_everywhere():
    manager = _manager(3, 2)
    before = manager.table
    after = manager.apply(ExpertWorkerLost("ew-0"))
    assert after is not None and after.version == before.version + 1
    assert after.complete
    assert "ew-0" not in after.workers
    assert all("ew-0" not in location.hosts for location in after.locations.values())
    for key in before.experts_of("ew-0"):
        assert after.locations[key].primary == before.locations[key].shadows[0]
    # Experts whose primary lived keep it: no traffic moves for nothing.
    for key, location in before.locations.items():
        if location.primary != "ew-0":
            assert after.locations[key].primary == location.primary
    assert manager.apply(ExpertWorkerLost("ew-0")) is None


def test_losing_every_copy_leaves_the_table_incomplete_until_a_replacement_joins():
    manager = _manager(2, 1)
    table = manager.apply(ExpertWorkerLost("ew-1"))
    assert table is not None and not table.complete
    lost = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS) if (layer, e) not in table.locations]
    with pytest.raises(NoExpertHostError):
        table.resolve(*lost[0])
    replacement = ExpertWorkerRef("ew-9", "127.0.0.1:5009", "expert-ew-9")
    table = manager.apply(ExpertWorkerJoined(replacement, tuple(place(LAYERS, EXPERTS, 2, 1)[1])))
    assert table is not None and table.complete
    assert table.resolve(*lost[0]) == "ew-9"


def test_a_joining_worker_becomes_a_shadow_behind_live_primaries():
    manager = _manager(2, 1)
    everything = tuple(h for hosted in place(LAYERS, EXPERTS, 1, 1) for h in hosted)
    table = manager.apply(ExpertWorkerJoined(_ref(7), everything))
    assert table is not None
    assert all(location.hosts[-1] == "ew-7" and location.primary != "ew-7" for location in table.locations.values())


def test_hosting_experts_outside_the_model_is_refused():
    manager = ErtManager("m", 1, 2)
    with pytest.raises(ErtError):
        manager.apply(ExpertWorkerJoined(_ref(0), tuple(place(2, 2, 1, 1)[0])))


def test_the_table_round_trips_through_its_etcd_json():
    table = _manager(3, 2).apply(ExpertWorkerLost("ew-2"))
    assert table is not None
    decoded = ExpertRoutingTable.from_proto(decode_json(encode_json(table.to_proto()), expert_pb2.ExpertRoutingTable))
    assert decoded == table


def test_primaries_follow_the_placement_whatever_order_the_workers_join_in():
    manager = ErtManager("phalanx-tiny-moe", LAYERS, EXPERTS)
    hosted = place(LAYERS, EXPERTS, 3, 2)
    for i in (2, 0, 1):
        manager.apply(ExpertWorkerJoined(_ref(i), tuple(hosted[i])))
    for i, experts in enumerate(hosted):
        assert manager.table.experts_of(f"ew-{i}") == [h.key for h in experts if h.role is ExpertRole.PRIMARY]


def test_a_replacement_in_a_lost_slot_takes_its_primaries_back():
    manager = _manager(3, 2)
    before = manager.table
    manager.apply(ExpertWorkerLost("ew-0"))
    replacement = ExpertWorkerRef("ew-0b", "127.0.0.1:5100", "expert-ew-0b")
    after = manager.apply(ExpertWorkerJoined(replacement, tuple(place(LAYERS, EXPERTS, 3, 2)[0])))
    assert after is not None and after.experts_of("ew-0b") == before.experts_of("ew-0")


def test_replicas_are_all_active_and_a_lost_one_spreads_its_experts_over_the_rest():
    manager = ErtManager("phalanx-tiny-moe", LAYERS, EXPERTS)
    for i, hosted in enumerate(place(LAYERS, EXPERTS, 3, 3, replicas=True)):
        assert {h.role for h in hosted} == {ExpertRole.REPLICA}
        manager.apply(ExpertWorkerJoined(_ref(i), tuple(hosted)))
    table = manager.table
    assert table.complete and all(location.replicated for location in table.locations.values())
    keys = [(layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)]
    load = Counter(table.resolve(*key) for key in keys)
    # Every replica computes its share (no idle standby), within one of even.
    assert set(load) == {"ew-0", "ew-1", "ew-2"} and max(load.values()) - min(load.values()) <= 1
    # An AW that found ew-1 dead spreads ew-1's experts over both others, and moves nothing to a dead host.
    after = Counter(table.resolve(*key, exclude={"ew-1"}) for key in keys)
    assert set(after) == {"ew-0", "ew-2"} and max(after.values()) - min(after.values()) <= 1
    # The manager's table after the loss says the same, and survives its etcd encoding.
    lost = manager.apply(ExpertWorkerLost("ew-1"))
    assert lost is not None
    decoded = ExpertRoutingTable.from_proto(decode_json(encode_json(lost.to_proto()), expert_pb2.ExpertRoutingTable))
    assert decoded == lost and Counter(decoded.resolve(*key) for key in keys) == after


def test_shadow_placement_is_not_replicated():
    table = _manager(3, 2).table
    assert not any(location.replicated for location in table.locations.values())
