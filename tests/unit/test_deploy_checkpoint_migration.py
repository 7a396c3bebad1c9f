"""The checkpoint store and the migration service are deployed by the Helm chart as compose runs them.

Static checks of deploy/helm/phalanx: every PHALANX_CHECKPOINT_* / PHALANX_MIGRATION_* variable
the chart sets is a real setting (MigrationConfig ignores unknown ones, so a typo would pass
silently), the probes ask the services each process registers with grpc.health.v1, pods
advertise their pod IP, the spill directory is the emptyDir, and each part can be turned
off. helm, where installed, renders the chart and checks more.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helm_python import HelmRenderError

from phalanx._proto import checkpoint_pb2, migration_pb2
from phalanx.checkpoint_store.config import CheckpointStoreConfig
from phalanx.migration.config import MigrationConfig
from phalanx.testing import helm
from phalanx.testing.settings import unknown_settings

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CHART = DEPLOY / "helm" / "phalanx"
TEMPLATES = CHART / "templates"
# What the processes register with grpc.health.v1 (their SERVICE_NAME constants are made the same way).
STORE_SERVICE = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name
MIGRATION_SERVICE = migration_pb2.DESCRIPTOR.services_by_name["MigrationService"].full_name
SPILL_DIR = "/var/tmp/phalanx-spill"
_SETTING = re.compile(r"PHALANX_(CHECKPOINT|MIGRATION)_[A-Z0-9_]+")
_ENV = re.compile(r"- name: (PHALANX_[A-Z0-9_]+)\n\s+(?:value: (.+)|valueFrom:\n\s+fieldRef:\n\s+fieldPath: (\S+))")
_BLOCK = re.compile(r"\{\{-?\s*(if|with|range|define)\b")
_END = re.compile(r"\{\{-?\s*end\s*-?\}\}")
_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _unknown_settings(names) -> list[str]:
    return unknown_settings(names, {"CHECKPOINT": CheckpointStoreConfig, "MIGRATION": MigrationConfig})


def _load(path: Path):
    return yaml.safe_load(path.read_text())


def _values() -> dict:
    return _load(CHART / "values.yaml")


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def _env(template: str) -> dict[str, str]:
    """name -> the raw `value:` expression, or `fieldRef:<path>`."""
    return {m.group(1): m.group(2) or f"fieldRef:{m.group(3)}" for m in _ENV.finditer(template)}


def _bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]i)?", str(quantity))
    assert match, f"unsupported quantity {quantity!r}"
    return int(match.group(1)) * _QUANTITY.get(match.group(2) or "", 1)


def _compose_env(service: str) -> dict:
    return _load(DEPLOY / "compose" / "docker-compose.yml")["services"][service]["environment"]


# -- values ---------------------------------------------------------------------


def test_values_enable_both_with_one_migration_replica_that_acts_on_dead_workers():
    values = _values()
    store, migration = values["checkpointStore"], values["migration"]
    assert store["enabled"] is True and migration["enabled"] is True
    assert "replicas" not in store  # fixed at one in the template
    assert migration["replicas"] == 1 and migration["triggerOnDead"] is True
    assert migration["strategy"] in MigrationConfig.model_fields["strategy"].annotation.__args__
    assert migration["transport"] in ("channel", "grpc")
    ports = {values[part]["metricsPort"] for part in ("worker", "router", "health", "checkpointStore", "migration")}
    assert len(ports) == 5  # one scrape port each, as in compose


def test_store_memory_limit_fits_in_the_pod_memory_limit():
    store = _values()["checkpointStore"]
    kv = store["memoryLimitBytes"]
    assert isinstance(kv, int) and kv > 0
    assert CheckpointStoreConfig(memory_limit_bytes=kv).memory_limit_bytes == kv
    limit = _bytes(store["resources"]["limits"]["memory"])
    assert limit >= kv + (1 << 30), "the pod needs room for the process and incoming segments beyond the KV"
    # Requests = limits: the kubelet evicts pods over their requests first, and this one holds every checkpoint.
    assert _bytes(store["resources"]["requests"]["memory"]) == limit
    assert _bytes(store["spill"]["sizeLimit"]) > 0


# -- checkpoint store -----------------------------------------------------------


def test_store_deployment_runs_one_replica_recreated_with_real_settings():
    deployment = _template("checkpoint-store-deployment.yaml")
    assert 'args: ["checkpoint-store"]' in deployment
    assert "replicas: 1\n" in deployment and "type: Recreate" in deployment
    assert "enableServiceLinks: false" in deployment
    names = {name for name in _env(deployment) if _SETTING.fullmatch(name)}
    assert {"PHALANX_CHECKPOINT_STORE_ID", "PHALANX_CHECKPOINT_MEMORY_LIMIT_BYTES", "PHALANX_CHECKPOINT_SPILL_DIR"} <= names
    assert _unknown_settings(names) == []
    env = _env(deployment)
    assert env["PHALANX_CHECKPOINT_STORE_ID"] == "fieldRef:metadata.name"
    # The tensor-channel endpoint binds the advertised host: it must be the pod's own IP.
    assert env["PHALANX_CHECKPOINT_ADVERTISE_HOST"] == "fieldRef:status.podIP"
    assert env["PHALANX_CHECKPOINT_HOST"] == '"0.0.0.0"'
    assert env["PHALANX_CHECKPOINT_PORT"] == env["PHALANX_PROBE_PORT"] == "{{ .Values.checkpointStore.grpcPort | quote }}"
    assert env["PHALANX_CHECKPOINT_METRICS_PORT"] == "{{ .Values.checkpointStore.metricsPort | quote }}"
    # Helm reads values numbers as float64: without int64, 1 GiB would render as 1.073741824e+09.
    assert env["PHALANX_CHECKPOINT_MEMORY_LIMIT_BYTES"] == "{{ .Values.checkpointStore.memoryLimitBytes | int64 | quote }}"
    assert env["PHALANX_PROBE_SERVICE"] == STORE_SERVICE == _compose_env("checkpoint-store")["PHALANX_PROBE_SERVICE"]
    assert "PHALANX_ETCD_ENDPOINT" in env and "PHALANX_NATS_URL" not in env  # the store uses no NATS


def test_store_spills_to_a_size_limited_empty_dir():
    deployment = _template("checkpoint-store-deployment.yaml")
    assert _env(deployment)["PHALANX_CHECKPOINT_SPILL_DIR"] == SPILL_DIR
    assert f"- name: spill\n              mountPath: {SPILL_DIR}" in deployment
    assert "- name: spill\n          emptyDir:\n            sizeLimit: {{ .Values.checkpointStore.spill.sizeLimit }}" in deployment


def test_store_probes_and_ports_follow_the_other_services():
    deployment = _template("checkpoint-store-deployment.yaml")
    assert 'command: ["phalanx-health-probe", "--alive"]' in deployment  # startup and liveness
    assert 'command: ["phalanx-health-probe"]' in deployment  # readiness: SERVING
    assert 'prometheus.io/port: {{ .Values.checkpointStore.metricsPort | quote }}' in deployment
    assert "containerPort: {{ .Values.checkpointStore.grpcPort }}" in deployment
    assert "containerPort: {{ .Values.checkpointStore.metricsPort }}" in deployment
    service = _template("checkpoint-store-service.yaml")
    assert "clusterIP: None" in service and "name: grpc" in service and "name: metrics" in service


# -- migration ------------------------------------------------------------------


def test_migration_deployment_sets_real_settings_and_probes_migration_service():
    deployment = _template("migration-deployment.yaml")
    assert 'args: ["migration"]' in deployment
    assert "enableServiceLinks: false" in deployment  # else the Service sets PHALANX_MIGRATION_PORT=tcp://…
    names = {name for name in _env(deployment) if _SETTING.fullmatch(name)}
    assert {"PHALANX_MIGRATION_MIGRATION_ID", "PHALANX_MIGRATION_STRATEGY", "PHALANX_MIGRATION_TRIGGER_ON_DEAD"} <= names
    assert _unknown_settings(names) == []
    env = _env(deployment)
    assert env["PHALANX_MIGRATION_MIGRATION_ID"] == "fieldRef:metadata.name"
    assert env["PHALANX_MIGRATION_ADVERTISE_HOST"] == "fieldRef:status.podIP"
    assert env["PHALANX_MIGRATION_HOST"] == '"0.0.0.0"'
    assert env["PHALANX_MIGRATION_PORT"] == env["PHALANX_PROBE_PORT"] == "{{ .Values.migration.grpcPort | quote }}"
    assert env["PHALANX_PROBE_SERVICE"] == MIGRATION_SERVICE == _compose_env("migration")["PHALANX_PROBE_SERVICE"]
    assert {"PHALANX_NATS_URL", "PHALANX_ETCD_ENDPOINT"} <= env.keys()  # DEAD events come over NATS
    assert 'command: ["phalanx-health-probe"]' in deployment
    service = _template("migration-service.yaml")
    assert "clusterIP: None" in service and "name: grpc" in service and "name: metrics" in service


def test_chart_refuses_several_migration_replicas_that_all_act_on_dead_events():
    deployment = _template("migration-deployment.yaml")
    guard = deployment[: deployment.index("apiVersion:")]
    assert "gt (int .Values.migration.replicas) 1" in guard and ".Values.migration.triggerOnDead" in guard and "fail" in guard
    pdb = _template("migration-pdb.yaml")
    first = pdb.splitlines()[0]
    assert ".Values.migration.enabled" in first and "gt (int .Values.migration.replicas) 1" in first


# -- both -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("checkpoint-store-deployment.yaml", "checkpointStore"),
        ("checkpoint-store-service.yaml", "checkpointStore"),
        ("migration-deployment.yaml", "migration"),
        ("migration-service.yaml", "migration"),
        ("migration-pdb.yaml", "migration"),
    ],
)
def test_each_template_is_wrapped_in_its_enabled_flag_and_its_blocks_close(name, flag):
    lines = _template(name).strip().splitlines()
    assert lines[0].startswith("{{- if ") and f".Values.{flag}.enabled" in lines[0], name
    assert lines[-1] == "{{- end }}", name
    text = "\n".join(lines)
    assert len(_BLOCK.findall(text)) == len(_END.findall(text)), name


def test_workers_and_routers_need_no_setting_to_find_them():
    """Both are found through etcd: the chart adds nothing to the worker or router pods for them."""
    for name in ("worker-statefulset.yaml", "router-deployment.yaml"):
        text = _template(name)
        assert "checkpointStore" not in text and ".Values.migration" not in text, name
    # The worker's tensor-channel endpoint binds its advertised host too: the pod IP.
    assert _env(_template("worker-statefulset.yaml"))["PHALANX_WORKER_ADVERTISE_HOST"] == "fieldRef:status.podIP"


def test_notes_mention_both_only_when_enabled():
    notes = _template("NOTES.txt")
    assert "{{- if .Values.checkpointStore.enabled }}\nCheckpoint store:" in notes
    assert "{{- if .Values.migration.enabled }}\nMigration:" in notes


# -- helm -----------------------------------------------------------------------


def _container_env(deployment: dict) -> dict[str, dict]:
    return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_helm_renders_the_store_and_migration_with_their_env_and_ports():
    objects = helm.objects()
    store = objects[("Deployment", "phalanx-checkpoint-store")]
    assert store["spec"]["replicas"] == 1 and store["spec"]["strategy"]["type"] == "Recreate"
    pod = store["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"] == ["checkpoint-store"]
    env = _container_env(store)
    assert env["PHALANX_CHECKPOINT_MEMORY_LIMIT_BYTES"]["value"] == str(_values()["checkpointStore"]["memoryLimitBytes"])
    assert env["PHALANX_CHECKPOINT_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PHALANX_PROBE_SERVICE"]["value"] == STORE_SERVICE
    assert env["PHALANX_PROBE_PORT"]["value"] == env["PHALANX_CHECKPOINT_PORT"]["value"] == "50051"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 50051, "metrics": 9467}
    # Its spill directory, and its certificate (TLS is on by default).
    assert pod["volumes"] == [
        {"name": "phalanx-tls", "secret": {"secretName": "phalanx-checkpoint-store-tls", "defaultMode": 0o440}},
        {"name": "spill", "emptyDir": {"sizeLimit": "8Gi"}},
    ]
    assert "podAntiAffinity" in pod["affinity"]
    store_service = objects[("Service", "phalanx-checkpoint-store")]
    assert store_service["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in store_service["spec"]["ports"]} == {"grpc", "metrics"}

    migration = objects[("Deployment", "phalanx-migration")]
    assert migration["spec"]["replicas"] == 1
    assert migration["spec"]["template"]["spec"]["containers"][0]["args"] == ["migration"]
    env = _container_env(migration)
    assert env["PHALANX_PROBE_SERVICE"]["value"] == MIGRATION_SERVICE
    assert env["PHALANX_MIGRATION_TRIGGER_ON_DEAD"]["value"] == "true"
    assert env["PHALANX_MIGRATION_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert ("Service", "phalanx-migration") in objects
    assert ("PodDisruptionBudget", "phalanx-migration") not in objects  # one replica: it would block drains


def test_helm_leaves_them_out_when_disabled_and_guards_migration_replicas():
    objects = helm.objects("checkpointStore.enabled=false", "migration.enabled=false")
    assert not [key for key in objects if key[1].startswith(("phalanx-checkpoint-store", "phalanx-migration"))]
    with pytest.raises(HelmRenderError, match="triggerOnDead"):
        helm.render("migration.replicas=2")
    objects = helm.objects("migration.replicas=2", "migration.triggerOnDead=false")
    assert objects[("PodDisruptionBudget", "phalanx-migration")]["spec"]["maxUnavailable"] == 1
    assert _container_env(objects[("Deployment", "phalanx-migration")])["PHALANX_MIGRATION_TRIGGER_ON_DEAD"]["value"] == "false"
