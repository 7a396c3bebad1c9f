"""When the router encodes a request's media again, rows inline. Pure logic, no I/O.

With direct delivery (``media_delivery: direct``) a worker fetches a
request's embedding rows from the encoder that computed them, which holds
them for a while; the router keeps only where they wait. Media are pure
inputs (encoding again gives the same rows), so when the rows cannot be
fetched the router encodes the media again and sends the rows inline, and the
client sees nothing of it. `MediaRefetchPolicy` decides when, from what
happened (events in), and says what to do (effects out); the router's media
flow executes the effects and reports the re-encode's result back:

- the worker refuses the request before its first token because it could not
  fetch the rows (their encoder died, or dropped them): encode again, then
  open the same call on the same worker (it submitted nothing);
- a migration is due past the time the rows are worth fetching: encode again
  first, so that the migration carries them; if no encoder can, do not
  migrate (the relay policy decides what then);
- the migration's target could not fetch them: encode again and ask again.

Once inline, the rows stay inline: nothing is left to fetch, and any later
refusal is not the media's to hide.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "AskMigration",
    "MediaRefetchPolicy",
    "MigrationDue",
    "OpenAgain",
    "PassOn",
    "Reencode",
    "ReencodeCause",
    "Reencoded",
    "SkipMigration",
    "TargetRefused",
    "WorkerFailed",
]


class ReencodeCause(Enum):
    """Why the media are encoded again (the label of phalanx_router_media_reencodes)."""

    FETCH_FAILED = "fetch_failed"  # a worker could not fetch the rows
    MIGRATION = "migration"  # a migration carries the rows


# -- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerFailed:
    """The worker's stream of the request broke; `fetch_failed`: the worker said it could not fetch the media."""

    got_chunks: bool
    fetch_failed: bool


@dataclass(frozen=True)
class MigrationDue:
    """A migration of the request is about to be asked for, at `now` (time.monotonic)."""

    now: float


@dataclass(frozen=True)
class TargetRefused:
    """The migration service's target could not fetch the request's media."""


@dataclass(frozen=True)
class Reencoded:
    """What the Reencode effect came to: the rows inline now (`ok`), or no encoder could encode them."""

    ok: bool


Event = WorkerFailed | MigrationDue | TargetRefused | Reencoded


# -- effects -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reencode:
    """Encode the media again, rows inline; report Reencoded."""

    cause: ReencodeCause


@dataclass(frozen=True)
class OpenAgain:
    """Open the same call on the same worker again, with the rows inline."""


@dataclass(frozen=True)
class AskMigration:
    """Ask the migration service to move the request, with the media as they are now."""


@dataclass(frozen=True)
class SkipMigration:
    """Ask for no migration: nothing moved the request (the relay policy decides what then)."""


@dataclass(frozen=True)
class PassOn:
    """Not the media's to hide: the error goes on (to the relay policy for a broken stream, else to the client)."""


Effect = Reencode | OpenAgain | AskMigration | SkipMigration | PassOn


class MediaRefetchPolicy:
    """The refetch decisions of one request's media.

    `direct`: the workers fetch the rows from their encoder, worth fetching until `usable_until` (time.monotonic); a
    request without media, or with its rows inline, never refetches. `on(event)` returns the one effect to execute.
    """

    def __init__(self, *, direct: bool = False, usable_until: float = 0.0) -> None:
        self.direct = direct
        self.usable_until = usable_until
        self._reencoding: ReencodeCause | None = None

    def on(self, event: Event) -> Effect:
        if isinstance(event, WorkerFailed):
            if self.direct and not event.got_chunks and event.fetch_failed:
                return self._reencode(ReencodeCause.FETCH_FAILED)
            return PassOn()
        if isinstance(event, MigrationDue):
            if self.direct and event.now >= self.usable_until:
                return self._reencode(ReencodeCause.MIGRATION)
            return AskMigration()
        if isinstance(event, TargetRefused):
            return self._reencode(ReencodeCause.MIGRATION) if self.direct else PassOn()
        if isinstance(event, Reencoded):
            return self._reencoded(event)
        raise TypeError(f"not a media refetch event: {event!r}")

    def _reencode(self, cause: ReencodeCause) -> Reencode:
        self._reencoding = cause
        return Reencode(cause)

    def _reencoded(self, result: Reencoded) -> Effect:
        cause, self._reencoding = self._reencoding, None
        if cause is None:
            raise ValueError("a re-encode result without a re-encode")
        if result.ok:
            self.direct = False  # inline now: nothing left to fetch
            return OpenAgain() if cause is ReencodeCause.FETCH_FAILED else AskMigration()
        return PassOn() if cause is ReencodeCause.FETCH_FAILED else SkipMigration()
