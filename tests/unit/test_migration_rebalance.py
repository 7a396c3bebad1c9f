"""Rebalancing onto new capacity: which moves the policy plans (phalanx.migration.rebalance_policy) and which requests a
worker parks for one (phalanx.worker.engine.pick_to_park), on a simulated engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_simulated_engine import sim_engine

from phalanx.migration.rebalance_policy import Move, RebalancePolicy, RebalanceSettings, WorkerLoad
from phalanx.model.sampling import SamplingParams
from phalanx.worker.engine import EngineRequest, ParkPick
from phalanx.worker.sequence import FinishReason
from phalanx.worker.simulated import default_profile_path

pytestmark = pytest.mark.unit

ITL = 0.5  # the ITL target in these cases: a worker stepping slower is loaded


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(clock: Clock, **settings) -> RebalancePolicy:
    return RebalancePolicy(RebalanceSettings(itl_target_s=ITL, **settings), clock=clock)


def busy(worker_id: str, running: int, queued: int = 0, step: float = 0.7) -> WorkerLoad:
    return WorkerLoad(worker_id, running=running, queued=queued, step_time_s=step, routable_since=float("-inf"))


def new(worker_id: str, at: float, running: int = 0, step: float = 0.0, **kw) -> WorkerLoad:
    return WorkerLoad(worker_id, running=running, queued=0, step_time_s=step, routable_since=at, **kw)


def test_a_new_worker_takes_requests_from_the_loaded_ones_until_it_holds_no_more_than_they_do() -> None:
    clock = Clock()
    moves = policy(clock).plan([busy("a", 7), busy("b", 6), busy("c", 6), new("n", at=99.0)])
    # a: 7 vs 0 -> 3 (a 4, n 3); b: 6 vs 3 -> 1 (b 5, n 4); then n has taken its 4 of the round, and c keeps its 6.
    assert moves == [Move("a", "n", 3), Move("b", "n", 1)]
    # With a larger bound c gives one too; the target never ends up above a source.
    assert policy(clock, max_moves_per_worker=8).plan([busy("a", 7), busy("b", 6), busy("c", 6), new("n", at=99.0)]) == [
        Move("a", "n", 3), Move("b", "n", 1), Move("c", "n", 1)
    ]


def test_moves_per_worker_are_bounded_and_spread_over_several_new_workers() -> None:
    clock = Clock()
    moves = policy(clock, max_moves_per_worker=2).plan([busy("a", 12), new("n1", at=99.0), new("n2", at=98.0)])
    assert moves == [Move("a", "n1", 2)]  # at most 2 leave a per round, to the lightest target (ties by id)
    moves = policy(clock, max_moves_per_worker=8).plan([busy("a", 12), new("n1", at=99.0), new("n2", at=98.0)])
    assert moves == [Move("a", "n1", 6), Move("a", "n2", 2)]


def test_nothing_moves_without_a_loaded_source_or_onto_a_loaded_old_or_unroutable_worker() -> None:
    clock = Clock()
    p = policy(clock)
    # Within the ITL target with nothing queued: busy is not loaded.
    assert p.plan([busy("a", 6, step=0.4), new("n", at=99.0)]) == []
    # Requests queued make a worker loaded whatever its step time.
    assert p.plan([busy("a", 4, queued=2, step=0.1), new("n", at=99.0)]) == [Move("a", "n", 3)]
    # An old worker (routable for longer than new_capacity_s) is no target; nor a draining one, a spare, a loaded one.
    assert p.plan([busy("a", 8), new("old", at=clock.now - 16.0)]) == []
    assert p.plan([busy("a", 8), new("d", at=99.0, draining=True)]) == []
    assert p.plan([busy("a", 8), new("s", at=99.0, spare=True)]) == []
    assert p.plan([busy("a", 8), new("slow", at=99.0, running=1, step=0.45)]) == []  # over target_load x ITL
    # new_capacity_s 0: any worker light enough is a target.
    assert policy(clock, new_capacity_s=0).plan([busy("a", 8), new("old", at=0.0)]) == [Move("a", "old", 4)]
    # A source needs at least two requests more than the target: no ping-pong of one request.
    assert p.plan([busy("a", 3), new("n", at=99.0, running=2)]) == []


def test_cooldowns_and_request_memory() -> None:
    clock = Clock()
    p = policy(clock, cooldown_s=3.0, request_memory_s=30.0)
    fleet = [busy("a", 8), busy("b", 8), new("n", at=99.0)]
    moves = p.plan(fleet)
    assert moves == [Move("a", "n", 4)]  # n took its 4 of the round from a
    p.started(moves)
    p.moved(["r1", "r2"])
    # Within the cool-down neither the source nor the target takes part again; b and another new worker may.
    clock.now += 1.0
    assert p.plan([busy("a", 8), busy("b", 8), new("n", at=99.0), new("m", at=100.5)]) == [Move("b", "m", 4)]
    assert p.plan([busy("a", 8), new("n", at=99.0)]) == []
    assert p.recently_moved() == {"r1", "r2"}
    clock.now += 3.0
    assert p.plan([busy("a", 8), new("n", at=99.0)]) == [Move("a", "n", 4)]
    clock.now += 30.0
    assert p.recently_moved() == frozenset()


def test_capacity_counts_as_new_only_when_it_comes_under_load() -> None:
    p = policy(Clock())
    assert p.under_load([busy("a", 6), new("n", at=0.0)])
    assert p.under_load([busy("a", 1, queued=1, step=0.01)])
    # A fleet starting, or growing ahead of its load: routing fills the newcomer.
    assert not p.under_load([busy("a", 3, step=0.3), new("n", at=0.0)])
    # A draining worker's load or a spare's is not the fleet's.
    assert not p.under_load([replace(busy("a", 8), draining=True), replace(busy("s", 8), spare=True), new("n", at=0.0)])


def test_capacity_that_came_shortly_before_the_load_reports_show_the_load_is_new_capacity() -> None:
    # A burst's first steps are light, and a worker's reported step time (an average over steps) reaches the ITL target
    # a second or more after its real steps did: a worker that registered in that second came under load all the same.
    clock = Clock()
    p = policy(clock, arrival_window_s=5.0)

    def fleet(step: float) -> list[WorkerLoad]:
        return [busy("a", 6, step=step), new("n", at=p.new_since("n"))]

    p.arrived("n", fleet(step=0.3))  # a steps in 0.7 s, but its report still averages 0.3: not loaded yet
    assert p.new_since("n") == float("-inf") and p.plan(fleet(step=0.3)) == []
    clock.now += 1.0
    p.observe(fleet(step=0.7))  # the report shows the load: n, routable since 100.0, is new capacity
    assert p.new_since("n") == 100.0
    assert p.plan(fleet(step=0.7)) == [Move("a", "n", 3)]
    # Capacity that came longer than the window before any load (a fleet starting, well ahead of its load) is not.
    p.arrived("m", [busy("a", 1, step=0.1)])
    clock.now += 5.5
    p.observe([busy("a", 6)])
    assert p.new_since("m") == float("-inf")
    # Capacity that comes while a worker is loaded is new at once; a worker that left is forgotten.
    p.arrived("k", [busy("a", 6)])
    assert p.new_since("k") == clock.now
    p.left("k")
    assert p.new_since("k") == float("-inf")
    # Window 0: only capacity that comes while a report shows a worker loaded.
    strict = policy(clock, arrival_window_s=0.0)
    strict.arrived("n", [busy("a", 6, step=0.3)])
    clock.now += 0.1
    strict.observe([busy("a", 6)])
    assert strict.new_since("n") == float("-inf")


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        RebalanceSettings(itl_target_s=0)
    with pytest.raises(ValueError):
        RebalanceSettings(itl_target_s=1, max_moves_per_worker=0)
    with pytest.raises(ValueError):
        RebalanceSettings(itl_target_s=1, target_load=1.5)
    with pytest.raises(ValueError):
        RebalanceSettings(itl_target_s=1, arrival_window_s=-1)


# -- which requests the worker parks ------------------------------------------------------------------------
def test_a_rebalance_parks_queued_requests_first_then_the_longest_to_go_never_excluded_or_nearly_done() -> None:
    engine = sim_engine(default_profile_path(), max_num_seqs=3)
    lengths = {"short": 6, "long": 40, "mid": 20}
    for request_id, n in lengths.items():
        engine.add_request(EngineRequest(list(range(30, 60)), SamplingParams(max_tokens=n, ignore_eos=True), request_id))
    for _ in range(4):
        engine.step()
    engine.add_request(EngineRequest(list(range(70, 90)), SamplingParams(max_tokens=30, ignore_eos=True), "queued"))
    assert [s.request_id for s in engine.waiting] == ["queued"]  # max_num_seqs 3: it waits for a slot
    events = engine.park(None, ttl_s=5.0, pick=ParkPick(limit=3, exclude=frozenset({"long"}), min_remaining_tokens=4))
    # queued first; "long" was moved recently; "short" has 6 - 4 = 2 tokens to go, under 4.
    assert [e.request_id for e in events] == ["queued", "mid"]
    assert all(e.finish_reason is FinishReason.HANDED_BACK and e.handoff is not None for e in events)
    assert set(engine.by_id) == {"short", "long"} and "mid" in engine.parked and "queued" not in engine.parked  # no KV yet
    # No exclusions: the one with the most tokens to go.
    assert [e.request_id for e in engine.park(None, ttl_s=5.0, pick=ParkPick(limit=1))] == ["long"]
    assert set(engine.by_id) == {"short"}
