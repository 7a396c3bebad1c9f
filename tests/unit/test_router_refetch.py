"""The router's media refetch decisions: a worker or a migration's target that cannot fetch the rows, stale rows."""

import pytest

from phalanx.router.refetch import (
    AskMigration,
    MediaRefetchPolicy,
    MigrationDue,
    OpenAgain,
    PassOn,
    Reencode,
    ReencodeCause,
    Reencoded,
    SkipMigration,
    TargetRefused,
    WorkerFailed,
)

pytestmark = pytest.mark.unit

FETCH_FAILED = WorkerFailed(got_chunks=False, fetch_failed=True)


def direct(usable_until: float = 100.0) -> MediaRefetchPolicy:
    return MediaRefetchPolicy(direct=True, usable_until=usable_until)


def test_a_worker_that_could_not_fetch_the_rows_gets_them_inline_on_the_same_call():
    media = direct()
    assert media.on(FETCH_FAILED) == Reencode(ReencodeCause.FETCH_FAILED)
    assert media.on(Reencoded(ok=True)) == OpenAgain()
    assert not media.direct
    # Inline now: a second refusal is not the media's to hide.
    assert media.on(FETCH_FAILED) == PassOn()


def test_a_failed_reencode_after_a_fetch_failure_passes_the_error_on():
    media = direct()
    media.on(FETCH_FAILED)
    assert media.on(Reencoded(ok=False)) == PassOn()
    assert media.direct


@pytest.mark.parametrize("failed", [
    WorkerFailed(got_chunks=True, fetch_failed=True),  # the worker runs the request: it had the rows
    WorkerFailed(got_chunks=False, fetch_failed=False),  # refused for another reason
])
def test_other_broken_streams_are_the_relay_policy_s(failed):
    assert direct().on(failed) == PassOn()


def test_requests_with_inline_rows_or_no_media_never_refetch():
    inline = MediaRefetchPolicy()
    assert inline.on(FETCH_FAILED) == PassOn()
    assert inline.on(MigrationDue(now=1e9)) == AskMigration()
    assert inline.on(TargetRefused()) == PassOn()


def test_a_migration_within_the_rows_hold_carries_their_source():
    assert direct(usable_until=100.0).on(MigrationDue(now=99.0)) == AskMigration()


def test_a_migration_past_the_rows_hold_carries_them_inline_or_does_not_happen():
    media = direct(usable_until=100.0)
    assert media.on(MigrationDue(now=100.0)) == Reencode(ReencodeCause.MIGRATION)
    assert media.on(Reencoded(ok=True)) == AskMigration()
    assert not media.direct
    stale = direct(usable_until=100.0)
    stale.on(MigrationDue(now=101.0))
    assert stale.on(Reencoded(ok=False)) == SkipMigration()


def test_a_target_that_could_not_fetch_the_rows_is_asked_again_with_them_inline_once():
    media = direct()
    assert media.on(TargetRefused()) == Reencode(ReencodeCause.MIGRATION)
    assert media.on(Reencoded(ok=True)) == AskMigration()
    assert media.on(TargetRefused()) == PassOn()  # inline rows it refused: its error goes on


def test_a_target_refusal_that_no_encoder_can_fix_skips_the_migration():
    media = direct()
    media.on(TargetRefused())
    assert media.on(Reencoded(ok=False)) == SkipMigration()


def test_a_reencode_result_without_a_reencode_is_a_bug():
    with pytest.raises(ValueError, match="without a re-encode"):
        direct().on(Reencoded(ok=True))
