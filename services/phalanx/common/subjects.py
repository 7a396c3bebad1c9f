"""The one place that builds NATS subjects and etcd keys.

A worker id becomes one NATS subject token and one etcd key segment, so it
is restricted to ``[A-Za-z0-9_-]``: a ``.`` would split the subject, ``*``
or ``>`` would turn a publish into a wildcard, and ``/`` would nest keys.
"""

from __future__ import annotations

import re

__all__ = [
    "KV_EVENTS_ALL",
    "KV_EVENTS_PREFIX",
    "LOAD_ALL",
    "LOAD_PREFIX",
    "WORKERS_PREFIX",
    "kv_events_subject",
    "load_subject",
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

_WORKER_ID = re.compile(r"[A-Za-z0-9_-]+")


def validate_worker_id(worker_id: str) -> str:
    """Return ``worker_id`` unchanged, or raise ValueError if it is not a safe name."""
    if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"invalid worker id {worker_id!r}: need 1+ characters of [A-Za-z0-9_-]")
    return worker_id


def kv_events_subject(worker_id: str) -> str:
    """Subject of a worker's KvEvent stream: ``phalanx.kv.<worker_id>``."""
    return KV_EVENTS_PREFIX + validate_worker_id(worker_id)


def load_subject(worker_id: str) -> str:
    """Subject of a worker's LoadReport stream: ``phalanx.load.<worker_id>``."""
    return LOAD_PREFIX + validate_worker_id(worker_id)


def worker_key(worker_id: str) -> str:
    """etcd key of a worker's registration: ``/phalanx/v1/workers/<worker_id>``."""
    return WORKERS_PREFIX + validate_worker_id(worker_id)


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
