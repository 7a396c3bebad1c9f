"""Who may do what in etcd and NATS: the one table both servers' authorization is made from.

With the control plane on mutual TLS, etcd takes a client's user name from its certificate's CN and nats-server
(``verify_and_map``) from its URI SAN ``spiffe://phalanx/<name>``; both are the Phalanx identity (``phalanx certs
init``, cert-manager). Only the identities listed here get in: a tenant's ``client`` certificate, or any other name
the CA issued, is refused by both (the router and the gateway stay the only doors for tenants).

Reads are fleet-wide for every service (every key under ``/phalanx/v1/``: the directories, health records, the
planner's and the ERT's keys are what services watch); writes, publishes and subscriptions are each identity's own.
``admin`` (an operator, the ``phalanx up`` supervisor) has etcd's root role and every subject. Pure: no I/O;
``phalanx.launch.control_plane_auth`` applies it to etcd, ``NatsServer`` and the compose file write the NATS part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from phalanx.common.subjects import (
    CANARY_PREFIX,
    CHANNELS_PREFIX,
    CHECKPOINT_STORES_PREFIX,
    DEGRADATION_PREFIX,
    DEGRADATION_SUBJECT,
    ENCODERS_PREFIX,
    ERT_LEADER_KEY,
    EXPERT_WORKERS_PREFIX,
    HEALTH_EVENTS_ALL,
    HEALTH_LEADER_KEY,
    HEALTH_PREFIX,
    HEALTH_REPORTS_ALL,
    KV_EVENTS_ALL,
    LOAD_ALL,
    MIGRATION_EVENTS_SUBJECT,
    MIGRATIONS_PREFIX,
    MOE_PREFIX,
    PLANNER_CAPACITY_PREFIX,
    PLANNER_PREFIX,
    QUARANTINE_PREFIX,
    REQUESTS_PREFIX,
    ROUTERS_PREFIX,
    SPARES_PREFIX,
    TENANT_USAGE_SUBJECT,
    WORKERS_PREFIX,
)
from phalanx.common.tls import SERVICE_IDENTITIES, SPIFFE_PREFIX

__all__ = [
    "ACL",
    "ADMIN",
    "ALLOWED_IDENTITIES",
    "ETCD_READ_PREFIX",
    "ETCD_MEMBER_USER",
    "ETCD_ROOT_USER",
    "EtcdPermission",
    "Grant",
    "etcd_permissions",
    "etcd_role",
    "nats_authorization",
    "nats_tls_config",
    "nats_user",
    "prefix_range_end",
]

ADMIN = "admin"
# etcd refuses to enable auth without a user named root holding the root role; it is never a certificate's name.
ETCD_ROOT_USER = "root"
# The members' own certificate (CN etcd), which their healthchecks present: a user with no role, so a check's read is
# refused (etcdctl counts that as healthy) without etcd logging an error for an unknown user every time.
ETCD_MEMBER_USER = "etcd"
# Every key Phalanx keeps is under this prefix: what every service may read and watch.
ETCD_READ_PREFIX = "/phalanx/v1/"
# The routers' session leases (phalanx.router.records.SESSIONS_PREFIX; named here so this module imports no router).
_ROUTER_SESSIONS_PREFIX = "/phalanx/v1/router-sessions/"
# The gateways' stored responses, their relays and sessions (phalanx.gateway.response_store.PREFIX).
_GATEWAY_PREFIX = "/phalanx/v1/gateway/"


@dataclass(frozen=True)
class Grant:
    """One identity's rights beyond reading: etcd keys (a name ending in ``/`` is a prefix, any other one key) it may
    write and delete; NATS subjects (wildcards allowed) it may publish to and subscribe to."""

    etcd_write: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()


# Every service identity of phalanx.common.tls.SERVICE_IDENTITIES has a row (a unit test checks it), also those that
# use neither server: a row grants nothing it does not list.
ACL: dict[str, Grant] = {
    # Registers itself and its tensor-channel endpoint; publishes its KV residency and load.
    "worker": Grant(etcd_write=(WORKERS_PREFIX, CHANNELS_PREFIX), publish=(KV_EVENTS_ALL, LOAD_ALL)),
    "expert-worker": Grant(etcd_write=(EXPERT_WORKERS_PREFIX, CHANNELS_PREFIX)),
    # Its registration, the request records and session leases, quarantined fingerprints; reports broken worker streams and tenant usage.
    "router": Grant(
        etcd_write=(ROUTERS_PREFIX, REQUESTS_PREFIX, _ROUTER_SESSIONS_PREFIX, QUARANTINE_PREFIX),
        publish=(HEALTH_REPORTS_ALL, TENANT_USAGE_SUBJECT),
        subscribe=(KV_EVENTS_ALL, LOAD_ALL, HEALTH_EVENTS_ALL, DEGRADATION_SUBJECT, MIGRATION_EVENTS_SUBJECT, TENANT_USAGE_SUBJECT),
    ),
    # The Responses API's stored responses, which gateway relays each, and the gateways' sessions.
    "gateway": Grant(etcd_write=(_GATEWAY_PREFIX,)),
    # Health records, the degradation level, canary calibrations, its leadership.
    "health": Grant(
        etcd_write=(HEALTH_PREFIX, DEGRADATION_PREFIX, CANARY_PREFIX, HEALTH_LEADER_KEY),
        publish=(HEALTH_EVENTS_ALL, DEGRADATION_SUBJECT),
        subscribe=(LOAD_ALL, HEALTH_REPORTS_ALL),
    ),
    "migration": Grant(etcd_write=(MIGRATIONS_PREFIX,), publish=(MIGRATION_EVENTS_SUBJECT,), subscribe=(LOAD_ALL, HEALTH_EVENTS_ALL)),
    "checkpoint-store": Grant(etcd_write=(CHECKPOINT_STORES_PREFIX, CHANNELS_PREFIX)),
    # Its leadership, decision, acknowledgements and targets (PLANNER_PREFIX), the capacity view, spare promotion.
    "planner": Grant(etcd_write=(PLANNER_PREFIX, PLANNER_CAPACITY_PREFIX, SPARES_PREFIX)),
    "ert-manager": Grant(etcd_write=(MOE_PREFIX, ERT_LEADER_KEY)),
    "encoder-pool": Grant(etcd_write=(ENCODERS_PREFIX, CHANNELS_PREFIX)),
    "memory-service": Grant(),
}

# Who gets into etcd and NATS at all.
ALLOWED_IDENTITIES: tuple[str, ...] = (*SERVICE_IDENTITIES, ADMIN)


@dataclass(frozen=True)
class EtcdPermission:
    """An etcd role permission: ``key`` alone, or the range ``[key, range_end)``; ``write`` False is READ, True WRITE."""

    key: str
    range_end: str
    write: bool


def prefix_range_end(prefix: str) -> str:
    """etcd's end of the range of every key starting with ``prefix`` (its last byte plus one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def etcd_role(identity: str) -> str:
    """The etcd role holding ``identity``'s permissions (the user of the same name has it)."""
    return f"phalanx-{identity}"


