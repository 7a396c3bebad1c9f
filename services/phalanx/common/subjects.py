"""The one place that builds NATS subjects and etcd keys.

A worker id becomes one NATS subject token and one etcd key segment, so it
is restricted to ``[A-Za-z0-9_-]``: a ``.`` would split the subject, ``*``
or ``>`` would turn a publish into a wildcard, and ``/`` would nest keys.
"""

from __future__ import annotations

import hashlib
import math
import re

from phalanx.common.errors import InvalidRequestError

__all__ = [
    "CANARY_PREFIX",
    "DEGRADATION_KEY",
    "DEGRADATION_PREFIX",
    "DEGRADATION_SUBJECT",
    "ENCODERS_PREFIX",
    "HEALTH_EVENTS_ALL",
    "HEALTH_EVENTS_PREFIX",
    "HEALTH_LEADER_KEY",
    "HEALTH_PREFIX",
    "HEALTH_REPORTS_ALL",
    "HEALTH_REPORTS_PREFIX",
    "QUARANTINE_PREFIX",
    "REQUESTS_PREFIX",
    "ROUTERS_PREFIX",
    "PLANNER_CAPACITY_KEY",
    "PLANNER_CAPACITY_PREFIX",
    "KV_EVENTS_ALL",
    "KV_EVENTS_PREFIX",
    "LOAD_ALL",
    "LOAD_PREFIX",
    "SPARES_PREFIX",
    "TENANT_USAGE_SUBJECT",
    "WORKERS_PREFIX",
    "canary_key",
    "kv_events_subject",
    "health_events_subject",
    "health_key",
    "health_report_subject",
    "load_subject",
    "request_key",
    "subject_kind",
    "router_key",
    "spare_key",
    "validate_request_id",
    "validate_worker_id",
    "worker_id_from_key",
    "worker_id_from_subject",
    "worker_key",
    "expert_worker_key",
]

KV_EVENTS_PREFIX = "phalanx.kv."
LOAD_PREFIX = "phalanx.load."
KV_EVENTS_ALL = KV_EVENTS_PREFIX + "*"
LOAD_ALL = LOAD_PREFIX + "*"
# Health transitions (WorkerHealthRecord), published by the health service after its etcd write.
HEALTH_EVENTS_PREFIX = "phalanx.health."
HEALTH_EVENTS_ALL = HEALTH_EVENTS_PREFIX + "*"
# Broken worker streams seen by routers (WorkerStreamBroken); the health service probes at once.
HEALTH_REPORTS_PREFIX = "phalanx.health_report."
HEALTH_REPORTS_ALL = HEALTH_REPORTS_PREFIX + "*"
# DegradationState changes, published after the etcd write of DEGRADATION_KEY.
DEGRADATION_SUBJECT = "phalanx.degradation"
# Each router's per-tenant usage (TenantUsageReport), every tenant_usage_interval_s: the fleet's tenant limits.
TENANT_USAGE_SUBJECT = "phalanx.tenant_usage"
WORKERS_PREFIX = "/phalanx/v1/workers/"
ROUTERS_PREFIX = "/phalanx/v1/routers/"
HEALTH_PREFIX = "/phalanx/v1/health/"
REQUESTS_PREFIX = "/phalanx/v1/requests/"
# Quarantined request fingerprints, each under a lease of the quarantine's TTL: written and followed by every router.
QUARANTINE_PREFIX = "/phalanx/v1/quarantine/"
DEGRADATION_PREFIX = "/phalanx/v1/degradation/"
DEGRADATION_KEY = DEGRADATION_PREFIX + "global"
CANARY_PREFIX = "/phalanx/v1/canary/"
HEALTH_LEADER_KEY = "/phalanx/v1/health-leader"
# Tensor-channel rendezvous endpoints: <prefix><endpoint id> -> JSON {"host", "port", "backend", ...}, leased.
CHANNELS_PREFIX = "/phalanx/v1/channels/"
# Checkpoint store instances: <prefix><store id> -> JSON CheckpointStoreRegistration, leased.
CHECKPOINT_STORES_PREFIX = "/phalanx/v1/checkpoint-stores/"
# Encoder pool instances: <prefix><encoder id> -> JSON EncoderRegistration (with its backlog), leased.
ENCODERS_PREFIX = "/phalanx/v1/encoders/"
# Migration service instances: <prefix><id> -> JSON MigrationRegistration, leased.
MIGRATIONS_PREFIX = "/phalanx/v1/migration/"
# A request moved to another worker (MigrationEvent): routers relaying it re-attach there.
MIGRATION_EVENTS_SUBJECT = "phalanx.migrated"
# The planner (docs/planner.md, "Service"): its leadership key (JSON PlannerLeader), the decision it asks an
# orchestrator to carry out (JSON PlannerDecision, planner.connectors.DecisionRecord), the orchestrator's
# acknowledgement (JSON PlannerAck) and an operator's target (JSON PlannerTarget, `phalanx planner set-target`).
PLANNER_PREFIX = "/phalanx/v1/planner/"
PLANNER_LEADER_KEY = PLANNER_PREFIX + "leader"
PLANNER_DECISION_KEY = PLANNER_PREFIX + "decision"
PLANNER_ACK_KEY = PLANNER_PREFIX + "ack"
PLANNER_TARGET_KEY = PLANNER_PREFIX + "target"
# The planner's capacity-vs-demand view (JSON PlannerCapacityView); health's degradation watches it. A prefix of its
# own: the other keys under PLANNER_PREFIX are not PlannerCapacityView messages.
PLANNER_CAPACITY_PREFIX = "/phalanx/v1/planner-capacity/"
PLANNER_CAPACITY_KEY = PLANNER_CAPACITY_PREFIX + "global"
# Hot spares (JSON HotSpareRecord per worker): registered workers routers do not route to. The orchestrator
# writes the key before it starts the spare; the planner deletes it to promote the spare.
SPARES_PREFIX = "/phalanx/v1/spares/"
# Disaggregated MoE (docs/moe.md): expert workers, <prefix><id> -> JSON ExpertWorkerRegistration, leased; the expert
# routing table (JSON ExpertRoutingTable) that the ERT manager leader writes and every attention worker watches.
EXPERT_WORKERS_PREFIX = "/phalanx/v1/expert-workers/"
MOE_PREFIX = "/phalanx/v1/moe/"
ERT_KEY = MOE_PREFIX + "ert"
ERT_LEADER_KEY = "/phalanx/v1/ert-leader"

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


