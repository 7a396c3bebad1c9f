"""Docstring examples run: every ``>>>`` example in services/phalanx, against a real NATS and etcd where it needs them.

An example that is only a literal block drifts from the API it shows (the service shell's did); as a doctest it fails
the suite the day it stops matching.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import phalanx

pytestmark = pytest.mark.integration

PACKAGE = Path(phalanx.__file__).parent


def _modules_with_examples() -> list[str]:
    """Dotted names of the phalanx modules whose source holds a ``>>>`` example (read, not imported: no torch here)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_proto" in path.parts or ">>> " not in path.read_text(encoding="utf-8"):
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_service_shell_shows_a_service_as_an_example_that_runs():
    assert "phalanx.common.service" in _modules_with_examples()


@pytest.mark.parametrize("name", _modules_with_examples())
def test_the_docstring_examples_of_a_module_run_as_written(name, nats_config, etcd_config, monkeypatch):
    # Examples configure NATS and etcd as a process does: from the environment.
    monkeypatch.setenv("PHALANX_NATS_URL", nats_config.url)
    monkeypatch.setenv("PHALANX_ETCD_ENDPOINT", etcd_config.endpoint)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (the report is above)"
