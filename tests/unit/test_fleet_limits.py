"""Tenant limits held across the router fleet: FleetUsage and the ledger with other routers' reports (pure, a fake clock)."""

from __future__ import annotations

import math

import pytest

from phalanx._proto import common_pb2
from phalanx.common.errors import InvalidRequestError, TenantLimitError
from phalanx.common.events import check_tenant_usage_report
from phalanx.router.admission import Admission
from phalanx.router.config import RouterConfig, TenantPolicy
from phalanx.router.limits import EXPIRY_INTERVALS, FleetUsage, Limit, TenantLedger, TenantLimits, TenantUsage, UsageReport

pytestmark = pytest.mark.unit

INTERVAL = 0.2


def report(router_id: str, *, incarnation: str = "i1", **tenants: TenantUsage) -> UsageReport:
    return UsageReport(router_id, incarnation, INTERVAL, tenants)


def ledger(**limits: TenantLimits) -> TenantLedger:
    return TenantLedger(limits, fleet=FleetUsage("me"))


def test_other_routers_streams_count_against_the_tenants_max_streams():
    book = ledger(t=TenantLimits(max_streams=3))
    book.open("t", "r1", 1, 0.0)
    book.on_peer_report(report("b", t=TenantUsage(streams=1)), 0.0)
    book.check("t", 1, 0.0)  # 1 here + 1 at b: a third may start
    book.on_peer_report(report("c", t=TenantUsage(streams=1)), 0.0)
    with pytest.raises(TenantLimitError) as refused:
        book.check("t", 1, 0.01)
    assert refused.value.limit == Limit.STREAMS
    assert "has 3 streams in flight (2 at other routers)" in str(refused.value) and "max_streams 3" in str(refused.value)
    # b's next report says its stream ended: the slot is free again.
    book.on_peer_report(report("b"), 0.05)
    book.check("t", 1, 0.05)


def test_a_silent_router_s_streams_expire_after_a_few_of_its_intervals():
    book = ledger(t=TenantLimits(max_streams=2))
    book.on_peer_report(report("b", t=TenantUsage(streams=2)), 0.0)
    with pytest.raises(TenantLimitError):
        book.check("t", 1, EXPIRY_INTERVALS * INTERVAL - 0.01)
    book.check("t", 1, EXPIRY_INTERVALS * INTERVAL + 0.01)  # b died: its share is back
    assert book.fleet is not None and book.fleet.live(EXPIRY_INTERVALS * INTERVAL + 0.01) == []


def test_own_reports_are_ignored_and_other_tenants_do_not_count():
    book = ledger(t=TenantLimits(max_streams=1))
    book.on_peer_report(report("me", t=TenantUsage(streams=5)), 0.0)
    book.on_peer_report(report("b", other=TenantUsage(streams=5)), 0.0)
    book.check("t", 1, 0.0)


def test_tokens_other_routers_charge_come_out_of_this_routers_bucket_once():
    book = ledger(t=TenantLimits(tokens_per_minute=60))
    assert book.on_peer_report(report("b", t=TenantUsage(tokens_charged=20, tokens_recent=20)), 0.0) == {"t": 20.0}
    assert book.on_peer_report(report("b", t=TenantUsage(tokens_charged=50, tokens_recent=50)), 0.0) == {"t": 30.0}
    assert book.on_peer_report(report("b", t=TenantUsage(tokens_charged=50, tokens_recent=50)), 0.0) == {}  # nothing new
    book.check("t", 10, 0.0)  # 60 - 50 = 10 left
    with pytest.raises(TenantLimitError) as refused:
        book.check("t", 11, 0.0)
    assert refused.value.limit == Limit.TOKENS and refused.value.retry_after_s == pytest.approx(1.0)


def test_a_lost_report_costs_nothing_the_next_total_carries_it():
    book = ledger(t=TenantLimits(tokens_per_minute=60))
    book.on_peer_report(report("b", t=TenantUsage(tokens_charged=10, tokens_recent=10)), 0.0)
    # the report with 30 was lost; 45 comes
    book.on_peer_report(report("b", t=TenantUsage(tokens_charged=45, tokens_recent=45)), 0.0)
    book.check("t", 15, 0.0)
    with pytest.raises(TenantLimitError):
        book.check("t", 16, 0.0)


def test_a_router_seen_first_brings_its_recent_tokens_not_its_history():
    """This router started after b charged 100 000 tokens over an hour; of them, 30 are not refilled yet: only those count.
    A new incarnation of b (it restarted, totals from 0) is seen first again."""
    book = ledger(t=TenantLimits(tokens_per_minute=60))
    book.on_peer_report(report("b", t=TenantUsage(tokens_charged=100_000, tokens_recent=30)), 0.0)
    book.check("t", 30, 0.0)
    with pytest.raises(TenantLimitError):
        book.check("t", 31, 0.0)
    book.on_peer_report(report("b", incarnation="i2", t=TenantUsage(tokens_charged=5, tokens_recent=5)), 30.0)
    book.check("t", 55, 30.0)  # 30 refilled in 30 s to full 60, less b's 5
    with pytest.raises(TenantLimitError):
        book.check("t", 56, 30.0)
    book.on_peer_report(report("b", incarnation="i2", t=TenantUsage(tokens_charged=9, tokens_recent=9)), 30.0)
    with pytest.raises(TenantLimitError):
        book.check("t", 52, 30.0)  # 4 more


