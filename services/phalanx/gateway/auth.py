"""Who is calling, as which tenant and tier: API keys in the router's format. Pure logic, no I/O.

A key maps to a tenant; the tenant's policy gives its default and highest tier.
A request may ask for a lower tier than that (``X-Phalanx-Tier`` or the body's
``metadata.tier``), never a higher one. Without keys the gateway is open, as
the router is: requests carry no tenant (the router's ``default``, or the
tenant of the gateway's own router key). What a request does not ask for is
left to the router, whose admission applies the same policies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from phalanx.gateway.errors import GatewayError, bad_request
from phalanx.router.admission import DEFAULT_TENANT, Tier
from phalanx.router.config import TenantPolicy

__all__ = ["Caller", "KeyRing"]

TIER_HEADER = "x-phalanx-tier"
TIER_METADATA = "metadata.tier"


@dataclass(frozen=True)
class Caller:
    """What the router gets: the tenant (None: the key's or default), the tier (None: the tenant's default) and the key."""

    tenant: str | None
    tier: Tier | None
    api_key: str | None


class KeyRing:
    """The gateway's API keys and tenant policies."""

    def __init__(self, tenants: Mapping[str, TenantPolicy], api_keys: Mapping[str, str], *, router_api_key: str = "") -> None:
        self._tenants = dict(tenants)
        self._api_keys = dict(api_keys)
        self._router_api_key = router_api_key or None

    @property
    def open(self) -> bool:
        return not self._api_keys

    def authenticate(self, authorization: str | None) -> tuple[str | None, str | None]:
        """The tenant (None when open) and forwarded key of an ``Authorization`` header value; 401 for a missing or unknown key."""
        if self.open:
            return None, self._router_api_key
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise GatewayError(
                401, "this gateway needs an API key: send `Authorization: Bearer <key>`", kind="authentication_error", code="missing_api_key"
            )
        key = token.strip()
        tenant = self._api_keys.get(key)
        if tenant is None:
            raise GatewayError(401, "unknown API key", kind="authentication_error", code="invalid_api_key")
        return tenant, key

    def tier(self, tenant: str | None, *, header_tier: str | None, metadata_tier: str | None) -> Tier | None:
        """The tier a request asked for (header first, then metadata); None: none asked. 400 above the tenant's highest."""
        asked, param = (header_tier, TIER_HEADER) if header_tier else (metadata_tier, TIER_METADATA)
        if not asked:
            return None
        try:
            tier = Tier.from_name(asked.strip())
        except KeyError:
            raise bad_request(param, f"unknown tier {asked!r}: use premium, standard or best_effort") from None
        name = tenant or DEFAULT_TENANT
        highest = Tier.from_name((self._tenants.get(name) or TenantPolicy()).max_tier)
        if tier < highest:  # a lower value is a higher priority
            raise bad_request(param, f"tenant {name!r} may use {highest.label} at most, not {tier.label}")
        return tier

    def admit(self, authorization: str | None, *, header_tier: str | None = None, metadata_tier: str | None = None) -> Caller:
        """``authenticate`` and ``tier`` in one."""
        tenant, key = self.authenticate(authorization)
        return Caller(tenant, self.tier(tenant, header_tier=header_tier, metadata_tier=metadata_tier), key)
