"""The Grafana dashboards' queries, for the tests that check them: statically against the metrics the services define,
and live against a real Prometheus scraping a stack."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DASHBOARDS", "PanelQuery", "defined_metrics", "panel_queries", "referenced_metrics", "resolve"]

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
SERVICES = ROOT / "services" / "phalanx"

# What Grafana puts in for its built-in variables, sized for a Prometheus that scrapes every second and a test that
# queries within a minute or two of the events it caused.
GRAFANA_DEFAULTS = {"__rate_interval": "30s", "__interval": "5s", "__range": "5m"}
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}|\[\[(\w+)\]\]")
_DEFINITION = re.compile(r"\b(Counter|Gauge|Histogram)\(\s*\"(phalanx_\w+)\"")
_SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}
_METRIC = re.compile(r"\bphalanx_\w+")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    legend: str
    expr: str


def panel_queries(path: Path) -> list[PanelQuery]:
    """Every target expression of every panel of one dashboard file, as written (variables unresolved)."""
    dashboard = json.loads(path.read_text())
    return [
        PanelQuery(path.name, panel["title"], target.get("legendFormat", ""), target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
    ]


def resolve(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """``expr`` with Grafana's variables put in: the built-in intervals (GRAFANA_DEFAULTS) and the dashboard's own
    (``variables``; a multi-value "All" is ``.*``, which every one of them is matched with by ``=~``)."""
    values = {**GRAFANA_DEFAULTS, **(variables or {})}

    def value(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        return values.get(name, ".*")

    return _VARIABLE.sub(value, expr)


def defined_metrics() -> set[str]:
    """Names of the samples the services export: every prometheus_client Counter/Gauge/Histogram defined under
    services/phalanx with a literal phalanx_* name, with the suffixes the exposition adds."""
    names: set[str] = set()
    for source in SERVICES.rglob("*.py"):
        for kind, name in _DEFINITION.findall(source.read_text()):
            names.update(name + suffix for suffix in _SUFFIXES[kind])
    return names


def referenced_metrics(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))
