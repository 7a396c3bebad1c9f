"""The control-plane ACL table (who may write which etcd keys, publish and subscribe which NATS subjects) and the etcd
roles and nats-server authorization made from it."""

import re

from phalanx.common import subjects
from phalanx.common.control_plane_acl import (
    ACL,
    ADMIN,
    ALLOWED_IDENTITIES,
    ETCD_READ_PREFIX,
    etcd_permissions,
    nats_authorization,
    nats_tls_config,
    nats_user,
    prefix_range_end,
)
from phalanx.common.tls import CLIENT_IDENTITIES, SERVICE_IDENTITIES
from phalanx.router.records import SESSIONS_PREFIX


def test_every_service_identity_has_a_row_and_tenants_none():
    assert set(ACL) == set(SERVICE_IDENTITIES)
    assert set(ALLOWED_IDENTITIES) == {*SERVICE_IDENTITIES, ADMIN}
    tenants = set(CLIENT_IDENTITIES) - {ADMIN}
    assert tenants and not tenants & set(ALLOWED_IDENTITIES)


def test_every_etcd_key_phalanx_keeps_is_readable_and_owned_by_exactly_one_service():
    prefixes = {v for k, v in vars(subjects).items() if k.endswith(("_PREFIX", "_KEY")) and isinstance(v, str) and v.startswith("/")}
    prefixes.add(SESSIONS_PREFIX)
    for prefix in prefixes:
        assert prefix.startswith(ETCD_READ_PREFIX), prefix
    written = [key for grant in ACL.values() for key in grant.etcd_write]
    # Every key of subjects is written by someone (a prefix, or a key under one); the tensor channels' by several.
    for prefix in prefixes - {subjects.CHANNELS_PREFIX}:
        owners = [k for k in written if prefix == k or (k.endswith("/") and prefix.startswith(k))]
        assert len(owners) == 1, (prefix, owners)
    assert {k for k in written if k == subjects.CHANNELS_PREFIX}


def test_a_worker_writes_only_its_own_keys_and_publishes_only_its_own_subjects():
    worker = ACL["worker"]
    assert subjects.PLANNER_DECISION_KEY not in worker.etcd_write and subjects.WORKERS_PREFIX in worker.etcd_write
    assert subjects.TENANT_USAGE_SUBJECT not in worker.publish
    assert set(worker.publish) == {subjects.KV_EVENTS_ALL, subjects.LOAD_ALL} and not worker.subscribe
    assert subjects.TENANT_USAGE_SUBJECT in ACL["router"].publish


def test_etcd_permissions_read_everything_phalanx_keeps_and_write_prefixes_as_ranges():
    permissions = etcd_permissions("health")
    assert permissions[0].key == "/phalanx/v1/" and permissions[0].range_end == "/phalanx/v10" and not permissions[0].write
    by_key = {p.key: p for p in permissions[1:]}
    assert by_key[subjects.HEALTH_PREFIX].range_end == prefix_range_end(subjects.HEALTH_PREFIX) == "/phalanx/v1/health0"
    assert by_key[subjects.HEALTH_LEADER_KEY].range_end == ""  # one key, not a prefix
    assert all(p.write for p in permissions[1:])


def test_the_nats_authorization_maps_uri_sans_to_users_with_their_subjects():
    config = nats_authorization()
    users = re.findall(r'"user": "([^"]+)"', config)
    assert users == [nats_user(i) for i in ALLOWED_IDENTITIES] and nats_user("router") == "spiffe://phalanx/router"
    assert "spiffe://phalanx/client" not in config
    worker_line = next(line for line in config.splitlines() if nats_user("worker") + '"' in line)
    assert '"publish": {"allow": ["phalanx.kv.*", "phalanx.load.*"]}' in worker_line
    assert '"subscribe": {"deny": [">"]}' in worker_line
    admin_line = next(line for line in config.splitlines() if nats_user(ADMIN) + '"' in line)
    assert "permissions" not in admin_line
    tls = nats_tls_config(cert_file="/c/tls.crt", key_file="/c/tls.key", ca_file="/c/ca.crt")
    assert "verify_and_map: true" in tls and tls.endswith(config)
