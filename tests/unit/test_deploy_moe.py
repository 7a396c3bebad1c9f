"""Compose (an override file) and the Helm chart deploy disaggregated MoE as the services expect: real settings, off by default.

Static checks: every PHALANX_EXPERT_* / PHALANX_ERT_* / PHALANX_ENGINE_* variable is a real setting, the expert
workers' slots cover the placement and agree on its size and copies, all parts name one MoE model, the attention
workers get the attention role only when MoE is enabled, and the probes ask the right gRPC services.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx._proto import expert_pb2
from phalanx.ert_manager.config import ErtManagerConfig
from phalanx.ert_manager.table import place
from phalanx.expert_worker.config import ExpertWorkerConfig
from phalanx.model.config import BUILTIN_MODELS, model_hidden_size
from phalanx.testing.settings import unknown_settings
from phalanx.worker.config import EngineConfig

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CHART = DEPLOY / "helm" / "phalanx"
_CONFIGS = {"EXPERT": ExpertWorkerConfig, "ERT": ErtManagerConfig, "ENGINE": EngineConfig}
_SETTING = re.compile(r"PHALANX_(?:EXPERT|ERT|ENGINE)_[A-Z0-9_]+")
SERVICE = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name


def _settings(env: dict, prefix: str, config):
    return config(**{k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)})


def test_compose_moe_override_places_every_expert_twice_and_switches_every_model_naming_part_to_the_moe_model() -> None:
    base = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())["services"]
    override = yaml.safe_load((DEPLOY / "compose" / "docker-compose.moe.yml").read_text())["services"]
    added = {name: s for name, s in override.items() if name not in base}
    assert set(added) == {"ert-manager", "expert-0", "expert-1"}
    assert all(name in base for name in override.keys() - added.keys())  # the rest only override the base's services
    names = {n for s in override.values() for n in s["environment"] if _SETTING.fullmatch(n)}
    assert unknown_settings(names, _CONFIGS) == []
    ert = _settings(added["ert-manager"]["environment"], "PHALANX_ERT_", ErtManagerConfig)
    experts = [_settings(added[f"expert-{i}"]["environment"], "PHALANX_EXPERT_", ExpertWorkerConfig) for i in range(2)]
    model = BUILTIN_MODELS[ert.model]
    assert model.is_moe and {e.model for e in experts} == {ert.model}
    # Every base service that names the model (routers do not route by model) names the MoE one; workers run attention.
    for name, service in base.items():
        env = service.get("environment", {})
        if "profiles" in service:
            continue
        for key in ("PHALANX_ENGINE_MODEL", "PHALANX_ROUTER_MODEL", "PHALANX_GATEWAY_MODEL"):
            if key in env:
                assert override[name]["environment"][key] == ert.model, (name, key)
        if "PHALANX_ENGINE_MODEL" in env:
            assert override[name]["environment"]["PHALANX_ENGINE_ROLE"] == "attention", name
        if "PHALANX_ENCODER_LLM_HIDDEN_SIZE" in env:
            assert int(override[name]["environment"]["PHALANX_ENCODER_LLM_HIDDEN_SIZE"]) == model_hidden_size(ert.model)
    # The base's default services stay monolithic (a profile's may not: `disagg` runs a prefill worker).
    assert not any("PHALANX_ENGINE_ROLE" in s.get("environment", {}) for s in base.values() if "profiles" not in s)
    # One placement: slots 0..n-1 of n workers, the same copies, distinct ids; every expert hosted `copies` times.
    assert sorted(e.index for e in experts) == list(range(len(experts)))
    assert {(e.num_expert_workers, e.copies) for e in experts} == {(len(experts), 2)}
    assert len({e.worker_id for e in experts}) == len(experts)
    hosted = [h.key for e in experts for h in place(model.num_layers, model.num_experts, e.num_expert_workers, e.copies)[e.index]]
    assert len(hosted) == 2 * model.num_layers * model.num_experts and len(set(hosted)) == model.num_layers * model.num_experts
    for name in ("expert-0", "expert-1"):
        env = added[name]["environment"]
        assert env["PHALANX_PROBE_SERVICE"] == SERVICE and env["PHALANX_PROBE_PORT"] == env["PHALANX_EXPERT_PORT"]
        assert env["PHALANX_EXPERT_ADVERTISE_HOST"] == name
    assert added["ert-manager"]["environment"]["PHALANX_PROBE_PORT"] == added["ert-manager"]["environment"]["PHALANX_ERT_PORT"]
    jobs = {job["job_name"]: job for job in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}
    assert set(jobs["phalanx-moe"]["static_configs"][0]["targets"]) == {
        f"ert-manager:{ert.metrics_port}",
        *(f"expert-{i}:{experts[i].metrics_port}" for i in range(2)),
    }


def test_chart_moe_is_off_by_default_sets_real_settings_and_slots_experts_by_pod_ordinal() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["moe"]["enabled"] is False
    assert 0 <= values["moe"]["shadowExperts"] < values["moe"]["expertWorker"]["replicas"]
    template = (CHART / "templates" / "moe.yaml").read_text()
    assert template.lstrip().startswith("{{- if .Values.moe.enabled }}") and template.rstrip().endswith("{{- end }}")
    assert unknown_settings({m.group(0) for m in _SETTING.finditer(template)}, _CONFIGS) == []
    assert 'args: ["expert-worker"]' in template and 'args: ["ert-manager"]' in template
    assert "kind: StatefulSet" in template and "kind: Deployment" in template
    assert "metadata.labels['apps.kubernetes.io/pod-index']" in template  # the slot survives a pod's replacement
    for name in (
        "PHALANX_EXPERT_INDEX",
        "PHALANX_EXPERT_NUM_EXPERT_WORKERS",
        "PHALANX_EXPERT_COPIES",
        "PHALANX_EXPERT_MODEL",
        "PHALANX_ERT_MODEL",
        "PHALANX_EXPERT_ADVERTISE_HOST",
    ):
        assert f"name: {name}\n" in template, name
    workers = (CHART / "templates" / "worker-statefulset.yaml").read_text()
    role = workers.index("name: PHALANX_ENGINE_ROLE")
    assert workers.rindex("{{- if $.Values.moe.enabled }}", 0, role) > workers.rfind("{{- end }}", 0, role)
    assert EngineConfig(role="attention", model="phalanx-tiny-moe").role == "attention"
