"""Per-tenant limits at the router's door, and fair shares of a full router. Pure logic, no I/O.

Three limits per tenant (docs/tenants.md): streams in flight, tokens per
minute (prompt + generated) and prompt size. Streams are counted by request
id, not by worker call: a stream that migrates, is handed back or is resumed
is one stream, and each token index is charged once.

Tokens per minute is a token bucket holding one minute's worth that refills
continuously. A request's prompt is charged when it is admitted, which needs
the bucket to hold the whole prompt; its generated tokens are charged as they
are relayed, so a tenant may run into debt while streams it already has
finish, and its next request waits until the debt is paid back.

When the router is full (max_streams of the router), new requests wait in a
FairQueue: a free slot goes to the waiting tenant with the fewest streams per
unit of weight, ties to the one served least recently (round robin). A
greedy tenant then has no more than its share of a full router as soon as
others want theirs, and all of it while nobody else does.

Counts live in this router's memory, and with several routers each one
holds every limit for the whole fleet (FleetUsage): every router reports its
per-tenant usage every interval, and a router admits a tenant's new stream
while its own streams plus the other live routers' last reported ones stay
under the limit; the token totals others report are charged to this router's
buckets as they arrive. Admission never waits for the network: the figures
are at most one report interval (plus delivery) old, which bounds how far a
burst over several routers at once can overshoot. A router silent for
EXPIRY_INTERVALS of its intervals is gone, and its streams stop counting.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from phalanx.common.errors import InvalidRequestError, TenantLimitError

__all__ = [
    "EXPIRY_INTERVALS",
    "FairQueue",
    "FleetUsage",
    "Limit",
    "TenantLedger",
    "TenantLimits",
    "TenantPromptError",
    "TenantUsage",
    "TokenBucket",
    "UsageReport",
]

T = TypeVar("T")

# A router silent for this many of its report intervals is gone (dead or cut off): its streams stop counting. Several
# intervals, so that one late report on a busy host does not make a live router's streams vanish for a moment.
EXPIRY_INTERVALS = 5
# Token totals of a router outlive its liveness this long (the bucket's minute and more): when it speaks again after a
# hiccup, only what it charged meanwhile is new.
_FORGET_TOTALS_S = 120.0


class Limit(StrEnum):
    """Which limit refused a request (the ``limit`` of errors and metrics)."""

    STREAMS = "max_streams"
    TOKENS = "tokens_per_minute"
    PROMPT = "max_prompt_tokens"
    QUEUE = "queue"


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; 0 means unlimited."""

    max_streams: int = 0
    tokens_per_minute: int = 0
    max_prompt_tokens: int = 0
    weight: int = 1


class TenantPromptError(InvalidRequestError):
    """A prompt longer than its tenant may send (or than its tokens per minute could ever admit): retrying cannot help."""

    def __init__(self, tenant: str, limit: Limit, description: str) -> None:
        super().__init__("prompt", description)
        self.tenant = tenant
        self.limit = limit


class TokenBucket:
    """Holds up to ``per_minute`` tokens and refills ``per_minute / 60`` per second; may go below zero (debt)."""

    def __init__(self, per_minute: int, *, now: float) -> None:
        if per_minute < 1:
            raise ValueError("per_minute must be at least 1")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._stamp = now

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
            self._stamp = now

    def wait_s(self, tokens: int, now: float) -> float:
        """Seconds until the bucket holds ``tokens`` (0: now)."""
        self._refill(now)
        missing = tokens - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, tokens: float, now: float) -> None:
        self._refill(now)
        self.level -= tokens

    def missing(self, now: float) -> float:
        """Tokens the bucket lacks to be full (more than its capacity in debt)."""
        self._refill(now)
        return self.capacity - self.level


class FairQueue(Generic[T]):
    """Waiting requests per tenant; ``pop`` picks whose turn it is."""

    def __init__(self) -> None:
        self._waiting: dict[str, deque[T]] = {}
        self._served: dict[str, int] = {}
        self._turns = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def per_tenant(self) -> dict[str, int]:
        return {tenant: len(queue) for tenant, queue in self._waiting.items()}

    def push(self, tenant: str, item: T) -> None:
        self._waiting.setdefault(tenant, deque()).append(item)

    def remove(self, tenant: str, item: T) -> bool:
        """Takes ``item`` out (it gave up); False if it is not waiting any more (``pop`` gave it a slot)."""
        queue = self._waiting.get(tenant)
        if not queue or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._waiting[tenant]
        return True

    def pop(self, streams: Mapping[str, int], weights: Mapping[str, int]) -> tuple[str, T] | None:
        """The next waiter: of the tenant with the fewest streams per weight, ties to the least recently served."""
        if not self._waiting:
            return None
        tenant = min(self._waiting, key=lambda t: (streams.get(t, 0) / weights.get(t, 1), self._served.get(t, -1)))
        self._served[tenant] = next(self._turns)
        queue = self._waiting[tenant]
        item = queue.popleft()
        if not queue:
            del self._waiting[tenant]
        return tenant, item


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's usage at one router, as reported to the others."""

    streams: int = 0
    tokens_charged: int = 0  # since the router's incarnation started
    tokens_recent: float = 0.0  # of those, what a bucket of the tenant's rate has not refilled yet


