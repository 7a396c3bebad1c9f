"""Compose runs an encoder as routers expect to find it: real settings, its grpc.health service probed, scraped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx._proto import encoder_pb2
from phalanx.cli.up import UpOptions
from phalanx.encoder_pool.config import EncoderPoolConfig
from phalanx.model.config import model_hidden_size
from phalanx.testing.settings import unknown_settings

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


def _load(path: Path):
    return yaml.safe_load(path.read_text())


def test_compose_encoder_settings_are_real_and_its_probe_asks_the_encoder_service():
    encoder = _load(DEPLOY / "compose" / "docker-compose.yml")["services"]["encoder"]
    env = encoder["environment"]
    assert encoder["command"] == ["encoder-pool"]
    assert unknown_settings([n for n in env if n.startswith("PHALANX_ENCODER_")], {"ENCODER": EncoderPoolConfig}) == []
    assert env["PHALANX_PROBE_SERVICE"] == SERVICE and env["PHALANX_PROBE_PORT"] == env["PHALANX_ENCODER_PORT"]
    EncoderPoolConfig(**{k.removeprefix("PHALANX_ENCODER_").lower(): v for k, v in env.items() if k.startswith("PHALANX_ENCODER_")})


def test_compose_encoder_feeds_the_workers_hidden_size_and_prometheus_scrapes_it():
    services = _load(DEPLOY / "compose" / "docker-compose.yml")["services"]
    env = services["encoder"]["environment"]
    model = next(s["environment"]["PHALANX_ENGINE_MODEL"] for s in services.values() if "PHALANX_ENGINE_MODEL" in s.get("environment", {}))
    assert int(env["PHALANX_ENCODER_LLM_HIDDEN_SIZE"]) == model_hidden_size(model)
    jobs = {job["job_name"]: job for job in _load(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]}
    assert jobs["phalanx-encoder"]["static_configs"][0]["targets"] == [f"encoder:{env['PHALANX_ENCODER_METRICS_PORT']}"]


def test_up_passes_its_encoder_count_to_a_detached_supervisor(tmp_path):
    options = UpOptions(workers=1, model="phalanx-tiny-dense", deterministic=True, port=0, state_file=tmp_path / "up.json", encoders=2)
    command = options.command()
    assert command[command.index("--encoders") + 1] == "2"
    assert "--encoders" not in UpOptions(workers=1, model="m", deterministic=True, port=0, state_file=tmp_path / "s").command()


def test_the_hidden_size_an_encoder_projects_into_is_read_without_weights(tmp_path):
    assert model_hidden_size("phalanx-tiny-dense") == 256
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=300).save_pretrained(tmp_path)
    assert model_hidden_size(tmp_path) == 96


# -- Helm -----------------------------------------------------------------------
CHART = DEPLOY / "helm" / "phalanx"
_ENV = re.compile(r"- name: (PHALANX_[A-Z0-9_]+)\n\s+(?:value: (.+)|valueFrom:\n\s+fieldRef:\n\s+fieldPath: (\S+))")
_BLOCK = re.compile(r"\{\{-?\s*(if|with|range|define)\b")
_END = re.compile(r"\{\{-?\s*end\s*-?\}\}")


def _template(name: str) -> str:
    return (CHART / "templates" / name).read_text()


def _helm_env(template: str) -> dict[str, str]:
    return {m.group(1): m.group(2) or f"fieldRef:{m.group(3)}" for m in _ENV.finditer(template)}


def test_helm_encoder_sets_real_settings_advertises_its_pod_ip_and_probes_the_encoder_service():
    deployment = _template("encoder-deployment.yaml")
    env = _helm_env(deployment)
    assert unknown_settings([n for n in env if n.startswith("PHALANX_ENCODER_")], {"ENCODER": EncoderPoolConfig}) == []
    assert env["PHALANX_ENCODER_ADVERTISE_HOST"] == "fieldRef:status.podIP"
    assert env["PHALANX_ENCODER_ENCODER_ID"] == "fieldRef:metadata.name"  # replicas need distinct ids
    assert env["PHALANX_PROBE_SERVICE"] == SERVICE and env["PHALANX_PROBE_PORT"] == env["PHALANX_ENCODER_PORT"]
    assert 'args: ["encoder-pool"]' in deployment and "enableServiceLinks: false" in deployment
    assert "PHALANX_NATS_URL" not in env  # the encoder uses etcd only


def test_helm_encoder_values_are_valid_settings_and_match_the_served_models_hidden_size():
    values = _load(CHART / "values.yaml")
    encoder = values["encoder"]
    EncoderPoolConfig(
        image_encoder=encoder["imageEncoder"], audio_encoder=encoder["audioEncoder"], llm_hidden_size=encoder["llmHiddenSize"],
        max_batch=encoder["maxBatch"], max_backlog_ms=encoder["maxBacklogMs"], torch_threads=encoder["torchThreads"],
        device=encoder["device"], port=encoder["grpcPort"], metrics_port=encoder["metricsPort"],
    )
    assert encoder["llmHiddenSize"] == model_hidden_size(values["engine"]["model"])
    ports = {v["metricsPort"] for k, v in values.items() if isinstance(v, dict) and "metricsPort" in v and k not in ("encoder", "planner")}
    assert encoder["metricsPort"] not in ports


@pytest.mark.parametrize("name", ["encoder-deployment.yaml", "encoder-service.yaml"])
def test_helm_encoder_templates_are_wrapped_in_their_enabled_flag_and_their_blocks_close(name):
    lines = _template(name).strip().splitlines()
    assert lines[0] == "{{- if .Values.encoder.enabled }}" and lines[-1] == "{{- end }}"
    text = "\n".join(lines)
    assert len(_BLOCK.findall(text)) == len(_END.findall(text))
    assert "app.kubernetes.io/component: encoder" in text
