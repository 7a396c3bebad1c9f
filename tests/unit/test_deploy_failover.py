"""The failover pod as the Helm chart and compose deploy it: real settings, the state probes, one shared tmpfs.

Static checks (helm, where installed, renders the chart in the other deploy tests): every PHALANX_WORKER_* /
PHALANX_MEMORY_* variable the failover parts set is a real setting, the engines probe /startup, /live and /ready
on their metrics ports, and the lock, socket and segments live on one memory-backed volume.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.failover.memory_service import MemoryServiceConfig
from phalanx.testing.settings import unknown_settings
from phalanx.worker.config import EngineConfig, WorkerConfig

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
STATEFULSET = DEPLOY / "helm" / "phalanx" / "templates" / "worker-statefulset.yaml"
_SETTING = re.compile(r"PHALANX_(?:WORKER|MEMORY|ENGINE)_[A-Z0-9_]+")
_CONFIGS = {"WORKER": WorkerConfig, "MEMORY": MemoryServiceConfig, "ENGINE": EngineConfig}
MOUNT = "/var/run/phalanx-failover"


def test_chart_failover_pod_sets_real_settings_probes_by_state_and_one_tmpfs() -> None:
    template = STATEFULSET.read_text()
    block = template[template.index("{{- if .Values.worker.failover.enabled }}"):]
    assert unknown_settings({m.group(0) for m in _SETTING.finditer(template)}, _CONFIGS) == []
    for name in ("PHALANX_WORKER_FAILOVER_ROLE", "PHALANX_WORKER_ENGINE_ID", "PHALANX_WORKER_FAILOVER_LOCK",
                 "PHALANX_WORKER_MEMORY_SOCKET", "PHALANX_WORKER_FAILOVER_SLOT", "PHALANX_MEMORY_SOCKET_PATH"):
        assert name in block, name
    for probe in ("/startup", "/live", "/ready"):
        assert f"path: {probe}" in template
    assert "medium: Memory" in template and f"mountPath: {MOUNT}" in template
    assert 'args: ["memory-service"]' in template
    values = yaml.safe_load((DEPLOY / "helm" / "phalanx" / "values.yaml").read_text())
    assert values["worker"]["failover"]["enabled"] is False  # the plain worker stays the default


def test_compose_failover_profile_runs_a_memory_service_and_two_engines_on_one_tmpfs() -> None:
    services = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())["services"]
    memory, primary, shadow = services["slot-3-memory"], services["worker-3-e0"], services["worker-3-e1"]
    assert all(s["profiles"] == ["failover"] for s in (memory, primary, shadow))
    assert {s["volumes"][0] for s in (memory, primary, shadow)} == {f"slot-3:{MOUNT}"}
    engines = [primary["environment"], shadow["environment"]]
    assert [(e["PHALANX_WORKER_FAILOVER_ROLE"], e["PHALANX_WORKER_ENGINE_ID"]) for e in engines] == [("primary", "0"), ("shadow", "1")]
    assert {e["PHALANX_WORKER_FAILOVER_SLOT"] for e in engines} == {"slot-3"}
    assert {e["PHALANX_WORKER_MEMORY_SOCKET"] for e in engines} == {memory["environment"]["PHALANX_MEMORY_SOCKET_PATH"]}
    names = {n for s in (memory, primary, shadow) for n in s["environment"] if n.startswith(("PHALANX_WORKER_", "PHALANX_MEMORY_"))}
    assert unknown_settings(names, _CONFIGS) == []