@dataclass(frozen=True)
class UsageReport:
    """A router's usage of every tenant it serves (TenantUsageReport on NATS)."""

    router_id: str
    incarnation: str
    interval_s: float
    tenants: Mapping[str, TenantUsage]


@dataclass
class _Peer:
    incarnation: str
    seen: float
    expires: float
    streams: dict[str, int]
    charged: dict[str, int]


class FleetUsage:
    """The other routers' last reported usage: what this router counts besides its own against each tenant's limits."""

    def __init__(self, router_id: str, *, expiry_intervals: float = EXPIRY_INTERVALS) -> None:
        self.router_id = router_id
        self.expiry_intervals = expiry_intervals
        self._peers: dict[str, _Peer] = {}

    def on_report(self, report: UsageReport, now: float) -> dict[str, float]:
        """Takes another router's report; returns the tokens it charged that this router has not counted yet, per tenant.

        Totals only grow within an incarnation, so a lost report costs nothing: the next one carries what it missed.
        A router (or an incarnation of it) seen for the first time brings its recent tokens, not its whole history.
        """
        if report.router_id == self.router_id:
            return {}
        peer = self._peers.get(report.router_id)
        known = peer is not None and peer.incarnation == report.incarnation
        charges: dict[str, float] = {}
        charged: dict[str, int] = dict(peer.charged) if known and peer is not None else {}
        for tenant, usage in report.tenants.items():
            new = usage.tokens_charged - charged[tenant] if tenant in charged else (
                usage.tokens_charged if known else usage.tokens_recent
            )
            if new > 0:
                charges[tenant] = float(new)
            charged[tenant] = max(usage.tokens_charged, charged.get(tenant, 0))
        self._peers[report.router_id] = _Peer(
            report.incarnation, now, now + self.expiry_intervals * report.interval_s,
            {tenant: usage.streams for tenant, usage in report.tenants.items() if usage.streams > 0}, charged,
        )
        return charges

    def streams(self, tenant: str, now: float) -> int:
        """The tenant's streams at the other live routers, as they last reported them."""
        return sum(peer.streams.get(tenant, 0) for peer in self._peers.values() if peer.expires > now)

    def per_tenant(self, now: float) -> dict[str, int]:
        totals: dict[str, int] = {}
        for peer in self._peers.values():
            if peer.expires > now:
                for tenant, streams in peer.streams.items():
                    totals[tenant] = totals.get(tenant, 0) + streams
        return totals

    def live(self, now: float) -> list[str]:
        """The other routers whose last report has not expired."""
        return sorted(router_id for router_id, peer in self._peers.items() if peer.expires > now)

    def prune(self, now: float) -> None:
        """Forgets routers silent for long (their token totals too)."""
        for router_id in [r for r, peer in self._peers.items() if now - peer.seen > max(_FORGET_TOTALS_S, peer.expires - peer.seen)]:
            del self._peers[router_id]


@dataclass
class _Stream:
    tenant: str
    holders: int = 1
    # Token indexes below this are charged already (a retry or resume relays some again).
    charged_to: int = 0


