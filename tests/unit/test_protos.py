"""The stubs in phalanx._proto are exactly what protos/ compiles to."""

import importlib.util
from pathlib import Path

import pytest

import phalanx._proto

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_built_stubs_match_the_protos(tmp_path):
    fresh = tmp_path / "_proto"
    _generator().generate(fresh)
    built = Path(phalanx._proto.__file__).parent
    fresh_files = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    built_files = {p.relative_to(built): p.read_text() for p in built.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert fresh_files.keys() == built_files.keys(), "stub files differ: reinstall (pip install -e .) after editing protos/"
    stale = [str(name) for name in fresh_files if fresh_files[name] != built_files[name]]
    assert not stale, f"stale stubs {stale}: reinstall after editing protos/"


def test_every_service_uses_its_own_request_and_response_messages():
    modules = [getattr(phalanx._proto, name) for name in phalanx._proto.__all__ if name.endswith("_pb2")]
    services = [s for m in modules for s in m.DESCRIPTOR.services_by_name.values()]
    assert {s.name for s in services} >= {"RouterService", "WorkerService"}
    for service in services:
        for method in service.methods:
            assert method.input_type.name == f"{method.name}Request"
            assert method.output_type.name == f"{method.name}Response"
