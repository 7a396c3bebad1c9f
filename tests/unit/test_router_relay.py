"""The router's relay decisions: refusals, handoffs, broken streams, migration results."""

import grpc
import pytest

from phalanx.router.relay import (
    MAX_MOVES,
    MAX_ROUTE_ATTEMPTS,
    AttachMoved,
    Fail,
    Finish,
    GiveUp,
    HandedBack,
    Migrate,
    MigrationResult,
    MoveCause,
    RelayPolicy,
    ReportBroken,
    ResumeElsewhere,
    RetryElsewhere,
    StreamBroke,
    StreamEnded,
)

pytestmark = pytest.mark.unit

Code = grpc.StatusCode


def new_request(can_migrate: bool = True) -> RelayPolicy:
    return RelayPolicy(retry_elsewhere=True, can_migrate=can_migrate)


def running_request(can_migrate: bool = True) -> RelayPolicy:
    return RelayPolicy(retry_elsewhere=False, can_migrate=can_migrate)


def test_a_stream_that_ends_by_itself_finishes_the_relay():
    assert new_request().on(StreamEnded()) == (Finish(),)


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED])
def test_a_refused_new_request_goes_to_another_worker_up_to_three_in_all(code):
    relay = new_request()
    report = (ReportBroken("w1"),) if code is Code.UNAVAILABLE else ()
    assert relay.on(StreamBroke("w1", code, got_chunks=False)) == (*report, RetryElsewhere(frozenset({"w1"})))
    assert relay.on(StreamBroke("w2", Code.RESOURCE_EXHAUSTED, got_chunks=False)) == (RetryElsewhere(frozenset({"w1", "w2"})),)
    assert MAX_ROUTE_ATTEMPTS == 3
    # The third refusal is the last: it is no longer re-routed but moved (or failed) like any broken stream.
    assert relay.on(StreamBroke("w3", Code.RESOURCE_EXHAUSTED, got_chunks=False)) == (Fail("w3"),)


def test_a_refusal_after_the_first_chunk_is_not_rerouted_but_migrated():
    relay = new_request()
    assert relay.on(StreamBroke("w1", Code.UNAVAILABLE, got_chunks=True)) == (
        ReportBroken("w1"), Migrate("w1", MoveCause.STREAM_BROKE, Code.UNAVAILABLE),
    )


def test_a_running_request_whose_worker_refuses_is_migrated_not_rerouted():
    relay = running_request()
    assert relay.on(StreamBroke("w1", Code.UNAVAILABLE, got_chunks=False))[-1] == Migrate("w1", MoveCause.STREAM_BROKE, Code.UNAVAILABLE)


@pytest.mark.parametrize("code", [Code.CANCELLED, Code.DEADLINE_EXCEEDED, Code.INTERNAL, Code.UNKNOWN])
def test_a_mid_stream_break_that_a_migration_can_hide_is_migrated_without_a_report(code):
    move = Migrate("w1", MoveCause.STREAM_BROKE, code)
    assert running_request().on(StreamBroke("w1", code, got_chunks=True)) == (move,)
    assert move.reason == f"stream broke: {code.name}"


@pytest.mark.parametrize("code", [Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED])
def test_an_error_no_migration_can_hide_goes_to_the_client(code):
    assert running_request().on(StreamBroke("w1", code, got_chunks=True)) == (Fail("w1"),)


def test_without_a_migration_service_a_broken_stream_fails_but_still_reports_an_unavailable_worker():
    relay = running_request(can_migrate=False)
    assert relay.on(StreamBroke("w1", Code.UNAVAILABLE, got_chunks=True)) == (ReportBroken("w1"), Fail("w1"))


def test_a_migrated_request_is_attached_where_it_went_and_never_rerouted_again():
    relay = new_request()
    relay.on(StreamBroke("w1", Code.INTERNAL, got_chunks=True))
    assert relay.on(MigrationResult("w2")) == (AttachMoved("w2"),)
    assert not relay.retry_elsewhere
    # A refusal by the new worker is now a break of a running request.
    assert relay.on(StreamBroke("w2", Code.UNAVAILABLE, got_chunks=False))[-1] == Migrate("w2", MoveCause.STREAM_BROKE, Code.UNAVAILABLE)


def test_a_request_moved_under_its_relay_counts_a_move_and_is_never_rerouted_again():
    relay = new_request()
    relay.moved_under()  # fenced off a hung worker: it runs where the migration put it
    assert relay.moves == 1 and not relay.retry_elsewhere
    assert relay.on(StreamBroke("w2", Code.UNAVAILABLE, got_chunks=False))[-1] == Migrate("w2", MoveCause.STREAM_BROKE, Code.UNAVAILABLE)


def test_a_broken_stream_that_nothing_moved_fails_with_that_worker_s_error():
    relay = running_request()
    relay.on(StreamBroke("w1", Code.UNAVAILABLE, got_chunks=True))
    assert relay.on(MigrationResult(None)) == (Fail("w1"),)


def test_a_handoff_is_migrated_and_falls_back_to_resuming_elsewhere_when_nothing_moved_it():
    relay = running_request()
    move = Migrate("w1", MoveCause.HANDED_BACK)
    assert relay.on(HandedBack("w1")) == (move,)
    assert move.reason == "handed back"
    assert relay.on(MigrationResult(None)) == (ResumeElsewhere(frozenset({"w1"})),)


def test_without_a_migration_service_a_handoff_resumes_on_another_worker():
    relay = new_request(can_migrate=False)
    assert relay.on(HandedBack("w1")) == (ResumeElsewhere(frozenset({"w1"})),)
    assert not relay.retry_elsewhere


def test_a_request_moved_too_often_gives_up():
    relay = running_request()
    for i in range(MAX_MOVES):
        assert isinstance(relay.on(HandedBack(f"w{i}"))[-1], Migrate)
        assert relay.on(MigrationResult(f"w{i + 1}")) == (AttachMoved(f"w{i + 1}"),)
    assert relay.on(StreamBroke("w8", Code.UNAVAILABLE, got_chunks=True)) == (ReportBroken("w8"), GiveUp(MAX_MOVES + 1))


def test_refusals_before_the_first_token_do_not_count_as_moves():
    relay = new_request()
    relay.on(StreamBroke("w1", Code.UNAVAILABLE, got_chunks=False))
    assert relay.moves == 0


def test_a_migration_result_without_a_migration_is_a_bug():
    with pytest.raises(ValueError, match="without a migration"):
        running_request().on(MigrationResult("w2"))
