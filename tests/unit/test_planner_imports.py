"""The planner's modules load their heavy numerical libraries only where they are used: a process that imports
the replica maths (a simulated worker reading a profile, the health service reading capacity) does not pay
for statsmodels, Prophet or matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

HEAVY = ("scipy", "statsmodels", "filterpy", "prophet", "pandas", "matplotlib", "threadpoolctl")
MODULES = (
    "phalanx.planner.predictors",
    "phalanx.planner.profile",
    "phalanx.planner.correction",
    "phalanx.planner.replicas",
    "phalanx.planner.decisions",
    "phalanx.planner.observations",
    "phalanx.planner.dryrun",
)


def test_importing_the_planner_modules_loads_no_heavy_library() -> None:
    # A fresh interpreter: this test process has them loaded already through the other planner tests.
    probe = (
        "import importlib, json, sys\n"
        f"for name in {MODULES!r}: importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) == []
