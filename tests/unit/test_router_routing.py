"""RoutingTable: worker choice by KV overlap against load, and the bookkeeping around it."""

from collections import Counter

import pytest

from phalanx._proto import common_pb2
from phalanx.common.block_hash import prefix_block_hashes
from phalanx.router import routing
from phalanx.router.routing import RUNNING_SEQ_STEPS, RouteDecision, RoutingTable

pytestmark = pytest.mark.unit

PROMPT = list(range(1000, 1000 + 320))  # 20 blocks
FRESH = list(range(5000, 5000 + 320))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def load(worker_id: str, **fields) -> common_pb2.LoadReport:
    defaults = dict(queue_depth=0, running_seqs=0, free_blocks=1000, total_blocks=1000, step_time_ms=20.0, prefill_tokens_per_s=4000.0)
    return common_pb2.LoadReport(worker_id=worker_id, **(defaults | fields))


def make_table(*worker_ids: str, clock: FakeClock | None = None, report: bool = True, **kwargs) -> RoutingTable:
    table = RoutingTable(clock=clock or FakeClock(), **kwargs)
    for worker_id in worker_ids:
        assert table.upsert_worker(worker_id, f"{worker_id}:50051", pid=1) is True
        assert table.load_kv_snapshot(worker_id, 0, []) is False
        if report:
            table.update_load(load(worker_id))
    return table


def hold(table: RoutingTable, worker_id: str, token_ids: list[int], sequence: int = 1) -> None:
    stored = [common_pb2.KvBlockStored(block_hash=h, num_tokens=16) for h in prefix_block_hashes(token_ids, 16)]
    assert table.on_kv_event(common_pb2.KvEvent(worker_id=worker_id, sequence=sequence, stored=stored)) is False


# -- no worker ------------------------------------------------------------------------
def test_route_returns_none_without_workers():
    assert RoutingTable().route(PROMPT) is None


def test_route_returns_none_when_every_worker_is_excluded_or_out_of_routing():
    table = make_table("a", "b", "c")
    table.set_weight("a", 0.0)
    table.update_load(load("b", draining=True))
    assert table.route(PROMPT, exclude=frozenset({"c"})) is None


# -- the cost model -----------------------------------------------------------------------
def test_route_prefers_the_worker_holding_the_prompt_prefix():
    table = make_table("a", "b", "c")
    hold(table, "b", PROMPT[:160])
    hold(table, "c", PROMPT[:64])
    decision = table.route(PROMPT)
    assert decision == RouteDecision("b", 160, pytest.approx(decision.cost_s), 3)
    assert decision.cost_s == pytest.approx((320 - 160) / 4000 + 0.02)


def test_a_much_more_loaded_prefix_holder_loses():
    table = make_table("holder", "idle")
    hold(table, "holder", PROMPT)
    table.update_load(load("holder", queue_depth=20, running_seqs=64))
    assert table.route(PROMPT).worker_id == "idle"
    table.update_load(load("holder", queue_depth=1, running_seqs=8))
    assert table.route(PROMPT).worker_id == "holder"


def test_cost_follows_the_documented_formula():
    table = make_table("w")
    hold(table, "w", PROMPT[:32])
    table.update_load(load("w", queue_depth=3, running_seqs=10, step_time_ms=50.0, prefill_tokens_per_s=8000.0))
    table.note_routed("w", 400)
    table.note_routed("w", 100)
    step = 0.05
    expected = (320 - 32 + 500) / 8000 + (1 + 3 + 2) * step + RUNNING_SEQ_STEPS * 10 * step
    assert table.route(PROMPT).cost_s == pytest.approx(expected)
    table.set_weight("w", 0.5)
    assert table.route(PROMPT).cost_s == pytest.approx(2 * expected)


def test_cached_tokens_leave_the_prompts_last_token_to_compute():
    table = make_table("w")
    hold(table, "w", PROMPT)
    assert table.route(PROMPT).cached_tokens == 320 - 16  # the last block is recomputed anyway
    assert table.route(PROMPT + [7]).cached_tokens == 320


