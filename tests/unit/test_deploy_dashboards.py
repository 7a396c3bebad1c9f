"""Every Grafana dashboard reads only metrics the services export, and the migration and checkpoint-store dashboards
show what an operator watches failures by (stalls seen by clients, migrations by method and outcome, restore time,
checkpoint lag and bytes, store memory and spill). tests/integration/test_dashboards_live.py runs their queries against
a real Prometheus scraping a stack that lost a worker under load."""

from __future__ import annotations

import json

import pytest

from phalanx.checkpoint_store.metrics import CheckpointMetrics
from phalanx.migration.metrics import MigrationMetrics
from phalanx.testing.dashboards import DASHBOARDS, defined_metrics, panel_queries, referenced_metrics, resolve

pytestmark = pytest.mark.unit

NEW = ("phalanx-migration", "phalanx-checkpoint-store", "phalanx-gateway", "phalanx-encoder-pool", "phalanx-moe", "phalanx-engine-failover")
PATHS = sorted(DASHBOARDS.glob("*.json"))


def _load(name: str) -> dict:
    return json.loads((DASHBOARDS / f"{name}.json").read_text())


def _exprs(name: str) -> str:
    return "\n".join(q.expr for q in panel_queries(DASHBOARDS / f"{name}.json"))


def test_every_service_has_a_dashboard_with_a_unique_uid():
    dashboards = {p.stem: json.loads(p.read_text()) for p in PATHS}
    assert set(NEW) <= dashboards.keys()
    assert len({d["uid"] for d in dashboards.values()}) == len(dashboards)
    for stem, dashboard in dashboards.items():
        assert dashboard["uid"] == stem and dashboard["title"].startswith("Phalanx / "), stem


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_panels_have_unique_ids_fit_the_grid_and_read_prometheus(path):
    panels = json.loads(path.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), path.name
    for panel in panels:
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_every_query_reads_metrics_a_service_exports(path):
    exported = defined_metrics()
    for query in panel_queries(path):
        unknown = referenced_metrics(query.expr) - exported
        assert not unknown, f"{path.name} / {query.panel}: {sorted(unknown)} are exported by no service"


def test_variables_resolve_to_a_plain_query():
    expr = 'sum by (worker) (rate(x{worker=~"$worker"}[$__rate_interval])) + y[${__range}]'
    assert resolve(expr) == 'sum by (worker) (rate(x{worker=~".*"}[30s])) + y[5m]'
    assert resolve(expr, {"worker": "w1"}) == 'sum by (worker) (rate(x{worker=~"w1"}[30s])) + y[5m]'
    for path in PATHS:
        for query in panel_queries(path):
            assert "$" not in resolve(query.expr), query


def test_migration_dashboard_shows_client_stalls_methods_outcomes_and_restores():
    text = _exprs("phalanx-migration")
    for name in (
        "phalanx_migration_stall_seconds_bucket",  # the router's: the gap the client saw
        "phalanx_migration_total", "phalanx_migration_failures_total", "phalanx_migration_duration_seconds_bucket",
        "phalanx_checkpoint_restore_seconds_bucket", "phalanx_router_migrations_total",
    ):
        assert name in text, name
    assert "sum by (method) (increase(phalanx_migration_total" in text


def test_checkpoint_store_dashboard_shows_lag_bytes_memory_spill_and_restore_time():
    text = _exprs("phalanx-checkpoint-store")
    for name in (
        "phalanx_checkpoint_lag_tokens", "phalanx_checkpoint_sent_bytes_total", "phalanx_checkpoint_bytes_received_total",
        "phalanx_checkpoint_memory_bytes", "phalanx_checkpoint_memory_limit_bytes", "phalanx_checkpoint_spilled_bytes",
        "phalanx_checkpoint_restore_seconds_bucket",
    ):
        assert name in text, name


@pytest.mark.parametrize(
    ("dashboards", "metrics"),
    [(("phalanx-migration",), MigrationMetrics), (("phalanx-checkpoint-store", "phalanx-migration"), CheckpointMetrics)],
)
def test_every_metric_of_migration_and_the_store_is_on_a_panel(dashboards, metrics):
    text = "\n".join(_exprs(name) for name in dashboards)
    for family in metrics().registry.collect():
        assert family.name in text, f"{family.name} is on no panel"


def test_variables_are_prometheus_queries_of_exported_metrics():
    exported = defined_metrics()
    for path in PATHS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            assert referenced_metrics(variable["definition"]) <= exported, (path.name, variable["name"])


def test_migration_metrics_start_with_every_method_so_rate_sees_the_first_migration():
    from phalanx.migration.core import METHOD_NAMES
    from phalanx.migration.metrics import METHODS

    assert set(METHODS) == set(METHOD_NAMES.values())
    samples = {(s.name, s.labels.get("method")) for f in MigrationMetrics().registry.collect() for s in f.samples}
    for method in METHODS:
        assert ("phalanx_migration_total", method) in samples and ("phalanx_migration_duration_seconds_count", method) in samples
