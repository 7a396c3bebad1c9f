"""The Dockerfile builds under the classic builder and BuildKit alike, and compose publishes only what it must, on
loopback, with tracing optional. tests/deploy/test_compose_live.py runs it all (``pytest -m compose tests/deploy``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
PUBLISHED = {"router-1", "router-2", "health-1", "health-2", "gateway", "prometheus", "grafana", "jaeger"}
PORT = re.compile(r"^\$\{PHALANX_BIND_ADDRESS:-127\.0\.0\.1\}:\$\{PHALANX_[A-Z0-9_]+_HOST_PORT:-\d+\}:\d+$")


def _services(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())["services"]


def test_the_dockerfile_needs_no_frontend_image_and_no_heredoc():
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.MULTILINE), "a syntax line makes BuildKit fetch a frontend image"
    assert "<<" not in text, "heredocs fail in the classic builder and BuildKit's built-in frontend"
    assert "--chmod" not in text, "the classic builder has no COPY --chmod"


def test_the_health_probe_is_an_executable_file_of_the_repository():
    assert "COPY scripts/phalanx-health-probe /usr/local/bin/phalanx-health-probe" in (ROOT / "Dockerfile").read_text()
    mode = subprocess.run(["git", "ls-files", "-s", "scripts/phalanx-health-probe"], cwd=ROOT, capture_output=True, text=True).stdout
    assert mode.startswith("100755 "), f"not executable in git: {mode!r}"
    compile((ROOT / "scripts" / "phalanx-health-probe").read_text(), "phalanx-health-probe", "exec")


def test_torch_comes_from_a_build_argument_and_grpcio_tools_stays_out_of_the_image():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r'pip install torch==\S+ --index-url "\$TORCH_INDEX_URL"', text)
    # Generated from a venv of its own, which the final stage does not copy.
    assert "/opt/gen/bin/pip install grpcio-tools" in text
    assert "COPY --from=build /opt/venv /opt/venv" in text and "COPY --from=build /opt/gen" not in text


def test_only_the_public_entries_are_published_and_on_loopback_by_default():
    for name in ("docker-compose.yml", "docker-compose.plaintext.yml", "docker-compose.moe.yml", "docker-compose.moe-plaintext.yml"):
        for service, spec in _services(name).items():
            for port in spec.get("ports", []):
                assert service in PUBLISHED, f"{name}: {service} publishes {port}"
                assert PORT.match(port), f"{name}: {service} publishes {port}, not on ${{PHALANX_BIND_ADDRESS:-127.0.0.1}}"
    published = {s for s, spec in _services().items() if spec.get("ports")}
    assert published == PUBLISHED
    assert not {"nats", "etcd-1", "etcd-2", "etcd-3"} & published


def test_tracing_is_a_profile_nothing_depends_on():
    services = _services()
    assert services["jaeger"]["profiles"] == ["tracing"]
    for name in ("docker-compose.yml", "docker-compose.plaintext.yml", "docker-compose.moe.yml", "docker-compose.moe-plaintext.yml"):
        for service, spec in _services(name).items():
            assert "jaeger" not in (spec.get("depends_on") or {}), f"{name}: {service} depends on jaeger"
            endpoint = (spec.get("environment") or {}).get("PHALANX_TELEMETRY_OTLP_ENDPOINT")
            assert endpoint in (None, "${PHALANX_TELEMETRY_OTLP_ENDPOINT:-}"), f"{name}: {service} exports to {endpoint}"
