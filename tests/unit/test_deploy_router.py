"""The routers' latency SLO is alerted on, from metrics the router really exports.

promtool, where installed, checks the rules and runs their unit tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from phalanx.router.metrics import RouterMetrics

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "phalanx-router.yml"


def _alerts() -> dict[str, dict]:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    return {rule["alert"]: rule for rule in rules if "alert" in rule}


def _exported() -> set[str]:
    """Sample names a router's /metrics carries (counters with _total, histograms with _count ...)."""
    metrics = RouterMetrics()
    metrics.slo_violations.labels(kind="ttft")
    metrics.ttft.labels(tier="standard")
    metrics.itl.labels(tier="standard")
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_latency_slo_alert_compares_violations_with_what_was_relayed_per_kind():
    rule = _alerts()["PhalanxLatencySloMissed"]
    expr = " ".join(rule["expr"].split())
    names = set(re.findall(r"\bphalanx_[a-z_]+", expr))
    assert names == {"phalanx_router_slo_violations_total", "phalanx_router_ttft_seconds_count", "phalanx_router_itl_seconds_count"}
    assert names <= _exported()
    assert '"kind", "ttft"' in expr and '"kind", "itl"' in expr and "> 0.05" in expr
    assert rule["for"] == "10m" and rule["labels"]["severity"] == "warning"
    assert "level 3" in rule["annotations"]["description"]


def test_prometheus_loads_the_router_rules():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert "/etc/prometheus/rules/*.yml" in config["rule_files"]
    assert RULES.parent.name == "rules"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_router_rules_and_their_unit_tests_pass():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    test = DEPLOY / "prometheus" / "tests" / "phalanx-router.test.yml"
    run = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_quarantined_request_alerts_from_the_counter_the_router_exports():
    rule = _alerts()["PhalanxRequestQuarantined"]
    expr = " ".join(rule["expr"].split())
    assert set(re.findall(r"\bphalanx_[a-z_]+", expr)) == {"phalanx_router_requests_quarantined_total"} <= _exported()
    assert "for" not in rule and rule["labels"]["severity"] == "warning"
    assert "phalanx quarantine list" in rule["annotations"]["description"]
