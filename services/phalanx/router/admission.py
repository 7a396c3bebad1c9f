"""Who may send what, and what the router sheds under degradation. Pure logic, no I/O.

The health service publishes a degradation level (etcd, DegradationState;
see phalanx.health.degradation). Level 2 sheds best_effort; level 4 rejects
every new request, premium included, unless the router is configured to
serve premium at level 4 (PHALANX_ROUTER_PREMIUM_AT_LEVEL_4: premium is then
served as long as any worker can take it). Levels 1 and 3 act on workers and
SLOs, not on admission. Only new requests are judged: streams already
running, their resumes and their handoffs always finish. Shed requests get
RESOURCE_EXHAUSTED with a retry hint: the system is overloaded, not broken.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from phalanx.common.errors import AuthenticationError, InvalidRequestError, RequestShedError
from phalanx.router.config import TenantPolicy

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


class Admission:
    """Resolves a request's tenant and tier and applies the degradation level."""

    def __init__(
        self, tenants: dict[str, TenantPolicy], api_keys: dict[str, str], *, retry_after_s: float = 1.0,
        premium_at_level_4: bool = False,
    ) -> None:
        self._tenants = dict(tenants)
        self._api_keys = dict(api_keys)
        self._retry_after_s = retry_after_s
        self._premium_at_level_4 = premium_at_level_4
        self.level = 0

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