class TenantLedger:
    """Streams in flight and token buckets per tenant; checks a new request against its tenant's limits."""

    def __init__(
        self, limits: Mapping[str, TenantLimits], *, default: TenantLimits = TenantLimits(), max_streams: int = 0,
        retry_after_s: float = 1.0, fleet: FleetUsage | None = None,
    ) -> None:
        self._limits = dict(limits)
        self.fleet = fleet
        self._default = default
        self.max_streams = max_streams
        self.retry_after_s = retry_after_s
        self._streams: dict[str, _Stream] = {}
        self._per_tenant: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}
        # What this router alone charged (reported to the others): totals, and buckets that take nothing else.
        self._charged: dict[str, int] = {}
        self._own_buckets: dict[str, TokenBucket] = {}

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self._default)

    def streams(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    @property
    def per_tenant(self) -> Mapping[str, int]:
        return self._per_tenant

    @property
    def weights(self) -> dict[str, int]:
        return {name: limits.weight for name, limits in self._limits.items()}

    @property
    def total(self) -> int:
        return len(self._streams)

    @property
    def full(self) -> bool:
        return bool(self.max_streams) and self.total >= self.max_streams

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    def check(self, tenant: str, prompt_tokens: int, now: float, *, queued: int = 0) -> None:
        """Raises TenantPromptError or TenantLimitError if a new request of ``tenant`` may not start now."""
        limits = self.limits(tenant)
        if limits.max_prompt_tokens and prompt_tokens > limits.max_prompt_tokens:
            raise TenantPromptError(
                tenant, Limit.PROMPT,
                f"{prompt_tokens} tokens exceed the limit of tenant {tenant!r} ({Limit.PROMPT.value} {limits.max_prompt_tokens})",
            )
        if limits.tokens_per_minute and prompt_tokens > limits.tokens_per_minute:
            raise TenantPromptError(
                tenant, Limit.TOKENS,
                f"{prompt_tokens} tokens can never fit tenant {tenant!r}'s {Limit.TOKENS.value} of {limits.tokens_per_minute}",
            )
        elsewhere = self.fleet.streams(tenant, now) if self.fleet is not None and limits.max_streams else 0
        held = self.streams(tenant) + queued + elsewhere
        if limits.max_streams and held >= limits.max_streams:
            where = f" ({elsewhere} at other routers)" if elsewhere else ""
            raise TenantLimitError(
                f"tenant {tenant!r} has {held} streams in flight{where}, its limit ({Limit.STREAMS.value} {limits.max_streams}); "
                f"retry in {self.retry_after_s:g} s or when one ends",
                tenant=tenant, limit=Limit.STREAMS, retry_after_s=self.retry_after_s,
            )
        bucket = self._bucket(tenant, now)
        if bucket is not None:
            wait = bucket.wait_s(prompt_tokens, now)
            if wait > 0:
                raise TenantLimitError(
                    f"tenant {tenant!r} is over its {Limit.TOKENS.value} of {limits.tokens_per_minute} (prompt + generated): "
                    f"{prompt_tokens} prompt tokens fit in {wait:.1f} s; retry then",
                    tenant=tenant, limit=Limit.TOKENS, retry_after_s=round(wait, 3),
                )

    def open(self, tenant: str, request_id: str, prompt_tokens: int, now: float) -> None:
        """Counts a new stream and charges its prompt (``check`` said yes, or it waited for its turn)."""
        if self._join(request_id):
            return
        self._add(tenant, request_id)
        self._take(tenant, prompt_tokens, now)

    def hold(self, tenant: str, request_id: str, *, from_index: int = 0) -> None:
        """A stream of a request that runs already (a retry, a Resume): counted once, never refused, its prompt not charged."""
        if not self._join(request_id):
            self._add(tenant, request_id).charged_to = from_index

    def release(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.holders -= 1
        if stream.holders == 0:
            del self._streams[request_id]
            left = self._per_tenant[stream.tenant] - 1
            if left:
                self._per_tenant[stream.tenant] = left
            else:
                del self._per_tenant[stream.tenant]

    def charge(self, request_id: str, index: int, now: float) -> None:
        """Token ``index`` of the request went to its client: charged to its tenant once."""
        stream = self._streams.get(request_id)
        if stream is None or index < stream.charged_to:
            return
        tokens, stream.charged_to = index + 1 - stream.charged_to, index + 1
        self._take(stream.tenant, tokens, now)

    def on_peer_report(self, report: UsageReport, now: float) -> dict[str, float]:
        """Another router's usage: its streams count from now on, and what it charged since its last report is taken.

        Returns the tokens taken, per tenant (those with a tokens_per_minute here).
        """
        if self.fleet is None:
            return {}
        taken: dict[str, float] = {}
        for tenant, tokens in self.fleet.on_report(report, now).items():
            bucket = self._bucket(tenant, now)
            if bucket is not None:
                bucket.take(tokens, now)
                taken[tenant] = tokens
        return taken

    def usage(self, now: float, queued: Mapping[str, int]) -> dict[str, TenantUsage]:
        """This router's own usage per tenant, for the others (streams include requests waiting for its slots)."""
        usage: dict[str, TenantUsage] = {}
        for tenant in self._per_tenant.keys() | queued.keys() | self._charged.keys():
            own = self._own_buckets.get(tenant)
            usage[tenant] = TenantUsage(
                streams=self._per_tenant.get(tenant, 0) + queued.get(tenant, 0), tokens_charged=self._charged.get(tenant, 0),
                tokens_recent=round(max(0.0, own.missing(now)), 3) if own is not None else 0.0,
            )
        return usage

    def _take(self, tenant: str, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        self._charged[tenant] = self._charged.get(tenant, 0) + tokens
        bucket = self._bucket(tenant, now)
        if bucket is not None:
            bucket.take(tokens, now)
            own = self._own_buckets.get(tenant)
            if own is None:
                own = self._own_buckets[tenant] = TokenBucket(int(bucket.capacity), now=now)
            own.take(tokens, now)

    def _join(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.holders += 1
        return True

    def _add(self, tenant: str, request_id: str) -> _Stream:
        stream = self._streams[request_id] = _Stream(tenant)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        return stream

    def _bucket(self, tenant: str, now: float) -> TokenBucket | None:
        per_minute = self.limits(tenant).tokens_per_minute
        if not per_minute:
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(per_minute, now=now)
        return bucket