def check_send_request(target_endpoint: str, channel_id: str, timeout_s: float) -> None:
    """A peer's ask to be sent tensors over a channel (KvSource.SendKv, SendEmbeddings): InvalidRequestError if malformed."""
    if not target_endpoint:
        raise InvalidRequestError("target_endpoint", "required: the tensor-channel endpoint id of the target")
    try:
        validate_request_id(channel_id)  # channel ids share the request ids' alphabet
    except ValueError:
        raise InvalidRequestError("channel_id", "need 1-128 characters of [A-Za-z0-9_.:-]") from None
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InvalidRequestError("timeout_s", "must be a finite number of seconds >= 0 (0: the sender's default)")


def kv_events_subject(worker_id: str) -> str:
    """Subject of a worker's KvEvent stream: ``phalanx.kv.<worker_id>``."""
    return KV_EVENTS_PREFIX + validate_worker_id(worker_id)


def load_subject(worker_id: str) -> str:
    """Subject of a worker's LoadReport stream: ``phalanx.load.<worker_id>``."""
    return LOAD_PREFIX + validate_worker_id(worker_id)


def health_events_subject(worker_id: str) -> str:
    """Subject of a worker's health transitions: ``phalanx.health.<worker_id>``."""
    return HEALTH_EVENTS_PREFIX + validate_worker_id(worker_id)


def health_report_subject(worker_id: str) -> str:
    """Subject on which routers report a worker's broken stream: ``phalanx.health_report.<worker_id>``."""
    return HEALTH_REPORTS_PREFIX + validate_worker_id(worker_id)


def canary_key(model_version: str, compute_dtype: str) -> str:
    """etcd key of a model version's canary calibration in one dtype: ``/phalanx/v1/canary/<hex digest of both>``."""
    # Versions hold paths and '@': a digest keeps the key one segment.
    return CANARY_PREFIX + hashlib.sha256(f"{model_version}\0{compute_dtype}".encode()).hexdigest()[:32]


def worker_key(worker_id: str) -> str:
    """etcd key of a worker's registration: ``/phalanx/v1/workers/<worker_id>``."""
    return WORKERS_PREFIX + validate_worker_id(worker_id)


def expert_worker_key(worker_id: str) -> str:
    """etcd key of an expert worker's registration: ``/phalanx/v1/expert-workers/<worker_id>``."""
    return EXPERT_WORKERS_PREFIX + validate_worker_id(worker_id)


def router_key(router_id: str) -> str:
    """etcd key of a router's registration: ``/phalanx/v1/routers/<router_id>``."""
    return ROUTERS_PREFIX + validate_worker_id(router_id)


def health_key(worker_id: str) -> str:
    """etcd key of a worker's health record: ``/phalanx/v1/health/<worker_id>``."""
    return HEALTH_PREFIX + validate_worker_id(worker_id)


def spare_key(worker_id: str) -> str:
    """etcd key marking a worker as a hot spare: ``/phalanx/v1/spares/<worker_id>``."""
    return SPARES_PREFIX + validate_worker_id(worker_id)


def request_key(request_id: str) -> str:
    """etcd key of a request's routing record: ``/phalanx/v1/requests/<request_id>``."""
    return REQUESTS_PREFIX + validate_request_id(request_id)


def subject_kind(subject: str) -> str:
    """A metric label for a subject: ``kv``, ``load``, ``health``, ``health_report``, or the subject with no worker id."""
    for prefix in (KV_EVENTS_PREFIX, LOAD_PREFIX, HEALTH_EVENTS_PREFIX, HEALTH_REPORTS_PREFIX):
        if subject.startswith(prefix):
            return prefix[len("phalanx.") : -1]
    return subject if subject in (DEGRADATION_SUBJECT, MIGRATION_EVENTS_SUBJECT, TENANT_USAGE_SUBJECT) else "other"


def worker_id_from_subject(subject: str) -> str:
    """The worker id in a per-worker subject (``phalanx.kv.<id>``, ``phalanx.load.<id>``, ``phalanx.health.<id>`` …)."""
    for prefix in (KV_EVENTS_PREFIX, LOAD_PREFIX, HEALTH_EVENTS_PREFIX, HEALTH_REPORTS_PREFIX):
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