def test_a_router_back_after_a_hiccup_charges_only_what_is_new():
    fleet = FleetUsage("me")
    assert fleet.on_report(report("b", t=TenantUsage(streams=1, tokens_charged=40, tokens_recent=40)), 0.0) == {"t": 40.0}
    assert fleet.streams("t", 5.0) == 0  # expired
    assert fleet.on_report(report("b", t=TenantUsage(streams=1, tokens_charged=42, tokens_recent=20)), 5.0) == {"t": 2.0}
    assert fleet.streams("t", 5.0) == 1
    fleet.prune(500.0)
    assert fleet.on_report(report("b", t=TenantUsage(tokens_charged=50, tokens_recent=0)), 500.0) == {}  # forgotten: first sight


def test_usage_reports_own_streams_queued_requests_and_tokens():
    book = ledger(t=TenantLimits(tokens_per_minute=60), u=TenantLimits())
    book.open("t", "r1", 20, 0.0)
    book.charge("r1", 0, 0.0)
    book.charge("r1", 4, 0.0)
    book.hold("u", "r2", from_index=3)
    book.charge("r2", 3, 0.0)
    book.on_peer_report(report("b", t=TenantUsage(streams=4, tokens_charged=100, tokens_recent=10)), 0.0)
    assert book.usage(0.0, {})["t"] == TenantUsage(streams=1, tokens_charged=25, tokens_recent=25.0)  # 20 prompt + 5 tokens
    usage = book.usage(30.0, {"t": 2})
    # 30 s refilled half a minute (30 tokens) of its own 25: nothing recent. The other router's 100 are not its own.
    assert usage["t"] == TenantUsage(streams=3, tokens_charged=25, tokens_recent=0.0)
    assert usage["u"] == TenantUsage(streams=1, tokens_charged=1, tokens_recent=0.0)  # no tokens_per_minute: no bucket


def test_without_a_fleet_each_router_holds_its_limits_alone():
    book = TenantLedger({"t": TenantLimits(max_streams=1)})
    book.on_peer_report(report("b", t=TenantUsage(streams=1)), 0.0)
    book.check("t", 1, 0.0)


async def test_admission_counts_peers_and_reports_its_queue():
    config = RouterConfig(tenants={"default": TenantPolicy(), "t": TenantPolicy(max_streams=2)})
    now = [0.0]
    admission = Admission(config.tenants, {}, clock=lambda: now[0], fleet=FleetUsage("me"))
    admitted: list[int] = []
    admission.on_admitted = lambda: admitted.append(1)
    await admission.enter("t", "r1", 3)
    assert admitted == [1]  # the router reports early after a new stream
    admission.on_peer_report(report("b", t=TenantUsage(streams=1)))
    with pytest.raises(TenantLimitError):
        await admission.enter("t", "r2", 3)
    admission.hold("t", "r3")  # a resume is never refused, even over the fleet's limit
    assert admission.usage()["t"].streams == 2
    admission.leave("r3")
    now[0] = 10.0
    await admission.enter("t", "r4", 3)  # b went silent
    assert RouterConfig().tenant_usage_interval_s == pytest.approx(0.2)


def test_a_real_usage_report_passes_the_bus_check():
    check_tenant_usage_report(common_pb2.TenantUsageReport(
        router_id="r-1", incarnation="x", interval_s=0.2,
        tenants=[common_pb2.TenantUsage(tenant="t", streams=2, tokens_charged=10, tokens_recent=4.5)],
    ))


@pytest.mark.parametrize(("fields", "field"), [
    ({"router_id": "a.b"}, "router_id"), ({"router_id": ""}, "router_id"), ({"incarnation": ""}, "incarnation"),
    ({"interval_s": 0}, "interval_s"), ({"interval_s": math.nan}, "interval_s"), ({"interval_s": 3600}, "interval_s"),
    ({"tenants": [common_pb2.TenantUsage(tenant="")]}, "tenants[0].tenant"),
    ({"tenants": [common_pb2.TenantUsage(tenant="t", streams=-1)]}, "tenants[0].streams"),
    ({"tenants": [common_pb2.TenantUsage(tenant="t", tokens_recent=math.inf)]}, "tenants[0].tokens_recent"),
])
def test_impossible_usage_reports_are_refused_naming_the_field(fields, field):
    message = common_pb2.TenantUsageReport(router_id="r1", incarnation="x", interval_s=0.2)
    for name, value in fields.items():
        if name == "tenants":
            message.tenants.extend(value)
        else:
            setattr(message, name, value)
    with pytest.raises(InvalidRequestError) as raised:
        check_tenant_usage_report(message)
    assert raised.value.violations[0].field == field