def test_route_hashes_the_prompt_once(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return prefix_block_hashes(*args, **kwargs)

    monkeypatch.setattr(routing, "prefix_block_hashes", counting)
    table = make_table(*(f"w{i}" for i in range(8)))
    hold(table, "w3", PROMPT)
    assert table.route(PROMPT).worker_id == "w3"
    assert len(calls) == 1


def test_a_worker_that_never_reported_uses_default_rates():
    table = make_table("w", report=False, default_prefill_tokens_per_s=1000.0, default_step_time_s=0.1)
    assert table.route(PROMPT).cost_s == pytest.approx(320 / 1000 + 0.1)


def test_zero_rates_in_a_report_read_as_unknown():
    table = make_table("w")
    table.update_load(load("w", step_time_ms=0.0, prefill_tokens_per_s=0.0))
    assert table.route(PROMPT).cost_s == pytest.approx(320 / 4000 + 0.02)


def test_a_worker_that_measured_nothing_is_priced_at_the_fleets_median_rates():
    table = make_table("slow", "slower", "slowest")
    for worker_id, rate, step_ms in (("slow", 400.0, 200.0), ("slower", 200.0, 300.0), ("slowest", 100.0, 500.0)):
        table.update_load(load(worker_id, prefill_tokens_per_s=rate, step_time_ms=step_ms))
    table.upsert_worker("new", "new:50051", pid=1)
    table.load_kv_snapshot("new", 0, [])
    measured = {"slow", "slower", "slowest"}
    assert table.route(PROMPT, exclude=measured).cost_s == pytest.approx(320 / 200.0 + 0.3)
    # A holder of most of the prompt beats it, as it would beat any of its measured peers.
    hold(table, "slower", PROMPT[:304])
    assert table.route(PROMPT).worker_id == "slower"
    # The median follows the fleet: the slowest gone, the newcomer is priced at the other two's.
    table.remove_worker("slowest")
    assert table.route(PROMPT, exclude=measured).cost_s == pytest.approx(320 / 300.0 + 0.25)


# -- health, draining, exclusion ------------------------------------------------------------
def test_weight_zero_takes_a_worker_out_of_routing_and_back():
    table = make_table("a", "b")
    hold(table, "a", PROMPT)
    table.set_weight("a", 0.0)
    assert table.route(PROMPT).worker_id == "b"
    table.set_weight("a", 1.0)
    assert table.route(PROMPT).worker_id == "a"


def test_a_draining_worker_is_not_routed_until_it_reports_otherwise():
    table = make_table("a", "b")
    hold(table, "a", PROMPT)
    table.update_load(load("a", draining=True))
    assert table.route(PROMPT) == RouteDecision("b", 0, pytest.approx(320 / 4000 + 0.02), 1)
    table.update_load(load("a"))
    assert table.route(PROMPT).worker_id == "a"


@pytest.mark.parametrize("health", [common_pb2.WORKER_HEALTH_DRAINING, common_pb2.WORKER_HEALTH_DEAD])
def test_draining_or_dead_health_takes_a_worker_out_of_routing(health):
    table = make_table("a", "b")
    hold(table, "a", PROMPT)
    table.set_weight("a", 1.0, health=health)
    assert table.route(PROMPT).worker_id == "b"


def test_a_suspicious_worker_loses_to_an_equal_healthy_one():
    table = make_table("a", "b")
    table.set_weight("a", 0.5, health=common_pb2.WORKER_HEALTH_SUSPICIOUS)
    assert {table.route(FRESH).worker_id for _ in range(4)} == {"b"}


def test_a_weight_set_before_registration_applies_once_the_worker_registers():
    table = make_table("a")
    table.set_weight("b", 0.0)
    table.upsert_worker("b", "b:1", pid=2)
    assert {w.worker_id: w.routable for w in table.workers()} == {"a": True, "b": False}


@pytest.mark.parametrize(("weight", "clamped"), [(-0.1, 0.0), (1.5, 1.0), (float("nan"), 0.0)])
def test_set_weight_clamps_weights_into_zero_to_one(weight, clamped):
    table = make_table("a")
    table.set_weight("a", weight)
    assert table.workers()[0].weight == clamped
    assert table.workers()[0].routable is (clamped > 0)


def test_exclude_skips_workers_and_candidates_counts_the_rest():
    table = make_table("a", "b", "c")
    hold(table, "a", PROMPT)
    decision = table.route(PROMPT, exclude=frozenset({"a"}))
    assert decision.worker_id in {"b", "c"}
    assert decision.candidates == 2


# -- spreading load ---------------------------------------------------------------------------
def test_a_burst_of_32_requests_spreads_evenly_over_idle_workers():
    table = make_table(*(f"w{i}" for i in range(8)))
    chosen = Counter()
    for i in range(32):
        prompt = [i] * 300
        decision = table.route(prompt)
        table.note_routed(decision.worker_id, len(prompt) - decision.cached_tokens)
        chosen[decision.worker_id] += 1
    assert chosen == {f"w{i}": 4 for i in range(8)}


def test_a_burst_on_one_prefix_stays_with_its_holder_only_while_that_pays_off():
    table = make_table("holder", "a", "b")
    long_prompt = list(range(4000))
    hold(table, "holder", long_prompt)
    chosen = Counter()
    for _ in range(12):
        decision = table.route(long_prompt)
        table.note_routed(decision.worker_id, len(long_prompt) - decision.cached_tokens)
        chosen[decision.worker_id] += 1
    # Cached requests cost the holder a step each; a cold prefill elsewhere costs ~1 s.
    assert chosen["holder"] >= 10
    table.update_load(load("holder", queue_depth=200))
    assert table.route(long_prompt).worker_id in {"a", "b"}


def test_a_load_report_resets_the_routed_since_report_count():
    table = make_table("a", "b")
    for _ in range(3):
        table.note_routed("a", 300)
    assert table.route(FRESH).worker_id == "b"
    table.update_load(load("a"))
    assert {w.worker_id: w.routed_since_report for w in table.workers()} == {"a": 0, "b": 0}


def test_running_sequences_tip_otherwise_equal_workers():
    table = make_table("a", "b")
    table.update_load(load("a", running_seqs=6))
    table.update_load(load("b", running_seqs=2))
    assert {table.route(FRESH).worker_id for _ in range(4)} == {"b"}


def test_ties_between_identical_workers_rotate():
    table = make_table("a", "b", "c")
    assert [table.route(FRESH).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_ties_prefer_the_worker_routed_fewer_times_since_its_report():
    table = make_table("a", "b", default_prefill_tokens_per_s=1e12)
    # Equal cost: b's extra routed request is offset by a's queue (both add one step).
    table.update_load(load("a", queue_depth=1, prefill_tokens_per_s=0.0))
    table.update_load(load("b", prefill_tokens_per_s=0.0))
    table.note_routed("b", 0)
    decisions = {table.route(FRESH).worker_id for _ in range(4)}
    assert decisions == {"a"}


# -- staleness ----------------------------------------------------------------------------------
def test_a_silent_worker_is_penalised_but_stays_routable():
    clock = FakeClock()
    table = make_table("silent", "fresh", clock=clock, load_stale_s=2.0, stale_penalty_s=1.0)
    hold(table, "silent", PROMPT)
    clock.now += 3.0
    table.update_load(load("fresh", queue_depth=4))
    assert table.route(PROMPT).worker_id == "fresh"
    decision = table.route(PROMPT, exclude=frozenset({"fresh"}))
    assert decision.worker_id == "silent"
    assert decision.cost_s == pytest.approx(16 / 4000 + 0.02 + 1.0)


def test_a_worker_that_never_reports_turns_stale_after_load_stale_s():
    clock = FakeClock()
    table = make_table("new", clock=clock, report=False)
    assert table.route(FRESH).cost_s == pytest.approx(320 / 4000 + 0.02)
    clock.now += 2.5
    assert table.route(FRESH).cost_s == pytest.approx(320 / 4000 + 0.02 + 1.0)
    assert table.workers()[0].load_age_s == pytest.approx(2.5)


# -- membership and the KV index ----------------------------------------------------------------
def test_upsert_reports_new_workers_and_restarts_only():
    table = make_table()
    assert table.upsert_worker("w", "w:1", pid=10) is True
    assert table.upsert_worker("w", "w:2", pid=10) is False
    assert table.workers()[0].address == "w:2"
    assert table.upsert_worker("w", "w:2", pid=11) is True


def test_a_restarted_worker_loses_its_indexed_blocks_until_its_snapshot():
    table = make_table("w", "other")
    hold(table, "w", PROMPT)
    assert table.upsert_worker("w", "w:50051", pid=2) is True
    assert table.route(PROMPT).cached_tokens == 0
    assert table.load_kv_snapshot("w", 3, prefix_block_hashes(PROMPT, 16)) is False
    assert table.route(PROMPT).worker_id == "w"


def test_kv_events_before_the_first_snapshot_wait_for_it():
    table = RoutingTable(clock=FakeClock())
    table.upsert_worker("w", "w:1", pid=1)
    hashes = prefix_block_hashes(PROMPT, 16)
    event = common_pb2.KvEvent(worker_id="w", sequence=8, stored=[common_pb2.KvBlockStored(block_hash=h) for h in hashes[8:]])
    assert table.on_kv_event(event) is False  # the snapshot was asked for by upsert_worker already
    assert table.load_kv_snapshot("w", 7, hashes[:8]) is False
    assert table.route(PROMPT).cached_tokens == 320 - 16


def test_remove_worker_takes_it_out_of_routing_and_the_index():
    table = make_table("a", "b")
    hold(table, "a", PROMPT)
    table.remove_worker("a")
    assert table.route(PROMPT) == RouteDecision("b", 0, pytest.approx(320 / 4000 + 0.02), 1)
    assert table.index.distinct_blocks() == 0
    table.remove_worker("a")  # idempotent


def test_load_reports_and_routed_notes_of_unknown_workers_are_ignored():
    table = make_table("a")
    table.update_load(load("ghost"))
    table.note_routed("ghost", 10)
    assert [w.worker_id for w in table.workers()] == ["a"]


def test_workers_view_shows_load_weight_health_and_indexed_blocks():
    clock = FakeClock()
    table = make_table("a", "b", "c", clock=clock)
    hold(table, "a", PROMPT)
    table.update_load(load("a", queue_depth=2, running_seqs=3, free_blocks=10, total_blocks=99, step_time_ms=12.5))
    table.set_weight("b", 0.5)
    table.update_load(load("c", draining=True))
    clock.now += 0.25
    a, b, c = table.workers()
    assert (a.worker_id, a.address, a.pid, a.queue_depth, a.running_seqs, a.free_blocks, a.total_blocks) == ("a", "a:50051", 1, 2, 3, 10, 99)
    assert (a.step_time_ms, a.indexed_blocks, a.load_age_s, a.health, a.weight) == (
        12.5, 20, pytest.approx(0.25), common_pb2.WORKER_HEALTH_HEALTHY, 1.0,
    )
    assert (b.health, b.weight, b.routable) == (common_pb2.WORKER_HEALTH_SUSPICIOUS, 0.5, True)
    assert (c.health, c.draining, c.routable) == (common_pb2.WORKER_HEALTH_DRAINING, True, False)


# -- hot spares ----------------------------------------------------------------------------
def test_a_hot_spare_is_never_routed_to_until_promoted():
    table = RoutingTable(clock=FakeClock())
    table.set_spare("spare", True)  # marked before it registers, as the orchestrator does
    for worker_id in ("a", "spare"):
        table.upsert_worker(worker_id, f"{worker_id}:1", pid=1)
        table.load_kv_snapshot(worker_id, 0, [])
        table.update_load(load(worker_id))
    hold(table, "spare", PROMPT)  # even holding the whole prompt
    table.update_load(load("a", queue_depth=50))
    assert {table.route(PROMPT).worker_id for _ in range(10)} == {"a"}
    assert {w.worker_id: (w.spare, w.routable) for w in table.workers()} == {"a": (False, True), "spare": (True, False)}

    table.set_weight("a", 0.0, health=common_pb2.WORKER_HEALTH_DEAD)
    assert table.route(PROMPT) is None  # a dead worker and an unpromoted spare: nobody
    table.set_spare("spare", False)
    assert table.route(PROMPT).worker_id == "spare"
    assert {w.worker_id: w.routable for w in table.workers()} == {"a": False, "spare": True}


# -- joint media routing's terms ------------------------------------------------------------
def test_estimates_give_each_workers_wait_rate_and_cached_prefix():
    table = make_table("a", "b")
    table.update_load(load("b", queue_depth=3))
    hold(table, "a", PROMPT[:64])
    by_id = {e.worker_id: e for e in table.estimates(PROMPT[:100])}
    assert by_id["a"].cached_tokens == 64 and by_id["b"].cached_tokens == 0
    assert by_id["a"].s_per_token == pytest.approx(1 / 4000)
    assert by_id["b"].wait_s == pytest.approx(by_id["a"].wait_s + 3 * 0.02)
    assert by_id["a"].step_s == pytest.approx(0.02)
    decision = table.route(PROMPT[:100])
    assert decision is not None and decision.cost_s == pytest.approx(by_id["a"].wait_s + 36 / 4000)
    table.set_weight("b", 0.5)
    assert {e.worker_id: e for e in table.estimates(PROMPT[:100])}["b"].s_per_token == pytest.approx(2 / 4000)
    assert [e.worker_id for e in table.estimates(PROMPT, exclude={"a"})] == ["b"]


def test_route_takes_the_preferred_worker_while_it_is_routable():
    table = make_table("a", "b")
    hold(table, "a", PROMPT)
    decision = table.route(PROMPT, prefer="b")
    assert decision is not None and decision.worker_id == "b" and decision.cached_tokens == 0
    table.update_load(load("b", draining=True))
    decision = table.route(PROMPT, prefer="b")
    assert decision is not None and decision.worker_id == "a"
    decision = table.route(PROMPT, prefer="a", exclude=frozenset({"a"}))
    assert decision is None


# -- worker roles (disaggregated serving) ------------------------------------------------
def test_prefill_workers_take_no_new_requests_and_route_only_prefills():
    table = make_table("a")
    assert table.upsert_worker("p", "p:50051", pid=1, role="prefill") is True
    assert table.load_kv_snapshot("p", 0, []) is False
    table.update_load(load("p"))
    hold(table, "p", PROMPT)
    assert table.has_prefill_workers()
    assert table.route(PROMPT).worker_id == "a"  # the prefix holder is a prefill worker: not routed to
    assert table.route(PROMPT, exclude=frozenset({"a"})) is None
    decision = table.route(PROMPT, prefill=True)
    assert decision is not None and decision.worker_id == "p" and decision.cached_tokens == 304
    assert [e.worker_id for e in table.estimates(PROMPT, prefill=True)] == ["p"]
    assert [e.worker_id for e in table.estimates(PROMPT)] == ["a"]
    views = {v.worker_id: v for v in table.workers()}
    assert views["p"].role == "prefill" and views["p"].routable and views["a"].role == ""


def test_a_decode_worker_is_routed_like_any_other():
    table = RoutingTable(clock=FakeClock())
    table.upsert_worker("d", "d:50051", pid=1, role="decode")
    assert table.route(PROMPT).worker_id == "d" and not table.has_prefill_workers()
