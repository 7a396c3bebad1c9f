"""Prefill/decode pools where Phalanx is deployed: compose's `disagg` profile (the chart's pools are rendered by Helm in
test_helm_chart.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from phalanx.testing.settings import unknown_settings
from phalanx.worker.config import EngineConfig, WorkerConfig

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "docker-compose.yml"


def test_compose_disagg_profile_adds_a_prefill_worker_with_real_settings_beside_the_default_workers():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    prefill = services["worker-prefill-1"]
    assert prefill["profiles"] == ["disagg"]
    env = prefill["environment"]
    assert EngineConfig(role=env["PHALANX_ENGINE_ROLE"]).role == "prefill"
    assert env["PHALANX_WORKER_WORKER_ID"] == env["PHALANX_WORKER_ADVERTISE_HOST"] == "worker-prefill-1"
    assert unknown_settings(env, {"WORKER": WorkerConfig, "ENGINE": EngineConfig}) == []
    # The default workers stay in every profile: they decode what the prefill worker hands over.
    assert all("profiles" not in services[name] for name in ("worker-1", "worker-2"))
    assert prefill["image"] == services["worker-1"]["image"] and prefill["command"] == services["worker-1"]["command"]
