"""The one place that builds NATS subjects and etcd keys.

A worker id becomes one NATS subject token and one etcd key segment, so it
is restricted to ``[A-Za-z0-9_-]``: a ``.`` would split the subject, ``*``
or ``>`` would turn a publish into a wildcard, and ``/`` would nest keys.
"""

from __future__ import annotations

import re

__all__ = [
    "DEGRADATION_KEY",
    "DEGRADATION_PREFIX",
    "HEALTH_PREFIX",
    "REQUESTS_PREFIX",
    "ROUTERS_PREFIX",
    "KV_EVENTS_ALL",
    "KV_EVENTS_PREFIX",
    "LOAD_ALL",
    "LOAD_PREFIX",
    "WORKERS_PREFIX",
    "kv_events_subject",
    "health_key",
    "load_subject",
    "request_key",
    "router_key",
    "validate_request_id",
    "validate_worker_id",
    "worker_id_from_key",
    "worker_id_from_subject",
    "worker_key",
]

KV_EVENTS_PREFIX = "phalanx.kv."
LOAD_PREFIX = "phalanx.load."
KV_EVENTS_ALL = KV_EVENTS_PREFIX + "*"
LOAD_ALL = LOAD_PREFIX + "*"
WORKERS_PREFIX = "/phalanx/v1/workers/"
ROUTERS_PREFIX = "/phalanx/v1/routers/"
HEALTH_PREFIX = "/phalanx/v1/health/"
REQUESTS_PREFIX = "/phalanx/v1/requests/"
DEGRADATION_PREFIX = "/phalanx/v1/degradation/"
DEGRADATION_KEY = DEGRADATION_PREFIX + "global"

_WORKER_ID = re.compile(r"[A-Za-z0-9_-]+")
# Client-chosen, so a little wider (UUIDs, "tenant:job.42"), but never "/".
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def validate_worker_id(worker_id: str) -> str:
    """Return ``worker_id`` unchanged, or raise ValueError if it is not a safe name."""
    if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"invalid worker id {worker_id!r}: need 1+ characters of [A-Za-z0-9_-]")
    return worker_id


def validate_request_id(request_id: str) -> str:
    """Return ``request_id`` unchanged, or raise ValueError if it is not 1-128 of [A-Za-z0-9_.:-]."""
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise ValueError(f"invalid request id {request_id!r}: need 1-128 characters of [A-Za-z0-9_.:-]")
    return request_id


def kv_events_subject(worker_id: str) -> str:
    """Subject of a worker's KvEvent stream: ``phalanx.kv.<worker_id>``."""
    return KV_EVENTS_PREFIX + validate_worker_id(worker_id)


def load_subject(worker_id: str) -> str:
    """Subject of a worker's LoadReport stream: ``phalanx.load.<worker_id>``."""
    return LOAD_PREFIX + validate_worker_id(worker_id)


def worker_key(worker_id: str) -> str:
    """etcd key of a worker's registration: ``/phalanx/v1/workers/<worker_id>``."""
    return WORKERS_PREFIX + validate_worker_id(worker_id)


def router_key(router_id: str) -> str:
    """etcd key of a router's registration: ``/phalanx/v1/routers/<router_id>``."""
    return ROUTERS_PREFIX + validate_worker_id(router_id)


def health_key(worker_id: str) -> str:
    """etcd key of a worker's health record: ``/phalanx/v1/health/<worker_id>``."""
    return HEALTH_PREFIX + validate_worker_id(worker_id)


def request_key(request_id: str) -> str:
    """etcd key of a request's routing record: ``/phalanx/v1/requests/<request_id>``."""
    return REQUESTS_PREFIX + validate_request_id(request_id)


def worker_id_from_subject(subject: str) -> str:
    """The worker id in a ``phalanx.kv.<id>`` or ``phalanx.load.<id>`` subject."""
    for prefix in (KV_EVENTS_PREFIX, LOAD_PREFIX):
        if subject.startswith(prefix):
            return validate_worker_id(subject[len(prefix) :])
    raise ValueError(f"not a per-worker subject: {subject!r}")


def worker_id_from_key(key: str | bytes) -> str:
    """The worker id in a ``/phalanx/v1/workers/<id>`` etcd key."""
    if isinstance(key, bytes):
        key = key.decode()
    if not key.startswith(WORKERS_PREFIX):
        raise ValueError(f"not a worker key: {key!r}")
    return validate_worker_id(key[len(WORKERS_PREFIX) :])
