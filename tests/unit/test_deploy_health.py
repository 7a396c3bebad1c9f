"""The health service is deployed by compose and the Helm chart, alerted on and on a dashboard.

Static checks of deploy/: every PHALANX_HEALTH_* / PHALANX_DEGRADATION_* name a
deployment sets is a real setting, the probes ask HealthService, the alert rules
name what operators need. promtool, where installed, checks more; Helm renders the chart.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helm_python import HelmRenderError

from phalanx.health.config import DegradationConfig, HealthConfig
from phalanx.testing import helm
from phalanx.testing.settings import unknown_settings

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "phalanx-health.yml"
CHART = DEPLOY / "helm" / "phalanx"
HEALTH_SERVICE = "phalanx.health.v1.HealthService"
LEADER_JOIN = "and on (job, instance) (phalanx_health_leader == 1)"
_SETTING = re.compile(r"PHALANX_(HEALTH|DEGRADATION)_[A-Z0-9_]+")


def _unknown_settings(names) -> list[str]:
    return unknown_settings(names, {"HEALTH": HealthConfig, "DEGRADATION": DegradationConfig})


def _load(path: Path):
    return yaml.safe_load(path.read_text())


def _alerts() -> dict[str, dict]:
    rules = [rule for group in _load(RULES)["groups"] for rule in group["rules"]]
    return {rule["alert"]: rule for rule in rules if "alert" in rule}


def _compose_services() -> dict[str, dict]:
    return _load(DEPLOY / "compose" / "docker-compose.yml")["services"]


# -- compose ------------------------------------------------------------------


def test_compose_runs_two_health_instances_with_distinct_ids_after_nats_and_etcd():
    services = _compose_services()
    health = {name: s for name, s in services.items() if s.get("command") == ["health"]}
    assert sorted(health) == ["health-1", "health-2"]
    ids = {s["environment"]["PHALANX_HEALTH_INSTANCE_ID"] for s in health.values()}
    assert ids == {"health-1", "health-2"}
    for service in health.values():
        assert service["depends_on"]["nats"]["condition"] == "service_healthy"
        assert all(service["depends_on"][f"etcd-{n}"]["condition"] == "service_healthy" for n in (1, 2, 3))
        env = service["environment"]
        assert env["PHALANX_NATS_URL"] == "nats://nats:4222"
        assert env["PHALANX_ETCD_ENDPOINT"] == "etcd-1:2379,etcd-2:2379,etcd-3:2379"
        assert env["PHALANX_HEALTH_HOST"] == "0.0.0.0"  # noqa: S104 - asserts the in-container setting
        assert env["PHALANX_PROBE_PORT"] == env["PHALANX_HEALTH_PORT"]
        assert env["PHALANX_PROBE_SERVICE"] == HEALTH_SERVICE
        assert service["healthcheck"]["test"] == ["CMD", "phalanx-health-probe"]


def test_compose_health_settings_are_real_config_fields():
    for name, service in _compose_services().items():
        if service.get("command") == ["health"]:
            names = [n for n in service["environment"] if _SETTING.fullmatch(n)]
            assert names and _unknown_settings(names) == [], name


def test_compose_keeps_worker_chaos_off_unless_the_environment_turns_it_on():
    for name, service in _compose_services().items():
        if service.get("command") == ["worker"]:
            env = service["environment"]
            assert env["PHALANX_WORKER_CHAOS_ENABLED"] == "${PHALANX_WORKER_CHAOS_ENABLED:-false}", name
            assert env["PHALANX_WORKER_CHAOS_TOKEN"] == "${PHALANX_WORKER_CHAOS_TOKEN:-}", name


def test_prometheus_scrapes_both_health_instances_and_loads_the_rules():
    config = _load(DEPLOY / "prometheus" / "prometheus.yml")
    services = _compose_services()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = jobs["phalanx-health"]["static_configs"][0]["targets"]
    expected = sorted(f"{n}:{services[n]['environment']['PHALANX_HEALTH_METRICS_PORT']}" for n in ("health-1", "health-2"))
    assert sorted(targets) == expected
    assert "/etc/prometheus/rules/*.yml" in config["rule_files"]
    mounts = services["prometheus"]["volumes"]
    assert "../prometheus/rules:/etc/prometheus/rules:ro" in mounts


# -- alert rules --------------------------------------------------------------


def test_alert_rules_cover_unhealthy_workers_degradation_and_token_mismatch():
    alerts = _alerts()
    unhealthy = alerts["PhalanxWorkersUnhealthy"]
    assert 'status=~"unhealthy|draining|dead"' in unhealthy["expr"]
    assert "> 0.05" in unhealthy["expr"] and unhealthy["for"] == "2m"
    degraded = alerts["PhalanxDegraded"]
    assert "phalanx_degradation_level" in degraded["expr"] and "> 0" in degraded["expr"] and degraded["for"] == "5m"
    mismatch = alerts["PhalanxCanaryTokenMismatch"]
    assert 'increase(phalanx_canary_failures_total{reason="token_mismatch"}' in mismatch["expr"]
    assert mismatch["labels"]["severity"] == "critical"
    assert "for" not in mismatch  # the first mismatch pages
    assert "phalanx_health_leader" in alerts["PhalanxHealthNoLeader"]["expr"] and alerts["PhalanxHealthNoLeader"]["for"] == "1m"
    assert "phalanx_circuit_breaker_state" in alerts["PhalanxCircuitOpen"]["expr"] and alerts["PhalanxCircuitOpen"]["for"] == "10m"


def test_alerts_on_worker_gauges_read_only_the_leaders_series():
    for name, rule in _alerts().items():
        expr = " ".join(rule["expr"].split())
        if re.search(r"phalanx_(worker_status|worker_routing_weight|circuit_breaker_state|degradation_level)\b", expr):
            assert LEADER_JOIN in expr, name


def test_every_alert_has_severity_summary_and_description():
    for name, rule in _alerts().items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules_and_their_unit_tests_pass():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = sorted(str(p) for p in (DEPLOY / "prometheus" / "tests").glob("*.test.yml"))
    run = subprocess.run(["promtool", "test", "rules", *tests], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr


# -- Helm chart ---------------------------------------------------------------


def test_chart_runs_two_health_replicas_with_a_pdb_that_keeps_one():
    values = _load(CHART / "values.yaml")
    assert values["health"]["replicas"] == 2
    assert values["health"]["podDisruptionBudget"] == {"enabled": True, "minAvailable": 1}
    assert values["worker"]["chaos"]["enabled"] is False
    pdb = (CHART / "templates" / "health-pdb.yaml").read_text()
    assert "minAvailable: {{ .Values.health.podDisruptionBudget.minAvailable }}" in pdb


def test_chart_health_deployment_probes_health_service_and_sets_real_settings():
    deployment = (CHART / "templates" / "health-deployment.yaml").read_text()
    assert 'args: ["health"]' in deployment
    assert f"value: {HEALTH_SERVICE}" in deployment
    assert "enableServiceLinks: false" in deployment  # else the Service sets PHALANX_HEALTH_PORT=tcp://…
    names = {m.group(0) for m in _SETTING.finditer(deployment)}
    assert {"PHALANX_HEALTH_CHECK_INTERVAL_S", "PHALANX_HEALTH_LEADER_TTL_S", "PHALANX_DEGRADATION_SLO_TTFT_S"} <= names
    assert _unknown_settings(names) == []
    services = (CHART / "templates" / "health-service.yaml").read_text()
    assert "clusterIP: None" in services and "name: metrics" in services


def test_chart_takes_the_worker_chaos_token_only_from_a_secret():
    statefulset = (CHART / "templates" / "worker-statefulset.yaml").read_text()
    block = statefulset[statefulset.index("{{- if $.Values.worker.chaos.enabled }}"):]
    block = block[: block.index("{{- end }}")]
    assert "PHALANX_WORKER_CHAOS_TOKEN" in block and "secretKeyRef" in block and "required" in block


def test_helm_renders_the_health_deployment_services_and_pdb():
    assert {
        ("Deployment", "phalanx-health"),
        ("Service", "phalanx-health"),
        ("Service", "phalanx-health-headless"),
        ("PodDisruptionBudget", "phalanx-health"),
    } <= set(helm.objects())
    with pytest.raises(HelmRenderError, match="tokenSecret"):
        helm.render("worker.chaos.enabled=true")


# -- Grafana ------------------------------------------------------------------


def test_health_dashboard_is_provisioned_with_unique_ids_and_leader_filtered_gauges():
    dashboards = {p.name: json.loads(p.read_text()) for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    health = dashboards["phalanx-health.json"]
    assert len({d["uid"] for d in dashboards.values()}) == len(dashboards)
    ids = [p["id"] for p in health["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in health["panels"] for t in p["targets"]]
    text = "\n".join(exprs)
    for metric in (
        "phalanx_worker_status", "phalanx_worker_routing_weight", "phalanx_circuit_breaker_state",
        "phalanx_health_check_duration_seconds_bucket", "phalanx_canary_failures_total", "phalanx_degradation_level",
        "phalanx_capacity_pressure", "phalanx_health_leader",
    ):
        assert metric in text, metric
    for expr in exprs:
        if re.search(r"phalanx_(worker_status|worker_routing_weight|circuit_breaker_state|degradation_level|capacity_pressure)\b", expr):
            assert LEADER_JOIN in " ".join(expr.split()), expr
    for panel in health["panels"]:
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]


def test_compose_runs_a_three_member_etcd_that_every_service_is_given_whole():
    services = _compose_services()
    members = {f"etcd-{n}" for n in (1, 2, 3)}
    assert members <= services.keys() and "etcd" not in services
    flags = {name: dict(f.split("=", 1) for f in services[name]["command"][1:]) for name in members}
    # Peer URLs are ETCD_* variables, https (docker-compose.plaintext.yml switches them to http).
    environments = {name: services[name]["environment"] for name in members}
    assert len({e["ETCD_INITIAL_CLUSTER"] for e in environments.values()}) == 1  # one cluster, the same three peers for each
    assert set(environments["etcd-1"]["ETCD_INITIAL_CLUSTER"].split(",")) == {f"{m}=https://{m}:2380" for m in members}
    for name in members:
        assert flags[name]["--name"] == name and environments[name]["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"https://{name}:2380"
        assert services[name]["environment"]["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{name}:2379"
        assert flags[name]["--election-timeout"] == "500"  # 1 s leases hold
    volumes = {services[name]["volumes"][0].split(":")[0] for name in members}
    assert len(volumes) == 3  # a data directory each
    for name, service in services.items():
        env = service.get("environment") or {}
        if "PHALANX_ETCD_ENDPOINT" in env:
            assert env["PHALANX_ETCD_ENDPOINT"] == "etcd-1:2379,etcd-2:2379,etcd-3:2379", name
