"""The crash attribution of the poison-request quarantine: events in, decisions out."""

import pytest

from phalanx.router.crashes import Crashed, CrashPolicy, Held, Move, Placed, Placing, Quarantine, Released, Streamed

pytestmark = pytest.mark.unit


def crash(policy: CrashPolicy, worker_id: str, *request_ids: str, at: float = 0.0) -> dict[str, tuple]:
    """Every listed request's stream from `worker_id` breaks, in order; the effects by request."""
    return {r: policy.on(Crashed(r, worker_id, at)) for r in request_ids}


def hold(policy: CrashPolicy, worker_id: str, *request_ids: str) -> None:
    for r in request_ids:
        policy.on(Held(r, worker_id))


def test_the_single_common_suspect_of_k_crashes_is_quarantined_and_its_batch_mates_are_not():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "poison", "a", "b")
    hold(policy, "w2", "c", "d")
    assert crash(policy, "w1", "a", "poison", "b") == {"a": (), "poison": (), "b": ()}
    for r in ("poison", "a", "b"):
        policy.on(Placed(r, {"poison": "w2", "a": "w3", "b": "w4"}[r], at=0.0))
        hold(policy, {"poison": "w2", "a": "w3", "b": "w4"}[r], r)
    effects = crash(policy, "w2", "c", "poison", "d")
    assert effects["poison"] == (Quarantine("poison", 2),)
    assert effects["c"] == effects["d"] == ()
    assert policy.crashes_seen("c") == 1


def test_a_request_that_shared_every_crash_with_another_is_not_blamed():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "poison", "good")
    crash(policy, "w1", "poison", "good")
    hold(policy, "w2", "poison", "good")  # both ended up on w2 (no scattering was possible)
    effects = crash(policy, "w2", "good", "poison")
    assert effects == {"good": (), "poison": ()}
    hold(policy, "w3", "poison")
    hold(policy, "w4", "good")
    assert crash(policy, "w3", "poison") == {"poison": (Quarantine("poison", 3),)}


def test_a_request_alone_on_a_worker_is_quarantined_after_k_crashes_only():
    policy = CrashPolicy(after_crashes=3, probation_s=1.0)
    for n, worker in enumerate(("w1", "w2", "w3"), start=1):
        hold(policy, worker, "p")
        effects = policy.on(Crashed("p", worker, 0.0))
        assert effects == ((Quarantine("p", 3),) if n == 3 else ())


def test_a_drained_or_finished_request_is_no_suspect_of_a_later_crash():
    policy = CrashPolicy(after_crashes=1, probation_s=1.0)
    hold(policy, "w1", "done", "poison")
    policy.on(Released("done"))
    assert policy.on(Crashed("poison", "w1", 0.0)) == (Quarantine("poison", 1),)
    assert policy.tracked == 1
    policy.on(Released("poison"))
    assert policy.tracked == 0


def test_suspects_of_one_crash_are_scattered_while_on_probation():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "x", "y", "z")
    crash(policy, "w1", "x", "y", "z")
    candidates = frozenset({"w2", "w3"})
    assert policy.on(Placing("x", candidates, at=10.0)) == (Move("x", frozenset()),)
    policy.on(Placed("x", "w2", at=10.0))
    assert policy.on(Placing("y", candidates, at=10.1)) == (Move("y", frozenset({"w2"})),)
    policy.on(Placed("y", "w3", at=10.1))
    # Every candidate holds a mate on probation: z goes where the migration service puts it (nothing waits).
    assert policy.on(Placing("z", candidates, at=10.5)) == (Move("z", frozenset()),)
    # Past x's probation, w2 is free again.
    assert policy.on(Placing("z", candidates, at=12.05)) == (Move("z", frozenset({"w3"})),)


def test_requests_that_had_streamed_are_no_suspects_when_one_was_in_its_prefill():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "a", "b")
    policy.on(Streamed("a"))
    policy.on(Streamed("b"))
    hold(policy, "w1", "poison")
    crash(policy, "w1", "a", "poison", "b")
    assert (policy.crashes_seen("a"), policy.crashes_seen("b"), policy.crashes_seen("poison")) == (0, 0, 1)
    # On w2 it crashes in its restore beside a request restored with it: the one common suspect is the poison.
    hold(policy, "w2", "a", "c")
    policy.on(Streamed("c"))
    hold(policy, "w2", "poison")
    effects = crash(policy, "w2", "c", "a", "poison")
    assert effects == {"c": (), "a": (), "poison": (Quarantine("poison", 2),)}
    assert policy.crashes_seen("a") == 1


