"""The Helm chart's planner: off by default, its settings real PHALANX_PLANNER_* names, and RBAC limited to the
worker StatefulSet's scale subresource (static checks, and the chart as Helm renders it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.planner.config import PlannerConfig
from phalanx.testing import helm
from phalanx.testing.settings import unknown_settings

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "phalanx"
TEMPLATE = CHART / "templates" / "planner.yaml"


def test_the_planner_is_off_by_default_and_gated_on_planner_enabled():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["planner"]["enabled"] is False
    text = TEMPLATE.read_text()
    assert text.lstrip().startswith("{{- if .Values.planner.enabled }}") and text.rstrip().endswith("{{- end }}")


def test_every_planner_setting_the_chart_sets_exists():
    names = set(re.findall(r"PHALANX_PLANNER_[A-Z0-9_]+", TEMPLATE.read_text()))
    assert "PHALANX_PLANNER_CONNECTOR" in names
    assert unknown_settings(names, {"PLANNER": PlannerConfig}) == []


def test_the_role_allows_only_reading_the_statefulset_and_scaling_it():
    text = TEMPLATE.read_text()
    rules = text.split("rules:", 1)[1].split("---", 1)[0]
    assert re.findall(r'resources: \["([^"]+)"\]', rules) == ["statefulsets", "statefulsets/scale"]
    assert re.findall(r"verbs: \[(.*)\]", rules) == ['"get"', '"get", "patch", "update"']
    assert "serviceAccountName:" in text and "kind: RoleBinding" in text


def test_helm_renders_the_planner_only_when_enabled():
    assert not [key for key in helm.objects() if "planner" in key[1]]
    on = {key for key in helm.objects("planner.enabled=true") if "planner" in key[1]}
    assert {kind for kind, _ in on} == {"ServiceAccount", "Role", "RoleBinding", "Deployment"}


def test_with_prefill_workers_the_planner_plans_two_pools_and_may_scale_the_prefill_statefulset():
    objects = helm.objects("planner.enabled=true", "worker.prefill.enabled=true")
    role = objects[("Role", "phalanx-planner")]
    for rule in role["rules"]:
        assert rule["resourceNames"] == ["phalanx-worker", "phalanx-worker-prefill"]
    assert ("StatefulSet", "phalanx-worker-prefill") in objects
    (container,) = objects[("Deployment", "phalanx-planner")]["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["PHALANX_PLANNER_DISAGGREGATED"] == "true"
    assert env["PHALANX_PLANNER_KUBE_PREFILL_STATEFULSET"] == "phalanx-worker-prefill"
    assert (env["PHALANX_PLANNER_PREFILL_MIN_WORKERS"], env["PHALANX_PLANNER_PREFILL_MAX_WORKERS"]) == ("1", "4")
    aggregated = helm.objects("planner.enabled=true")
    assert all(rule["resourceNames"] == ["phalanx-worker"] for rule in aggregated[("Role", "phalanx-planner")]["rules"])
    (container,) = aggregated[("Deployment", "phalanx-planner")]["spec"]["template"]["spec"]["containers"]
    assert not [item for item in container["env"] if "PREFILL" in item["name"] or "DISAGGREGATED" in item["name"]]


def test_the_planner_dashboard_shows_every_planner_metric_and_filters_gauges_to_the_leader():
    import json

    from phalanx.planner.metrics import PlannerMetrics

    dashboard = json.loads((CHART.parents[1] / "grafana" / "dashboards" / "phalanx-planner.json").read_text())
    assert dashboard["title"] == "Phalanx / Planner" and dashboard["uid"] == "phalanx-planner"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    text = "\n".join(exprs)
    exported = {metric.name for metric in PlannerMetrics().registry.collect()}
    for name in exported:
        assert name in text, f"{name} is on no panel"
    for expr in exprs:
        if re.search(r"phalanx_planner_(target|desired|actual)(_prefill)?_workers|_per_second|_osl_tokens|correction_factor|interval_seconds", expr):
            assert "and on (job, instance) (phalanx_planner_leader == 1)" in expr, expr


def test_compose_runs_the_planner_with_real_settings_and_prometheus_scrapes_it():
    import yaml

    from phalanx.planner.config import PlannerConfig

    deploy = CHART.parents[1]
    service = yaml.safe_load((deploy / "compose" / "docker-compose.yml").read_text())["services"]["planner"]
    assert service["command"] == ["planner"]
    env = service["environment"]
    planner_settings = {n.removeprefix("PHALANX_PLANNER_").lower() for n in env if n.startswith("PHALANX_PLANNER_")}
    assert planner_settings <= set(PlannerConfig.model_fields), planner_settings - set(PlannerConfig.model_fields)
    assert env["PHALANX_PROBE_PORT"] == env["PHALANX_PLANNER_PORT"]
    jobs = {j["job_name"]: j for j in yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs["phalanx-planner"]["static_configs"][0]["targets"] == [f"planner:{env['PHALANX_PLANNER_METRICS_PORT']}"]
