"""The Helm chart rendered by Helm itself (v4, through the helm-python-sdk library: no `helm` binary needed), so the
tests see what `helm install` would apply, not the templates' text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import yaml

CHART = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "phalanx"
RELEASE = "phalanx"
NAMESPACE = "default"  # what `helm template` uses when none is named

# Switches that refuse to render without a value the operator must choose; the tests give each its required value.
REQUIRED_WITH = {
    "worker.chaos.enabled=true": ("worker.chaos.tokenSecret=phalanx-chaos-token",),
    "tls.certManager.enabled=true": ("tls.enabled=true", "tls.certManager.issuerRef.name=phalanx-ca"),
}


def values_from_sets(*sets: str) -> dict[str, Any]:
    """`--set` items as Helm parses them, later items over earlier ones, as `helm template --set a --set b` does."""
    merged: dict[str, Any] = {}
    for item in sets:
        _merge_into(merged, helm_python.parse_set_string(item))
    return merged


def render(*sets: str) -> dict[str, str]:
    """Every template of the chart rendered for an install; raises helm_python.HelmRenderError where a template refuses."""
    chart = helm_python.Chart.load(CHART)
    return chart.render(values_from_sets(*sets), name=RELEASE, namespace=NAMESPACE, is_install=True)


def documents(*sets: str) -> list[dict[str, Any]]:
    """The Kubernetes objects of one render, in template order (NOTES.txt left out)."""
    return [
        document
        for path, text in sorted(render(*sets).items())
        if path.endswith((".yaml", ".yml"))
        for document in yaml.safe_load_all(text)
        if document
    ]


def objects(*sets: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The rendered objects by (kind, name)."""
    return {(document["kind"], document["metadata"]["name"]): document for document in documents(*sets)}


def lint(*sets: str) -> dict[str, Any]:
    """`helm lint --strict` of the chart with those values: {"messages": [...], "errors": [...]}."""
    return helm_python.lint(CHART, values_from_sets(*sets), strict=True, namespace=NAMESPACE)


def _merge_into(target: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = value
