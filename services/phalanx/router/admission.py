"""Who may send what, and what the router sheds under degradation. Pure logic, no I/O.

The health service publishes a degradation level (etcd, DegradationState;
see phalanx.health.degradation). Level 2 sheds best_effort; level 4 rejects
every new request, premium included, unless the router is configured to
serve premium at level 4 (PHALANX_ROUTER_PREMIUM_AT_LEVEL_4: premium is then
served as long as any worker can take it). Levels 1 and 3 act on workers and
SLOs, not on admission. Only new requests are judged: streams already
running, their resumes and their handoffs always finish. Shed requests get
RESOURCE_EXHAUSTED with a retry hint: the system is overloaded, not broken.
Plain overload (no level) is judged request by request after this, by the SLO-aware
admission of phalanx.router.overload: whether the request can start within its SLOs.

Each tenant's limits (streams in flight, tokens per minute, prompt size; see
phalanx.router.limits) are held here too: ``enter`` admits a new stream or
refuses it with TENANT_LIMIT (RESOURCE_EXHAUSTED + RetryInfo), and when the
router is full (max_streams) it waits for a slot, which goes to tenants in
fair shares. Everything but that wait is synchronous and I/O-free: the other
routers' usage (``on_peer_report``, from NATS) is already in memory when a
request comes, and ``usage`` is what this router reports to them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from phalanx.common.errors import AuthenticationError, InvalidRequestError, RequestShedError, TenantLimitError
from phalanx.router.config import TenantLimitDefaults, TenantPolicy
from phalanx.router.limits import FairQueue, FleetUsage, Limit, TenantLedger, TenantLimits, TenantUsage, UsageReport

DEFAULT_TENANT = "default"
SHED_BEST_EFFORT_LEVEL = 2
SHED_STANDARD_LEVEL = 4
# What each level does (phalanx.health.degradation.LEVELS_HELP says the same; a unit test holds them equal).
LEVELS_HELP = "0 normal, 1 batches x0.75, 2 also sheds best_effort, 3 batches x0.5 and latency SLOs x2, 4 rejects new requests"


class Tier(IntEnum):
    """Values of phalanx.router.v1.Tier; a lower value is served longer under overload."""

    PREMIUM = 1
    STANDARD = 2
    BEST_EFFORT = 3

    @classmethod
    def from_name(cls, name: str) -> Tier:
        return cls[name.upper()]

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Admitted:
    tenant: str
    tier: Tier


@dataclass(eq=False)
class _Waiter:
    request_id: str
    prompt_tokens: int
    turn: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    admitted: bool = False  # its stream is counted: it owes a leave()


def tenant_limits(policy: TenantPolicy, defaults: TenantLimitDefaults) -> TenantLimits:
    """A tenant's limits: its policy's, and the defaults where it sets none."""
    return TenantLimits(
        max_streams=defaults.max_streams if policy.max_streams is None else policy.max_streams,
        tokens_per_minute=defaults.tokens_per_minute if policy.tokens_per_minute is None else policy.tokens_per_minute,
        max_prompt_tokens=defaults.max_prompt_tokens if policy.max_prompt_tokens is None else policy.max_prompt_tokens,
        weight=policy.weight,
    )


@dataclass(frozen=True)
class QueueSettings:
    """How new requests wait for a full router (RouterConfig's max_streams, queue_timeout_s, max_queued_per_tenant)."""

    max_streams: int = 0
    timeout_s: float = 10.0
    max_per_tenant: int = 64
    retry_after_s: float = 1.0


class Admission:
    """Resolves a request's tenant and tier, applies the degradation level and holds each tenant's limits."""

    def __init__(
        self, tenants: dict[str, TenantPolicy], api_keys: dict[str, str], *, retry_after_s: float = 1.0,
        premium_at_level_4: bool = False, limit_defaults: TenantLimitDefaults | None = None, queue: QueueSettings | None = None,
        clock: Callable[[], float] = time.monotonic, fleet: FleetUsage | None = None,
    ) -> None:
        self._tenants = dict(tenants)
        self._api_keys = dict(api_keys)
        self._retry_after_s = retry_after_s
        self._premium_at_level_4 = premium_at_level_4
        self.level = 0
        defaults = limit_defaults or TenantLimitDefaults()
        self._queue_settings = queue = queue or QueueSettings()
        self.ledger = TenantLedger(
            {name: tenant_limits(policy, defaults) for name, policy in self._tenants.items()},
            default=tenant_limits(TenantPolicy(), defaults), max_streams=queue.max_streams, retry_after_s=queue.retry_after_s,
            fleet=fleet,
        )
        self.queue: FairQueue[_Waiter] = FairQueue()
        self._clock = clock
        # Called after each new stream is counted (a plain callback, no I/O): the router reports its usage early.
        self.on_admitted: Callable[[], None] | None = None

    @property
    def tenant_names(self) -> frozenset[str]:
        return frozenset(self._tenants)

    @property
    def requires_api_key(self) -> bool:
        return bool(self._api_keys)

    def admit(self, *, tenant: str, tier: int, api_key: str | None) -> Admitted:
        """The tenant and tier a request runs as; raises for unknown names, bad keys and shedding."""
        tenant = self.tenant(tenant, api_key)
        policy = self._tenants[tenant]
        if tier == 0:
            resolved = Tier.from_name(policy.default_tier)
        else:
            try:
                resolved = Tier(tier)
            except ValueError:
                raise InvalidRequestError("tier", f"unknown tier {tier}; use premium, standard or best_effort") from None
        if resolved < Tier.from_name(policy.max_tier):
            raise InvalidRequestError("tier", f"tenant {tenant!r} may use {policy.max_tier} at most, not {resolved.label}")
        self._check_shedding(resolved)
        return Admitted(tenant, resolved)

    def tenant(self, tenant: str, api_key: str | None) -> str:
        """The tenant a caller acts as (checks the API key; no shedding: also for requests already running)."""
        if self._api_keys:
            if not api_key:
                raise AuthenticationError("this router needs an API key (metadata authorization: Bearer <key>)")
            owner = self._api_keys.get(api_key)
            if owner is None:
                raise AuthenticationError("unknown API key")
            if tenant and tenant != owner:
                raise InvalidRequestError("tenant", f"the API key belongs to tenant {owner!r}, not {tenant!r}")
            return owner
        tenant = tenant or DEFAULT_TENANT
        if tenant not in self._tenants:
            raise InvalidRequestError("tenant", f"unknown tenant {tenant!r}")
        return tenant

    def sheds(self, tier: Tier) -> bool:
        """Whether a new request of `tier` is refused at the current level."""
        if self.level >= SHED_STANDARD_LEVEL:
            return not (tier == Tier.PREMIUM and self._premium_at_level_4)
        return tier == Tier.BEST_EFFORT and self.level >= SHED_BEST_EFFORT_LEVEL

    def _check_shedding(self, tier: Tier) -> None:
        if not self.sheds(tier):
            return
        if self.level >= SHED_STANDARD_LEVEL:
            # The deepest overload, and it drops only one step per lower_after_s: ask for a longer wait there.
            retry_after_s = 2 * self._retry_after_s
            refused = f"{tier.label} requests are shed, only premium is served" if self._premium_at_level_4 else (
                f"every new request is refused, {tier.label} included"
            )
            message = f"overloaded (degradation level {self.level}): {refused}, while the requests in flight finish; retry in {retry_after_s:g} s"
        else:
            retry_after_s = self._retry_after_s
            message = f"overloaded (degradation level {self.level}): {tier.label} requests are shed; retry in {retry_after_s:g} s"
        raise RequestShedError(message, retry_after_s=retry_after_s)

    # -- tenant limits --------------------------------------------------------------------------
    async def enter(self, tenant: str, request_id: str, prompt_tokens: int) -> None:
        """Counts a new stream of ``tenant``, waiting for a slot of a full router; raises if a limit refuses it.

        Every ``enter`` that returns is matched by one ``leave`` (a request id already in flight here joins its stream).
        """
        ledger = self.ledger
        if ledger.is_open(request_id):
            ledger.hold(tenant, request_id)
            return
        now = self._clock()
        ledger.check(tenant, prompt_tokens, now, queued=self.queue.waiting(tenant))
        if not ledger.full and not len(self.queue):
            ledger.open(tenant, request_id, prompt_tokens, now)
            self._admitted()
            return
        settings = self._queue_settings
        if settings.timeout_s <= 0 or self.queue.waiting(tenant) >= settings.max_per_tenant:
            raise self._queue_error(tenant, waited=False)
        waiter = _Waiter(request_id, prompt_tokens)
        self.queue.push(tenant, waiter)
        self._dispatch()  # a slot may be free with others waiting for it
        try:
            async with asyncio.timeout(settings.timeout_s):
                await waiter.turn
        except TimeoutError:
            self.queue.remove(tenant, waiter)
            if not waiter.admitted:
                raise self._queue_error(tenant, waited=True) from None
            # Its turn came as time ran out: the slot is its own.
        except asyncio.CancelledError:
            self.queue.remove(tenant, waiter)
            if waiter.admitted:
                self.leave(request_id)  # the client left as its turn came: the slot goes to the next
            raise

    def hold(self, tenant: str, request_id: str, *, from_index: int = 0) -> None:
        """Counts a stream of a request already running (a retry, a Resume): never refused, never queued."""
        self.ledger.hold(tenant, request_id, from_index=from_index)

    def leave(self, request_id: str) -> None:
        """A stream that ``enter`` or ``hold`` counted ended; its slot goes to the next waiter."""
        self.ledger.release(request_id)
        self._dispatch()

    def charge(self, request_id: str, index: int) -> None:
        """Token ``index`` of the request reached its client."""
        self.ledger.charge(request_id, index, self._clock())

    def on_peer_report(self, report: UsageReport) -> dict[str, float]:
        """Another router's usage of each tenant (counted against the limits here until it expires); returns the tokens
        it charged since its last report, taken from this router's buckets."""
        return self.ledger.on_peer_report(report, self._clock())

    def usage(self) -> dict[str, TenantUsage]:
        """This router's usage of each tenant, for the other routers."""
        return self.ledger.usage(self._clock(), self.queue.per_tenant())

    def _admitted(self) -> None:
        if self.on_admitted is not None:
            self.on_admitted()

    def _dispatch(self) -> None:
        ledger = self.ledger
        while not ledger.full:
            picked = self.queue.pop(ledger.per_tenant, ledger.weights)
            if picked is None:
                return
            tenant, waiter = picked
            if waiter.turn.done():  # cancelled (timed out, client gone) and not yet out of the queue: not admitted
                continue
            ledger.open(tenant, waiter.request_id, waiter.prompt_tokens, self._clock())
            self._admitted()
            waiter.admitted = True
            waiter.turn.set_result(None)

    def _queue_error(self, tenant: str, *, waited: bool) -> TenantLimitError:
        settings = self._queue_settings
        how = f"waited {settings.timeout_s:g} s for a slot" if waited and settings.timeout_s else "cannot wait for a slot"
        if not waited and settings.timeout_s > 0:
            how = f"has {settings.max_per_tenant} requests waiting already"
        return TenantLimitError(
            f"this router is full ({settings.max_streams} streams) and tenant {tenant!r} {how}; retry in {settings.retry_after_s:g} s",
            tenant=tenant, limit=Limit.QUEUE, retry_after_s=settings.retry_after_s,
        )