def test_a_death_while_every_request_was_decoding_blames_no_one():
    policy = CrashPolicy(after_crashes=1, probation_s=2.0)
    hold(policy, "w1", "a", "b")
    policy.on(Streamed("a"))
    policy.on(Streamed("b"))
    assert crash(policy, "w1", "a", "b") == {"a": (), "b": ()}
    assert policy.crashes_seen("a") == policy.crashes_seen("b") == 0 and policy.deaths == 1


def test_a_mate_that_crashed_its_new_worker_frees_it_for_the_others():
    policy = CrashPolicy(after_crashes=3, probation_s=5.0)
    hold(policy, "w1", "x", "y")
    crash(policy, "w1", "x", "y")
    policy.on(Placed("x", "w2", at=0.0))
    hold(policy, "w2", "x")
    crash(policy, "w2", "x")
    assert policy.on(Placing("y", frozenset({"w3"}), at=0.5)) == (Move("y", frozenset()),)


def test_a_request_that_never_crashed_moves_anywhere():
    policy = CrashPolicy(after_crashes=2, probation_s=5.0)
    hold(policy, "w1", "r")
    assert policy.on(Placing("r", frozenset({"w2"}), at=0.0)) == (Move("r", frozenset()),)


def test_a_request_sent_to_a_worker_that_had_died_already_is_no_suspect():
    policy = CrashPolicy(after_crashes=2, probation_s=1.0, same_death_s=5.0)
    hold(policy, "w1", "a")
    crash(policy, "w1", "a", at=0.0)
    hold(policy, "w1", "late")  # routed to w1 while its registration outlives it
    assert crash(policy, "w1", "late", at=1.0) == {"late": ()}
    assert policy.crashes_seen("late") == 0 and policy.deaths == 1
    hold(policy, "w2", "late")
    assert crash(policy, "w2", "late", at=2.0) == {"late": ()}  # its first crash: not quarantined on one


def test_a_restarted_worker_of_the_same_id_that_dies_again_is_a_new_crash():
    policy = CrashPolicy(after_crashes=2, probation_s=1.0, same_death_s=5.0)
    hold(policy, "w1", "a")
    crash(policy, "w1", "a", at=0.0)
    hold(policy, "w1", "a")  # the worker came back under its stable id
    assert crash(policy, "w1", "a", at=6.0) == {"a": (Quarantine("a", 2),)}
    assert policy.deaths == 2


def test_a_mate_that_ran_its_probation_on_the_poisons_next_worker_is_cleared():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "poison", "good")
    crash(policy, "w1", "good", "poison", at=0.0)
    policy.on(Placed("good", "w2", at=0.1))
    hold(policy, "w2", "good")
    policy.on(Placed("poison", "w2", at=2.2))
    hold(policy, "w2", "poison")
    effects = crash(policy, "w2", "poison", "good", at=2.4)
    assert effects == {"poison": (Quarantine("poison", 2),), "good": ()}


def test_a_cleared_mate_is_cleared_whichever_stream_of_the_crash_breaks_first():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "poison", "good")
    crash(policy, "w1", "good", "poison", at=0.0)
    policy.on(Placed("good", "w2", at=0.1))
    policy.on(Placed("poison", "w2", at=2.2))
    hold(policy, "w2", "good", "poison")
    assert crash(policy, "w2", "good", "poison", at=2.4) == {"good": (), "poison": (Quarantine("poison", 2),)}


def test_a_mate_still_on_probation_at_the_crash_is_not_cleared():
    policy = CrashPolicy(after_crashes=2, probation_s=2.0)
    hold(policy, "w1", "poison", "good")
    crash(policy, "w1", "good", "poison", at=0.0)
    for r in ("good", "poison"):
        policy.on(Placed(r, "w2", at=0.1))
        hold(policy, "w2", r)
    assert crash(policy, "w2", "poison", "good", at=0.5) == {"poison": (), "good": ()}


def test_after_crashes_must_be_positive():
    with pytest.raises(ValueError):
        CrashPolicy(after_crashes=0, probation_s=1.0)