def etcd_permissions(identity: str) -> list[EtcdPermission]:
    """Read on everything Phalanx keeps, write on what ``identity`` owns; KeyError for an identity without a row."""
    grant = ACL[identity]
    permissions = [EtcdPermission(ETCD_READ_PREFIX, prefix_range_end(ETCD_READ_PREFIX), write=False)]
    for key in grant.etcd_write:
        permissions.append(EtcdPermission(key, prefix_range_end(key) if key.endswith("/") else "", write=True))
    return permissions


def nats_user(identity: str) -> str:
    """The NATS user name nats-server maps ``identity``'s certificate to (its URI SAN)."""
    return SPIFFE_PREFIX + identity


def _permissions(allowed: tuple[str, ...]) -> dict[str, list[str]]:
    return {"allow": list(allowed)} if allowed else {"deny": [">"]}


def nats_authorization() -> str:
    """nats-server's ``authorization`` block: one user per allowed identity, mapped from the client certificate (the
    ``tls`` block needs ``verify_and_map: true``); admin unrestricted, every service its own subjects."""
    users = []
    for identity in ALLOWED_IDENTITIES:
        user: dict[str, object] = {"user": nats_user(identity)}
        if identity != ADMIN:
            grant = ACL[identity]
            user["permissions"] = {"publish": _permissions(grant.publish), "subscribe": _permissions(grant.subscribe)}
        users.append("    " + json.dumps(user))
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def nats_tls_config(*, cert_file: str | Path, key_file: str | Path, ca_file: str | Path, timeout_s: float = 5) -> str:
    """nats-server's ``tls`` block (a client certificate of the CA required, its URI SAN the user) and the
    ``authorization`` block of the ACL table: a config file's text."""
    return (
        "tls {\n"
        f"  cert_file: {json.dumps(str(cert_file))}\n"
        f"  key_file: {json.dumps(str(key_file))}\n"
        f"  ca_file: {json.dumps(str(ca_file))}\n"
        "  verify_and_map: true\n"
        f"  timeout: {timeout_s:g}\n"
        "}\n"
        + nats_authorization()
    )
