"""Compose runs an encoder as routers expect to find it: real settings, its grpc.health service probed, scraped."""

from __future__ import annotations

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
